"""The adapter directory both trainers write: what PEFT's save_pretrained writes for the engines to load, in one
copy to the host per dtype, and a run resumes from it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridrl.tools.trainer_bench import SHAPES, bench_run, fixed_batch, random_model
from hybridrl.trainers import adapter_files
from hybridrl.trainers.adapter_files import (
    CONFIG_FILE,
    OPTIMIZER_FILE,
    WEIGHTS_FILE,
    HostStaging,
    StateWriter,
    optimizer_to_host,
    to_host,
)
from hybridrl.trainers.hf import HFTrainer


def test_to_host_copies_once_per_dtype_and_each_tensor_owns_its_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
               "c": torch.full((2, 2), 7.0), "d": torch.tensor(3.0)}
    copies = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copies.append(t.numel()) or real(t, *a, **k))
    host = to_host(tensors)
    assert sorted(copies) == [4, 11]  # one flat copy of the three fp32 tensors (6 + 4 + 1), one of the bf16
    assert list(host) == list(tensors)
    for name, t in tensors.items():
        assert torch.equal(host[name], t) and host[name].dtype == t.dtype and host[name].shape == t.shape
        assert host[name].untyped_storage().nbytes() == t.numel() * t.element_size()  # not a view of the flat copy


def test_staged_copies_reuse_one_buffer_per_slot() -> None:
    staging = HostStaging()
    tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}
    first = to_host(tensors, own_storage=False, staging=staging, slot="m")
    ptr = first["a"].untyped_storage().data_ptr()
    assert {t.untyped_storage().data_ptr() for t in first.values()} == {ptr}  # views of the slot's buffer
    again = to_host({k: v + 1 for k, v in tensors.items()}, own_storage=False, staging=staging, slot="m")
    assert again["a"].untyped_storage().data_ptr() == ptr and torch.equal(first["a"], tensors["a"] + 1)  # reused
    other = to_host(tensors, own_storage=False, staging=staging, slot="w")
    assert other["a"].untyped_storage().data_ptr() != ptr and torch.equal(again["b"], tensors["b"] + 1)
    owned = to_host(tensors, staging=staging, slot="m")  # own_storage: copies out of the buffer, safe to keep
    assert owned["a"].untyped_storage().data_ptr() != ptr and torch.equal(owned["a"], tensors["a"])
    # an optimizer's state copies groups of one dtype from two devices (step counts on the CPU, moments on the GPU)
    # at once: a buffer shared between them would let the second group overwrite the first's views
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    one, two = (staging.buffer("opt", d, 4, torch.float32) for d in (cpu, gpu))
    assert one.untyped_storage().data_ptr() != two.untyped_storage().data_ptr()
    assert staging.buffer("opt", cpu, 4, torch.float32).untyped_storage().data_ptr() == one.untyped_storage().data_ptr()


def test_optimizer_to_host_copies_the_moments_and_keeps_the_rest() -> None:
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state_dict()
    host = optimizer_to_host(state)
    assert host["param_groups"] == state["param_groups"]
    for k in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(host["state"][0][k], state["state"][0][k])
    # views of one copy: torch.save writes one record for all of them, not one a tensor
    storages = {host["state"][0][k].untyped_storage().data_ptr() for k in ("exp_avg", "exp_avg_sq", "step")}
    assert len(storages) == 1
    fresh = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())], lr=0.1)
    fresh.load_state_dict(host)  # what resume() does with it
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[HFTrainer, Path]:
    tmp = tmp_path_factory.mktemp("adapter")
    shape = SHAPES["tiny"]
    model = random_model(tmp / "model-tiny", shape, "float32")
    trainer = HFTrainer(model, bench_run(shape, "hf", "cpu", 4, None), "cpu")
    samples = fixed_batch(shape.config["vocab_size"], shape.samples, shape.prompt, shape.completion)
    trainer.step(1, samples, tmp / "step-1")
    trainer.flush()  # optimizer.pt is written in the background; the loop waits for it before recording the step
    return trainer, tmp


def test_the_hf_trainers_adapter_is_the_one_peft_writes(trained: tuple[HFTrainer, Path]) -> None:
    trainer, tmp = trained
    ours = tmp / "step-1"
    theirs = tmp / "peft"
    trainer.model.save_pretrained(theirs)
    mine, peft = load_file(str(ours / WEIGHTS_FILE)), load_file(str(theirs / WEIGHTS_FILE))
    assert mine.keys() == peft.keys() and len(mine) > 0
    assert all(torch.equal(mine[k], peft[k]) and mine[k].dtype == peft[k].dtype for k in mine)
    assert any(float(t.abs().sum()) > 0 for k, t in mine.items() if "lora_B" in k)  # one step moved B off zero
    config, peft_config = (json.loads((d / CONFIG_FILE).read_text()) for d in (ours, theirs))
    for d in (config, peft_config):  # a set in PEFT's config, a list in the file: its order is not meaningful
        d["target_modules"] = sorted(d["target_modules"])
    assert config == peft_config
    assert config["inference_mode"] is True and config["base_model_name_or_path"]
    assert (ours / OPTIMIZER_FILE).exists() and not (ours / "README.md").exists()  # no model card each step


def test_a_run_resumes_from_the_hf_trainers_adapter(trained: tuple[HFTrainer, Path]) -> None:
    trainer, tmp = trained
    shape = SHAPES["tiny"]
    resumed = HFTrainer(tmp / "model-tiny", bench_run(shape, "hf", "cpu", 4, None), "cpu")
    resumed.resume(tmp / "step-1")
    params = dict(trainer.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, params[name]), name
    before, after = trainer.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert before.keys() == after.keys()
    for i, st in before.items():
        assert all(torch.equal(st[k], after[i][k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_the_update_returns_before_its_optimizer_state_is_written(trained: tuple[HFTrainer, Path],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, tmp = trained
    shape = SHAPES["tiny"]
    gate, real = threading.Event(), adapter_files._save
    monkeypatch.setattr(adapter_files, "_save", lambda obj, path: (gate.wait(30), real(obj, path)))
    samples = fixed_batch(shape.config["vocab_size"], shape.samples, shape.prompt, shape.completion)
    out = tmp / "step-2"
    trainer.step(2, samples, out)
    # what the engine loads is there; the optimizer's moments are not, until the loop waits for them
    assert (out / WEIGHTS_FILE).exists() and (out / CONFIG_FILE).exists() and not (out / OPTIMIZER_FILE).exists()
    want = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    for p in trainer.params:  # the live moments change after step() returns: the file keeps step 2's host copy
        trainer.optimizer.state[p]["exp_avg"].add_(1.0)
    threading.Timer(1.0, gate.set).start()
    assert trainer.flush() > 0.5 and (out / OPTIMIZER_FILE).exists()  # it waited for the write
    saved = torch.load(out / OPTIMIZER_FILE, weights_only=True)["state"][0]
    assert all(torch.equal(saved[k], want[k]) for k in want)
    assert trainer.flush() == 0.0  # nothing pending


def test_a_failed_optimizer_write_is_reported_with_its_file(tmp_path: Path) -> None:
    writer = StateWriter()
    (tmp_path / "file").write_text("")  # a file where the adapter dir should be: the write cannot land
    writer.submit(tmp_path / "file", {"step": torch.tensor(1.0)})
    with pytest.raises(OSError, match=r"could not write the optimizer state .*file/optimizer.pt"):
        writer.wait()
    assert writer.wait() == 0.0  # reported once
    writer.close()


def test_the_next_export_waits_for_the_last_state_before_reusing_its_buffer(trained: tuple[HFTrainer, Path],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, tmp = trained
    shape = SHAPES["tiny"]
    samples = fixed_batch(shape.config["vocab_size"], shape.samples, shape.prompt, shape.completion)
    gate, real = threading.Event(), adapter_files._save
    monkeypatch.setattr(adapter_files, "_save", lambda obj, path: (gate.wait(30), real(obj, path)))
    trainer.step(4, samples, tmp / "step-4")
    want = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    threading.Timer(0.3, gate.set).start()
    trainer.step(5, samples, tmp / "step-5")  # its moments go to the staging buffer step 4's write still reads
    trainer.flush()
    saved4, saved5 = (torch.load(tmp / f"step-{i}" / OPTIMIZER_FILE, weights_only=True)["state"][0] for i in (4, 5))
    assert all(torch.equal(saved4[k], want[k]) for k in want)
    assert not torch.equal(saved4["exp_avg"], saved5["exp_avg"])
