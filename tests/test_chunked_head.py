"""The chunked output head (trainers/chunked_head.py) against the full logits it replaces: per-token logprobs, entropy
and gradients on random heads, with the vocabulary split over two gloo ranks, and through both trainers (the LoRA
gradients of one GRPO backward on tiny fp32 models); and neither its forward nor its backward allocates a
[tokens, vocabulary] tensor, which the full path does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybridrl.engines.server import free_port
from hybridrl.task.rl import token_logprobs_entropy
from hybridrl.tools import trainer_bench
from hybridrl.trainers import chunked_head
from hybridrl.trainers.chunked_head import head_logprobs
from hybridrl.trainers.grpo import grpo_backward, pad_batch

LOGP_TOL = 1e-5  # absolute, per token, fp32: tests/test_megatron_parity.py's
GRAD_TOL = 1e-4  # relative (Frobenius), per tensor: the same


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _full(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp, ent = token_logprobs_entropy(F.linear(hidden, weight).unsqueeze(0), targets.unsqueeze(0))
    assert ent is not None
    return logp[0], ent[0]


def _head(n: int = 37, hidden: int = 16, vocab: int = 50, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    w[3] *= 8  # a confident token: logprobs and entropies near 0 as well as spread ones
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::4] = 3
    return h, w, t, torch.randn(n, generator=g)


@pytest.mark.parametrize("rows", [1, 5, 64])  # one token a chunk, several with a partial last chunk, all at once
def test_chunked_logprobs_entropy_and_gradients_are_the_full_logits_ones(rows: int) -> None:
    h, w, t, g = _head()
    got, want = {}, {}
    for out, fn in ((got, lambda a, b: head_logprobs(a, b, t, chunk_bytes=4 * w.shape[0] * rows)),
                    (want, lambda a, b: _full(a, b, t))):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)  # the weight's gradient as well
        logp, ent = fn(hh, ww)
        (logp * g).sum().backward()
        out.update(logp=logp.detach(), ent=ent, h=hh.grad, w=ww.grad)
    torch.testing.assert_close(got["logp"], want["logp"], rtol=0, atol=LOGP_TOL)
    torch.testing.assert_close(got["ent"], want["ent"], rtol=0, atol=LOGP_TOL)
    assert want["ent"].min() < 0.05 and want["logp"].max() > -0.05  # the confident rows are there
    assert _rel(got["h"], want["h"]) < GRAD_TOL and _rel(got["w"], want["w"]) < GRAD_TOL


def test_a_frozen_head_gets_no_gradient_and_hidden_still_gets_its_own() -> None:
    h, w, t, g = _head()
    hh = h.clone().requires_grad_(True)
    logp, _ = head_logprobs(hh, w, t, chunk_bytes=4 * w.shape[0] * 5)
    (logp * g).sum().backward()
    want = h.clone().requires_grad_(True)
    (_full(want, w, t)[0] * g).sum().backward()
    assert w.grad is None and _rel(hh.grad, want.grad) < GRAD_TOL


def test_under_autocast_the_head_runs_in_bf16_as_the_full_paths_linear_does() -> None:
    h, w, t, _ = _head(n=24, hidden=64, vocab=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = _full(h, w, t)  # F.linear under autocast: bf16 logits, then the fp32 log-softmax
        got, _ = head_logprobs(h, w, t, chunk_bytes=4 * 300 * 5)
    fp32, _ = _full(h, w, t)
    assert float((want - fp32).abs().max()) > 1e-2  # bf16 logits move the logprobs by more than this ...
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)  # ... and the chunked head gives the bf16 ones


class Allocations(TorchDispatchMode):
    """The tensors every op makes: the largest one, and the largest with a dimension of `dim` elements. Ops whose
    results alias an input (views, in-place and out= ops) allocate nothing and are left out."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim, self.largest, self.largest_with_dim = dim, 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if self.dim in t.shape:
                    self.largest_with_dim = max(self.largest_with_dim, t.numel())
        return out


def test_the_chunked_forward_and_backward_allocate_no_more_than_a_chunk_of_logits() -> None:
    n, vocab, rows = 37, 300, 4
    h, w, t, g = _head(n=n, hidden=8, vocab=vocab)  # hidden is small: every other tensor is below a chunk
    sizes = {}
    for name, fn in (("chunked", lambda a: head_logprobs(a, w, t, chunk_bytes=4 * vocab * rows)),
                     ("full", lambda a: _full(a, w, t))):
        hh = h.clone().requires_grad_(True)
        with Allocations() as seen:
            logp, _ = fn(hh)
            (logp * g).sum().backward()
        sizes[name] = seen.largest
    assert sizes["chunked"] <= rows * vocab < n * vocab
    assert sizes["full"] >= n * vocab  # the full path's logits and their gradient


# -- the vocabulary split over two ranks (megatron's vocab-parallel head at TP 2) ---------------------------------


def _split_rank(rank: int, port: int, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor,
                out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        half = w.shape[0] // 2
        got = []
        for rows in (1, 5, 64):
            hh = h.clone().requires_grad_(True)
            ww = w[rank * half : (rank + 1) * half].clone().requires_grad_(True)
            logp, ent = head_logprobs(hh, ww, t, chunk_bytes=4 * half * rows, group=dist.group.WORLD,
                                      vocab_start=rank * half)
            (logp * g).sum().backward()
            got.append({"logp": logp.detach(), "ent": ent, "h": hh.grad, "w": ww.grad})
        torch.save(got, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_a_vocabulary_split_over_two_ranks_gives_the_whole_ones(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    h, w, t, g = _head(vocab=48)
    t[:4] = torch.tensor([0, 23, 24, 47])  # each rank's first and last row
    out = tmp_path / "split.pt"
    mp.start_processes(_split_rank, args=(free_port(), h, w, t, g, str(out)), nprocs=2, start_method="spawn",
                       join=True)
    ranks = [torch.load(f"{out}.{r}") for r in (0, 1)]
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, ent = _full(hh, ww, t)
    (logp * g).sum().backward()
    for r0, r1 in zip(*ranks, strict=True):
        for got in (r0, r1):  # every rank holds the whole result and the whole hidden gradient
            torch.testing.assert_close(got["logp"], logp.detach(), rtol=0, atol=LOGP_TOL)
            torch.testing.assert_close(got["ent"], ent, rtol=0, atol=LOGP_TOL)
            assert _rel(got["h"], hh.grad) < GRAD_TOL
        assert _rel(torch.cat([r0["w"], r1["w"]]), ww.grad) < GRAD_TOL  # each rank's rows of the head


# -- the trainers ------------------------------------------------------------------------------------------------


def _samples(vocab: int, n: int = 6) -> list[Any]:
    from hybridrl.tools.megatron_parity import make_samples

    return make_samples(vocab, n=n, seed=3)


def _hf_trainer(model: Path, shape: trainer_bench.Shape, packed: bool, chunked: bool) -> Any:
    from hybridrl.trainers.hf import HFTrainer

    run = trainer_bench.bench_run(shape, "hf", "cpu", 4, None, pack=packed).model_copy(
        update={"kl_coef": 0.05, "chunked_head": chunked})
    tr = HFTrainer(model, run, "cpu")
    tr.optimizer.zero_grad(set_to_none=True)
    return tr


def _hf_backward(tr: Any, samples: list[Any]) -> tuple[dict[str, float], dict[str, torch.Tensor], torch.Tensor]:
    """The trainer's logprobs at the completion targets of a padded forward, and one GRPO backward (the run's
    layout): its metrics and LoRA gradients."""
    with torch.no_grad():
        batch = pad_batch(samples)
        logp, _ = tr._logprobs(batch)
    metrics = grpo_backward(samples, tr.run, tr.device, tr._logprobs, tr.model.disable_adapter)
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    return metrics, grads, logp[batch.mask]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("shape_name", ["tiny", "tiny-moe"])  # qwen3 with a tied head, qwen3_moe with its own
def test_the_hf_trainers_chunked_head_gives_the_full_logits_step(shape_name: str, packed: bool, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    shape = trainer_bench.SHAPES[shape_name]
    vocab = shape.config["vocab_size"]
    monkeypatch.setattr(chunked_head, "HEAD_CHUNK_BYTES", 4 * vocab * 3)  # three tokens a chunk: many chunks
    model = trainer_bench.random_model(tmp_path / "model", shape, "float32")
    samples = _samples(vocab)
    full, chunked = (_hf_trainer(model, shape, packed, chunked=c) for c in (False, True))
    assert full.head is None and chunked.head is not None
    (m_full, g_full, lp_full), (m_chunk, g_chunk, lp_chunk) = (_hf_backward(tr, samples) for tr in (full, chunked))
    assert float((lp_chunk - lp_full).abs().max()) < LOGP_TOL
    for key in ("train/loss", "train/kl", "train/entropy", "check/rollout_logprob_abs_diff", "mismatch/kl_k3"):
        assert m_chunk[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-7), key
    assert set(g_chunk) == set(g_full) and g_full
    for name, g in g_full.items():
        assert _rel(g_chunk[name], g) < GRAD_TOL, name


@pytest.mark.parametrize("chunked", [True, False])
def test_the_hf_trainers_update_holds_the_logits_only_without_the_chunked_head(
        chunked: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vocab, rows = 300, 3  # a vocabulary no other dimension of the tiny shape has
    shape = trainer_bench.shape_of("tiny", vocab)
    monkeypatch.setattr(chunked_head, "HEAD_CHUNK_BYTES", 4 * vocab * rows)
    model = trainer_bench.random_model(tmp_path / "model", shape, "float32")
    samples = _samples(vocab, n=4)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    tr = _hf_trainer(model, shape, packed=True, chunked=chunked)
    with Allocations(dim=vocab) as seen:  # the logprobs and the backward alone: loading makes the [vocab, H] head
        metrics, _, _ = _hf_backward(tr, samples)
    assert metrics["train/loss"] != 0.0
    if chunked:
        assert seen.largest_with_dim <= rows * vocab
    else:
        assert seen.largest_with_dim >= (tokens - 1) * vocab  # the packed row's logits


def test_the_hf_trainer_keeps_the_full_logits_for_a_model_whose_head_it_does_not_know() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

    from hybridrl.trainers.hf import plain_head

    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    assert plain_head(qwen) == (qwen.model, qwen.lm_head)
    assert plain_head(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2))) is None


def _megatron_cases(tmp: Path, archs: list[str], tp: int) -> dict[str, Any]:
    from hybridrl.tools import megatron_parity as parity

    cases = []
    for arch in archs:
        run = parity.default_run(tp)
        model = parity.tiny_checkpoint(arch, tmp / arch / "model")
        adapter = parity.random_adapter(model, tmp / arch / "adapter", run)
        samples = parity.make_samples(128, n=6, seed=3)
        for chunked in (True, False):
            cases.append({"name": f"{arch}-{chunked}", "model_dir": str(model), "adapter_dir": str(adapter),
                          "samples": samples, "run": run.model_copy(update={"chunked_head": chunked}),
                          "export_dir": str(tmp / arch / f"export-{chunked}")})
    return parity.run_megatron_group(tp, cases, tmp / "got.pt")


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_megatron_trainers_chunked_head_gives_the_full_logits_step(tp: int, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/setup-megatron-cpu.sh)")
    from hybridrl.tools import megatron_parity as parity

    monkeypatch.setattr(chunked_head, "HEAD_CHUNK_BYTES", 4 * 128 * 3)  # at TP 1 (this process): many chunks
    archs = ["llama", "qwen3", "qwen3_moe"] if tp == 1 else ["qwen3"]  # untied, tied, MoE; MoE is TP 1 only
    got = _megatron_cases(tmp_path, archs, tp)
    for arch in archs:
        chunked, full = got[f"{arch}-True"], got[f"{arch}-False"]
        gaps = parity.compare(full, chunked)
        # after the AdamW step: test_megatron_parity.LOGP_AFTER_TOL (near-zero gradients take sign-sized steps)
        assert gaps["logp"] < LOGP_TOL and gaps["logp_after"] < 2e-5, (arch, gaps)
        padded = max(float((a - b).abs().max()) for a, b in zip(full["logp"], chunked["logp_padded"], strict=True))
        assert padded < LOGP_TOL, (arch, padded)
        assert gaps["grad_rel"] < GRAD_TOL and gaps["grad_norm_rel"] < GRAD_TOL, (arch, gaps)
        assert gaps["loss"] < 1e-6 and gaps["entropy"] < 1e-5 and chunked["entropy"] > 0.1, (arch, gaps)
