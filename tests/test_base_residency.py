"""keep_base_on_gpu auto: the colocated trainer's frozen base stays on the GPU only where each GPU's measured free
memory holds the engine's share beside it, decided before the engine's first start and recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from hybridrl import gpu_specs
from hybridrl.report import floor_model, floors
from hybridrl.run import base_residency
from hybridrl.run.placement import make_placement
from hybridrl.study.run_config import RunConfig
from hybridrl.trainers.megatron import worker

H100 = 79.6  # GB NVML reports


def test_the_base_stays_only_where_every_gpu_holds_the_engines_share_and_the_margin() -> None:
    fits = base_residency.decide({0: (30.0, H100), 1: (31.0, H100)}, 0.5)
    assert fits["kept"] and fits["need_gb"] == {"0": round(0.5 * H100 + 4, 2), "1": round(0.5 * H100 + 4, 2)}
    assert "the base stays" in fits["why"]
    # one GPU short of it (the sharded trainer's first rank holds more) is enough to offload
    short = base_residency.decide({0: (30.0, H100), 1: (37.0, H100)}, 0.5)
    assert not short["kept"] and short["why"].startswith("GPU 1 has 42.6 GB free")
    assert not base_residency.decide({}, 0.5)["kept"]  # nothing read: the safe side


class Trainer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def offload(self) -> None:
        self.calls.append("offload")

    def release_base(self) -> None:
        self.calls.append("release_base")


class Engine:
    def start(self, adapter: Any = None) -> None:
        pass


class Sampler:
    def __init__(self, used_gb: float) -> None:
        self.used_gb = used_gb

    def memory_gb(self) -> dict[int, tuple[float, float]]:
        return {0: (self.used_gb, H100)}

    def set_phase(self, phase: str) -> None:
        pass


def _run(keep: bool | str, placement: str = "colocate") -> RunConfig:
    return RunConfig(model="m", engine="vllm", placement=placement, trainer="hf", device="cuda",
                     keep_base_on_gpu=keep, gpu_memory_utilization=0.5)


@pytest.mark.parametrize(("used_gb", "released"), [(20.0, False), (40.0, True)])
def test_the_placement_decides_after_the_offload_and_before_the_engine_starts(used_gb: float, released: bool) -> None:
    trainer = Trainer()
    placement = make_placement("colocate", Engine(), trainer, Sampler(used_gb), _run("auto"))
    placement.start_engine(None)
    assert trainer.calls == ["offload", "release_base"] if released else ["offload"]
    assert placement.base_residency["kept"] is not released and placement.base_residency["mode"] == "auto"


@pytest.mark.parametrize("keep", [True, False])
def test_a_fixed_setting_is_not_second_guessed(keep: bool) -> None:
    trainer = Trainer()
    placement = make_placement("colocate", Engine(), trainer, Sampler(79.0), _run(keep))
    placement.start_engine(None)
    assert trainer.calls == ["offload"] and placement.base_residency is None


def test_split_keeps_its_trainer_on_its_own_gpus() -> None:
    trainer = Trainer()
    make_placement("split", Engine(), trainer, Sampler(79.0), _run("auto", "split")).start_engine(None)
    assert trainer.calls == []


def test_the_hf_trainer_starts_keeping_the_base_under_auto_and_stops_when_told(tmp_path: Path) -> None:
    from hybridrl.tools import trainer_bench
    from hybridrl.trainers.hf import HFTrainer

    shape = trainer_bench.SHAPES["tiny"]
    model = trainer_bench.random_model(tmp_path / "model", shape, "float32")
    run = trainer_bench.bench_run(shape, "hf", "cpu", 4, None).model_copy(update={"keep_base_on_gpu": "auto"})
    trainer = HFTrainer(model, run, "cpu")
    assert trainer.keep_base
    trainer.release_base()
    assert not trainer.keep_base
    assert not HFTrainer(model, run.model_copy(update={"keep_base_on_gpu": False}), "cpu").keep_base


def test_the_megatron_workers_release_their_base_on_the_controllers_word() -> None:
    class Policy:
        released = False

        def release_base(self) -> None:
            self.released = True

        def gpu_memory(self) -> dict[str, float]:
            return {"mem/trainer_r0_gb": 1.0}

    policy = Policy()
    out = worker._handle(policy, {"op": "release_base"})
    assert policy.released and out["memory"] == {"mem/trainer_r0_gb": 1.0}


def test_the_onload_floor_counts_the_base_by_what_the_step_recorded() -> None:
    shape = floor_model.shape_of({"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
                                  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
                                  "vocab_size": 32, "tie_word_embeddings": True})
    config = {"tp": 1, "train_tp": 1, "lora": {"rank": 2, "target_modules": ["q_proj"]}, "keep_base_on_gpu": "auto"}
    inputs = floors.RunInputs("r", config, "NVIDIA H200", gpu_specs.spec("NVIDIA H200"), shape, "test",
                              {"h2d_gb_s": 20.0, "d2h_gb_s": 10.0}, Path("/nonexistent"))
    kept = floors.phase_floor(inputs, "timing_s/trainer_onload", pd.Series({"step": 2, "train/keep_base_on_gpu": True}))
    moved = floors.phase_floor(inputs, "timing_s/trainer_onload", pd.Series({"step": 2,
                                                                             "train/keep_base_on_gpu": False}))
    assert kept.basis.endswith("LoRA state at 20.0 GB/s host→device (measured)") and "base" not in kept.basis
    assert "base weights" in moved.basis and moved.seconds > kept.seconds
