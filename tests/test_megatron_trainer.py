"""MegatronTrainer end to end on the CPU: torchrun workers, one job per call, PEFT output, resume across TP
sizes, worker errors surfaced, and no process left behind."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/setup-megatron-cpu.sh)")

from safetensors.torch import load_file  # noqa: E402

from hybridrl.tools import megatron_parity as parity  # noqa: E402
from hybridrl.trainers.megatron import (  # noqa: E402
    MegatronTrainer,
    MegatronWorkerError,
)

METRICS = ("train/loss", "train/grad_norm", "train/kl", "train/clipfrac", "train/entropy", "perf/train_tokens",
           "check/rollout_logprob_abs_diff", "check/logprob_gap_sample_max", "check/logprob_gap_token_max")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _worker_pids(trainer: MegatronTrainer) -> list[int]:
    pids = trainer.gpu_pids()  # the ranks, as the loop reads their GPU memory
    assert sorted(pids) == sorted(int(p.read_text()) for p in trainer.workdir.glob("pid-rank*")), pids
    assert all(_alive(p) for p in pids)
    return pids


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two steps at TP = 1; kept for the TP = 2 resume test."""
    root = tmp_path_factory.mktemp("megatron-trainer")
    model = parity.tiny_checkpoint("qwen2", root / "model")
    batches = [parity.make_samples(128, n=8, seed=s) for s in (11, 12)]
    trainer = MegatronTrainer(model, parity.default_run(1), root / "run-tp1")
    pids = _worker_pids(trainer)
    frozen = [trainer.gc_frozen]
    try:
        results = []
        for i, b in enumerate(batches):
            results.append(trainer.step(i + 1, b, root / f"adapters/step{i + 1}"))
            assert trainer.flush() >= 0.0  # the optimizer state, written by rank 0's thread, is on disk now
            assert (root / f"adapters/step{i + 1}/optimizer.pt").exists()
            frozen.append(trainer.gc_frozen)
        trainer.offload()  # no-ops on the CPU, but they go through the job protocol
        trainer.onload()
    finally:
        trainer.close()
    return {"root": root, "model": model, "batches": batches, "results": results, "pids": pids,
            "proc": trainer.proc, "frozen": frozen, "start_memory": trainer.start_memory, "ports": trainer.ports()}


def test_steps_write_peft_adapters(tp1_run: dict[str, Any]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for r in tp1_run["results"]:
        assert all(k in r.metrics for k in METRICS), r.metrics
        assert all(math.isfinite(r.metrics[k]) for k in METRICS), r.metrics
        assert r.metrics["perf/train_tokens"] > 0
        assert {p.name for p in r.adapter_dir.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                                            "optimizer.pt"}
    a1, a2 = (load_file(str(r.adapter_dir / "adapter_model.safetensors")) for r in tp1_run["results"])
    assert any(not torch.equal(a1[k], a2[k]) for k in a1)  # the second step changed the adapter
    for r, saved in zip(tp1_run["results"], (a1, a2), strict=True):  # the norm of what was written, B alone
        want = sum(float(v.float().pow(2).sum()) for k, v in saved.items() if ".lora_B." in k) ** 0.5
        assert want > 0 and r.metrics["train/lora_norm"] == pytest.approx(want, rel=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tp1_run["model"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tp1_run["results"][1].adapter_dir)
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert set(loaded) == {f"base_model.model.{k.removeprefix('base_model.model.')}" for k in a2}
    assert all(torch.equal(loaded[k], a2[k]) for k in a2)
    # at TP 1 each AdamW moment is written as views of one host copy: one record in the file, not one a tensor
    opt = torch.load(tp1_run["results"][1].adapter_dir / "optimizer.pt", weights_only=True)
    for moment in ("exp_avg", "exp_avg_sq"):
        assert set(opt[moment]) == set(a2)
        assert len({t.untyped_storage().data_ptr() for t in opt[moment].values()}) == 1, moment


def test_the_workers_keep_long_lived_objects_out_of_collections(tp1_run: dict[str, Any]) -> None:
    at_start, after_step1, after_step2 = tp1_run["frozen"]
    # the imports and the model at startup, then what step 1 made (the optimizer's state); not again after
    assert at_start > 100_000 and after_step1 > at_start and after_step2 == after_step1


def test_rank0_reports_its_gpu_memory_at_init_and_at_load(tp1_run: dict[str, Any], monkeypatch) -> None:
    """Two readings before any update (TP 2's residual, issue 15): with the groups set up, then with the model
    loaded; off CUDA both are empty, and on CUDA each is torch's reserved bytes and NVML's charge to the process."""
    from hybridrl.trainers.megatron import policy

    assert tp1_run["start_memory"] == {"init": {}, "load": {}}
    monkeypatch.setattr(policy.torch.cuda, "memory_reserved", lambda device: 2e9)
    monkeypatch.setattr(policy, "_nvml_gb", lambda device: 1.5)
    cuda = torch.device("cuda", 0)
    assert policy.gpu_memory_of(cuda) == {"mem/trainer_reserved_gb": 2.0, "mem/trainer_residual_gb": 1.5}
    monkeypatch.setattr(policy, "_nvml_gb", lambda device: None)  # NVML cannot see the process
    assert policy.gpu_memory_of(cuda) == {"mem/trainer_reserved_gb": 2.0}


def test_the_trainer_names_the_rendezvous_port_torchrun_took(tp1_run: dict[str, Any]) -> None:
    """--standalone has the kernel pick torchrun's store port, not a fixed one two jobs on one node would meet on; the
    ranks report it for the run's provenance."""
    port = tp1_run["ports"]["trainer_rendezvous"]
    assert isinstance(port, int) and 1024 <= port < 65536 and port != 29500  # torchrun's fixed default


def test_close_stops_every_process(tp1_run: dict[str, Any]) -> None:
    assert tp1_run["proc"].poll() is not None
    assert tp1_run["pids"] and not any(_alive(p) for p in tp1_run["pids"])


@pytest.mark.slow
def test_tp2_resumes_tp1_adapter_and_reports_worker_errors(tp1_run: dict[str, Any]) -> None:
    """TP = 2 resumes the TP = 1 step-1 adapter and optimizer state, takes step 2, and lands where TP = 1 did."""
    root = tp1_run["root"]
    run = parity.default_run(2)
    trainer = MegatronTrainer(tp1_run["model"], run, root / "run-tp2", resume_from=root / "adapters/step1")
    pids = _worker_pids(trainer)
    assert len(pids) == 2
    try:
        with pytest.raises(ValueError, match="token ids in"):
            trainer.step(2, [parity.make_samples(1000, n=1, seed=0)[0]], root / "bad")
        res = trainer.step(2, tp1_run["batches"][1], root / "adapters-tp2/step2")
        ref = tp1_run["results"][1]
        for k in ("train/loss", "train/grad_norm", "train/kl", "check/rollout_logprob_abs_diff",
                  "check/logprob_gap_sample_max", "check/logprob_gap_token_max", "train/lora_norm"):
            assert res.metrics[k] == pytest.approx(ref.metrics[k], rel=1e-4, abs=1e-6), k
        got = load_file(str(res.adapter_dir / "adapter_model.safetensors"))
        want = load_file(str(ref.adapter_dir / "adapter_model.safetensors"))
        assert set(got) == set(want)
        assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-2 * run.lr
        # a failing job: the worker's own message comes back, and the group is gone
        with pytest.raises(MegatronWorkerError, match="no adapter_model.safetensors"):
            trainer.resume(root / "missing-adapter")
        assert trainer.proc.poll() is not None
        assert not any(_alive(p) for p in pids)
        with pytest.raises(MegatronWorkerError, match="earlier failure"):
            trainer.offload()
    finally:
        trainer.close()
    assert os.path.exists(trainer.log_path)


@pytest.mark.slow
def test_ep2_trains_the_moe_as_ep1_does(tmp_path) -> None:
    """train_ep 2 through torchrun: two ranks, each holding half the experts, take the same two steps as one rank
    holding all of them, and one rank writes the adapter."""
    model = parity.tiny_checkpoint("qwen3_moe", tmp_path / "model")
    batches = [parity.make_samples(128, n=8, seed=s) for s in (11, 12)]
    out: dict[int, list[Any]] = {}
    for ep in (1, 2):
        trainer = MegatronTrainer(model, parity.default_run(1, ep), tmp_path / f"run-ep{ep}")
        try:
            assert len(_worker_pids(trainer)) == ep
            out[ep] = [trainer.step(i + 1, b, tmp_path / f"ep{ep}/step{i + 1}") for i, b in enumerate(batches)]
            trainer.flush()
        finally:
            trainer.close()
    for r1, r2 in zip(out[1], out[2], strict=True):
        for k in ("train/loss", "train/grad_norm", "train/kl", "train/entropy", "train/lora_norm"):
            assert r2.metrics[k] == pytest.approx(r1.metrics[k], rel=1e-4, abs=1e-6), k
        assert r2.metrics["train/lora_norm"] > 0
    got, want = (load_file(str(out[ep][1].adapter_dir / "adapter_model.safetensors")) for ep in (2, 1))
    assert set(got) == set(want)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-2 * parity.default_run().lr
    assert (out[2][1].adapter_dir / "optimizer.pt").exists()


def test_ranks_get_small_nccl_buffers_unless_the_user_set_them(tmp_path, monkeypatch) -> None:
    import hybridrl.trainers.megatron.trainer as mt

    seen: list[dict[str, str]] = []
    monkeypatch.setattr(mt.subprocess, "Popen", lambda cmd, **kw: seen.append(kw["env"]))
    bare = object.__new__(MegatronTrainer)  # only what _launch reads
    bare.tp, bare.ep, bare.workdir, bare.log_path, bare.device = 2, 1, tmp_path, tmp_path / "trainer.log", "cuda"
    monkeypatch.delenv("NCCL_BUFFSIZE", raising=False)
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "8")
    bare._launch(None)
    assert seen[0]["NCCL_BUFFSIZE"] == str(1 << 20) and seen[0]["NCCL_MAX_NCHANNELS"] == "8"


def test_ranks_on_cpu_share_the_trainer_s_threads_and_on_cuda_keep_the_job_s(tmp_path, monkeypatch) -> None:
    import hybridrl.trainers.megatron.trainer as mt

    seen: list[dict[str, str]] = []
    monkeypatch.setattr(mt.subprocess, "Popen", lambda cmd, **kw: seen.append(kw["env"]))
    bare = object.__new__(MegatronTrainer)  # only what _launch reads
    bare.tp, bare.ep, bare.workdir, bare.log_path = 2, 1, tmp_path, tmp_path / "trainer.log"
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the trainer's cores (hybridrl.run.cores)
    for bare.device in ("cpu", "cuda"):
        bare._launch(None)
    assert [env["OMP_NUM_THREADS"] for env in seen] == ["2", "4"]


def test_expert_parallel_ranks_are_processes_of_their_own(tmp_path, monkeypatch) -> None:
    """train_ep 2 at train_tp 1: torchrun starts two ranks, and on the CPU they share the trainer's threads."""
    import hybridrl.trainers.megatron.trainer as mt

    seen: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(mt.subprocess, "Popen", lambda cmd, **kw: seen.append((cmd, kw["env"])))
    bare = object.__new__(MegatronTrainer)  # only what _launch reads
    bare.tp, bare.ep, bare.workdir, bare.log_path, bare.device = 1, 2, tmp_path, tmp_path / "trainer.log", "cpu"
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    bare._launch(None)
    [(cmd, env)] = seen
    assert "--nproc-per-node=2" in cmd and env["OMP_NUM_THREADS"] == "2"
