"""Trainers behind one small interface (trainers.base.Trainer)."""

from __future__ import annotations

from pathlib import Path

from hybridrl.study.run_config import RunConfig
from hybridrl.trainers.base import Trainer


def make_trainer(run: RunConfig, model_dir: Path, work_dir: Path) -> Trainer | None:
    """None for trainer: none (inference-only mode; the loop holds a memory ballast instead)."""
    if run.trainer == "hf":
        from hybridrl.trainers.hf import HFTrainer

        return HFTrainer(model_dir, run)
    if run.trainer == "megatron":
        from hybridrl.trainers.megatron.trainer import MegatronTrainer

        return MegatronTrainer(model_dir, run, work_dir)
    if run.trainer == "none":
        return None
    raise ValueError(f"unknown trainer {run.trainer!r}")
