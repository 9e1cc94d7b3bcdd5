"""Rollout engines behind one small interface (engines.base.Engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridrl.engines.base import Engine
from hybridrl.engines.jit_cache import with_jit_workspace
from hybridrl.study.run_config import RunConfig


def make_engine(run: RunConfig, model_dir: Path, env_spec: dict[str, Any], log_dir: Path) -> Engine:
    """Import only the chosen engine: each lives in its own environment, with its own FlashInfer workspace."""
    env_spec = with_jit_workspace(run.engine, env_spec)
    if run.engine == "vllm":
        from hybridrl.engines.vllm import VLLMServer

        return VLLMServer(model_dir, run, env_spec, log_dir)
    if run.engine == "sglang":
        from hybridrl.engines.sglang import SGLangServer

        return SGLangServer(model_dir, run, env_spec, log_dir)
    if run.engine == "vllm-inprocess":
        from hybridrl.engines.vllm_inprocess import VLLMInProcess

        return VLLMInProcess(model_dir, run, env_spec, log_dir)
    raise ValueError(f"unknown engine {run.engine!r}")
