"""Where each engine keeps the kernels FlashInfer builds on its first start.

SGLang's and vLLM's overlays ship the same FlashInfer version, each at its own path. In the one workspace FlashInfer
uses by default (~/.cache/flashinfer), the two engines' build lines differ, so ninja rebuilt the other engine's
kernels at every switch between them: minutes of nvcc at each first start (its all-reduce fusion at TP 2, its
sampler). So SGLang builds in a workspace of its own, and vLLM (its server and in process, one overlay) keeps the
default one, where the builds that earlier leases carried are. A workspace the study or the environment names is
kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WORKSPACE_VAR = "FLASHINFER_WORKSPACE_BASE"  # FlashInfer keeps its builds under $VAR/.cache/flashinfer
OWN_WORKSPACES = {"sglang": Path(".cache") / "flashinfer-sglang"}  # under $HOME; lease-caches.sh carries them


def engine_family(engine: object) -> str:
    """The engines that share one overlay and so one machine's compiled kernels: vLLM's server and in-process vLLM
    are vLLM's."""
    return str(engine).split("-")[0]


def jit_workspace(engine: str, home: Path | None = None) -> Path:
    """The FlashInfer workspace base of an engine's family: its own, or $HOME (FlashInfer's default) for vLLM's."""
    home = home or Path.home()
    own = OWN_WORKSPACES.get(engine_family(engine))
    return home / own if own else home


def with_jit_workspace(engine: str, env_spec: Mapping[str, Any], environ: Mapping[str, str] = os.environ,
                       home: Path | None = None) -> dict[str, Any]:
    """The engine's env spec with its FlashInfer workspace added, unless the spec or the environment sets one."""
    env = dict(env_spec.get("env", {}))
    if WORKSPACE_VAR not in env and WORKSPACE_VAR not in environ:
        env[WORKSPACE_VAR] = str(jit_workspace(engine, home))
    return {**env_spec, "env": env}
