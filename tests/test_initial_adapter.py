"""The drawn first adapter (lora.init_b_std): PEFT's names and shapes for dense and MoE models, the same draw for the
same seed, none at 0, and a run id that only a set value changes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hybridrl.run.initial_adapter import write_initial_adapter
from hybridrl.study.run_config import run_id
from hybridrl.tools import megatron_parity as parity
from hybridrl.trainers.adapter_files import WEIGHTS_FILE


def _drawn(std: float = 0.05, **over):
    run = parity.default_run(**over)
    return run.model_copy(update={"lora": run.lora.model_copy(update={"init_b_std": std})})


def _peft_reference(model_dir, run) -> dict[str, torch.Size]:
    """The tensors PEFT itself makes for this model and these targets (attention only on an MoE model)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from hybridrl.trainers.megatron.spec import effective_targets, read_spec

    targets = effective_targets(read_spec(model_dir), run.lora.target_modules)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=run.lora.rank, lora_alpha=run.lora.alpha, target_modules=targets))
    return {k: v.shape for k, v in get_peft_model_state_dict(model).items()}


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_the_drawn_adapter_holds_what_peft_makes_for_the_model(tmp_path, kind) -> None:
    model = parity.tiny_checkpoint(kind, tmp_path / "model")
    run = _drawn(0.05)
    out = write_initial_adapter(run, model, tmp_path / "adapters" / "step-0000")
    tensors = load_file(str(out / WEIGHTS_FILE))
    assert {k: v.shape for k, v in tensors.items()} == _peft_reference(model, run)
    b = torch.cat([v.flatten() for k, v in tensors.items() if "lora_B" in k])
    assert float(b.std()) == pytest.approx(0.05, rel=0.1)  # B is drawn: the adapter is not the identity
    again = load_file(str(write_initial_adapter(run, model, tmp_path / "again") / WEIGHTS_FILE))
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)  # the same seed draws the same adapter


def test_no_adapter_is_drawn_at_zero_and_only_a_set_value_changes_the_run_id(tmp_path) -> None:
    model = parity.tiny_checkpoint("qwen2", tmp_path / "model")
    assert write_initial_adapter(_drawn(0.0), model, tmp_path / "none") is None
    assert not (tmp_path / "none").exists()
    # runs recorded before the key keep their ids; setting it makes a configuration of its own
    assert run_id(_drawn(0.0)) == run_id(parity.default_run())
    assert run_id(_drawn(1e-3)) != run_id(parity.default_run())


def test_megatron_starts_from_the_drawn_adapter(tmp_path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/setup-megatron-cpu.sh)")
    from hybridrl.trainers.megatron import MegatronTrainer

    model = parity.tiny_checkpoint("qwen3_moe", tmp_path / "model")
    run = _drawn(0.05)
    drawn = load_file(str(write_initial_adapter(run, model, tmp_path / "step-0000") / WEIGHTS_FILE))
    trainer = MegatronTrainer(model, run, tmp_path / "run")
    try:
        trainer.resume(tmp_path / "step-0000")
        result = trainer.step(1, parity.make_samples(128, n=8, seed=3), tmp_path / "step-0001")
        trainer.flush()
    finally:
        trainer.close()
    after = load_file(str(result.adapter_dir / WEIGHTS_FILE))
    assert set(after) == set(drawn)
    # one AdamW step moves an entry by about lr; a B that started at 0 would be that small
    assert max(float((after[k] - drawn[k]).abs().max()) for k in drawn) < 2 * run.lr
    assert max(float(v.abs().max()) for k, v in drawn.items() if "lora_B" in k) > 5 * run.lr
