"""The HF trainer loads MoE checkpoints with transformers' grouped-GEMM experts, keeps LoRA on q/k/v/o, and
records which experts implementation ran; dense checkpoints get no experts_implementation at all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.tools.trainer_bench import SHAPES, bench_run, fixed_batch, random_model
from hybridrl.trainers import grouped_mm
from hybridrl.trainers.hf import HFTrainer, experts_implementation


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model(tmp_path_factory.mktemp("moe") / "model", SHAPES["tiny-moe"], "float32")


def _step(trainer: HFTrainer, out: Path) -> dict[str, object]:
    shape = SHAPES["tiny-moe"]
    batch = fixed_batch(shape.config["vocab_size"], 4, shape.prompt, shape.completion)
    return trainer.step(1, batch, out).metrics


def test_moe_loads_grouped_experts_with_attention_lora(moe_model: Path, tmp_path: Path) -> None:
    run = bench_run(SHAPES["tiny-moe"], "hf", "cpu", 4, None)
    trainer = HFTrainer(moe_model, run)
    try:
        base = trainer.model.get_base_model()
        assert base.config._experts_implementation == "grouped_mm" == trainer.experts_impl
        adapted = {n.rsplit(".", 1)[-1] for n, m in base.named_modules() if hasattr(m, "lora_A")}
        assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
        metrics = _step(trainer, tmp_path / "a")
        assert metrics["train/experts_impl"] == "grouped_mm"
        # every adapter got a gradient through the grouped experts: B moved off zero in every layer
        b_norms = [float(p.norm()) for n, p in trainer.model.named_parameters() if "lora_B" in n]
        assert len(b_norms) == 4 * 2 and min(b_norms) > 0
    finally:
        trainer.close()


def test_eager_where_grouped_mm_does_not_run(moe_model: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a working kernel the experts fall back to eager, and the step's loss is the grouped one's."""
    run = bench_run(SHAPES["tiny-moe"], "hf", "cpu", 4, None)
    grouped = HFTrainer(moe_model, run)
    loss = _step(grouped, tmp_path / "g")["train/loss"]
    grouped.close()
    monkeypatch.setattr(grouped_mm, "kernel_runs", lambda device_type, dtype: False)
    assert experts_implementation(moe_model, torch.device("cpu"), torch.float32) == {
        "experts_implementation": "eager"}
    eager = HFTrainer(moe_model, run)
    try:
        assert eager.experts_impl == "eager"
        metrics = _step(eager, tmp_path / "e")
        assert metrics["train/experts_impl"] == "eager"
        assert metrics["train/loss"] == pytest.approx(loss, abs=1e-5)
    finally:
        eager.close()


def test_dense_model_gets_no_experts_implementation(tmp_path: Path) -> None:
    model = random_model(tmp_path / "dense", SHAPES["tiny"], "float32")
    assert experts_implementation(model, torch.device("cpu"), torch.float32) == {}
