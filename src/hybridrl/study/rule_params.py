"""What the Snakefile's rules pass to `python -m hybridrl`: a run's config file, the data and model arguments."""

from __future__ import annotations

import json
from typing import Any

from hybridrl.study.config import DATA_DEFAULTS, Study
from hybridrl.study.run_config import RunSpec


def run_spec_json(study: Study, rid: str) -> str:
    """A run's config file as `python -m hybridrl train --run-config` reads it (the `run_config` rule's output)."""
    run = study.runs[rid]
    spec = RunSpec(run_id=rid, run=run, study=study.name, engine_env=study.engine_envs.get(run.engine, {}))
    return spec.model_dump_json()


def data_params(data: dict[str, Any]) -> dict[str, Any]:
    """The `data` rule's params: the study's data spec with the command's defaults filled in."""
    return {"source": data["source"], **{k: data.get(k, default) for k, default in DATA_DEFAULTS.items()}}


def model_spec(spec: dict[str, Any]) -> str:
    """A model's config entry as the `model` rule passes it to `--spec` (sorted: a reordered YAML reruns nothing)."""
    return json.dumps(spec, sort_keys=True)


def model_build_gpus(spec: dict[str, Any], fake_gpus: bool = False) -> int:
    """GPUs a random-init build asks for: one where its weights are drawn or warm-started on CUDA (on the CI
    cluster's fake GPUs, one for any warm start, so that the GPU path is exercised), else none."""
    warm = spec.get("warm_start") or {}
    on_gpu = spec.get("init_device") == "cuda" or warm.get("device") == "cuda"
    return 1 if on_gpu or (warm and fake_gpus) else 0
