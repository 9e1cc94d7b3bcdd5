"""GroupedExperts (one grouped GEMM per projection) against megatron-core's SequentialMLP (a loop of MLPs) and
against its own per-expert loop: same weights, same permuted tokens, forward and backward, with an expert that
receives no tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/setup-megatron-cpu.sh)")

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from hybridrl.trainers import grouped_mm  # noqa: E402
from hybridrl.trainers.megatron import experts as ex  # noqa: E402

E, HIDDEN, FFN = 4, 32, 24
COUNTS = [5, 0, 9, 3]  # expert 1 gets no tokens


def _config(dtype: torch.dtype) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64,
                             num_moe_experts=E, moe_ffn_hidden_size=FFN, moe_router_topk=2,
                             gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                             params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
                             perform_initialization=True, gradient_accumulation_fusion=False,
                             bias_activation_fusion=False)


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = sum(COUNTS)
    x = torch.randn(n, HIDDEN, generator=gen).to(dtype)
    probs = torch.rand(n, generator=gen)  # fp32, as the fp32 router hands them on
    return x, torch.tensor(COUNTS), probs


def _run(module: torch.nn.Module, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor,
         grad_out: torch.Tensor | None = None) -> dict[str, Any]:
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    out, bias = module(x, counts, probs)
    assert bias is None
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype) if grad_out is None \
        else grad_out
    out.backward(g)
    return {"out": out.detach(), "dx": x.grad, "dprobs": probs.grad, "grad_out": g}


def _grouped(cfg: TransformerConfig, groups: ProcessGroupCollection) -> ex.GroupedExperts:
    return ex.GroupedExperts(E, cfg, pg_collection=groups)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_equals_sequential_mlp(groups: ProcessGroupCollection, dtype: torch.dtype) -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP

    cfg = _config(dtype)
    local = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    mlp_sub = local.submodules.mlp.keywords["submodules"].experts.keywords["submodules"]
    seq = SequentialMLP(E, cfg, mlp_sub, pg_collection=groups)
    grouped = _grouped(cfg, groups)
    assert grouped.impl() == ex.GROUPED, "grouped_mm does not run in this torch on the CPU"
    with torch.no_grad():  # the stacked layout is SequentialMLP's per-expert layout, one above the other
        for e, mlp in enumerate(seq.local_experts):
            grouped.fc1_weight[e].copy_(mlp.linear_fc1.weight)
            grouped.fc2_weight[e].copy_(mlp.linear_fc2.weight)
    for p in grouped.parameters():
        p.requires_grad_(True)
    x, counts, probs = _inputs(dtype)
    ref = _run(seq, x, counts, probs)
    got = _run(grouped, x, counts, probs, ref["grad_out"])
    for k in ("out", "dx", "dprobs"):
        _close(got[k], ref[k], dtype)
    for e, mlp in enumerate(seq.local_experts):
        _close(grouped.fc1_weight.grad[e], mlp.linear_fc1.weight.grad, dtype)
        _close(grouped.fc2_weight.grad[e], mlp.linear_fc2.weight.grad, dtype)
    # the expert without tokens gets exactly zero gradient, and the others do get some
    assert grouped.fc1_weight.grad[1].abs().max() == 0 and grouped.fc2_weight.grad[1].abs().max() == 0
    assert all(grouped.fc1_weight.grad[e].abs().max() > 0 for e in (0, 2, 3))


def test_grouped_equals_own_loop_and_loop_fallback(groups: ProcessGroupCollection,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(torch.float32)
    grouped = _grouped(cfg, groups)
    x, counts, probs = _inputs(torch.float32, seed=1)
    got = _run(grouped, x, counts, probs)
    w1 = grouped.fc1_weight.grad.clone()
    grouped.zero_grad(set_to_none=True)
    # the fallback for a torch without the kernel: same module, same weights, per-expert loop
    monkeypatch.setattr(grouped_mm, "grouped_mm_fn", lambda: None)
    grouped_mm.kernel_runs.cache_clear()
    try:
        assert grouped.impl() == ex.LOOP
        ref = _run(grouped, x, counts, probs, got["grad_out"])
    finally:
        monkeypatch.undo()
        grouped_mm.kernel_runs.cache_clear()
    for k in ("out", "dx", "dprobs"):
        _close(got[k], ref[k], torch.float32)
    _close(w1, grouped.fc1_weight.grad, torch.float32)
    # the routing probs matter: scaling them scales the output (a module ignoring them would fail here)
    with torch.no_grad():  # the kernel is first tried here under no_grad, and must still be found to run
        half, _ = grouped(x, counts, probs * 0.5)
    _close(half, got["out"] * 0.5, torch.float32)
    assert grouped.impl() == ex.GROUPED


@pytest.mark.parametrize("impl", [ex.GROUPED, ex.LOOP])
def test_foreign_rows_are_zero_and_change_nothing_of_the_local_experts(groups: ProcessGroupCollection, impl: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An expert-parallel rank that keeps every token's rows (dispatch.py's masked) hands on rows past its experts'
    too: they come out zero, the local rows' outputs and every weight gradient are as without them, and no NaN from
    the grouped kernel's unwritten rows reaches anything."""
    cfg = _config(torch.float32)
    grouped = _grouped(cfg, groups)
    x, counts, probs = _inputs(torch.float32, seed=2)
    n = x.shape[0]
    if impl == ex.LOOP:
        monkeypatch.setattr(grouped_mm, "grouped_mm_fn", lambda: None)
        grouped_mm.kernel_runs.cache_clear()
    try:
        assert grouped.impl() == impl
        alone = _run(grouped, x, counts, probs)
        w1, w2 = grouped.fc1_weight.grad.clone(), grouped.fc2_weight.grad.clone()
        grouped.zero_grad(set_to_none=True)
        grouped.foreign_rows = True
        extra = torch.full((6, HIDDEN), 1e30)  # another rank's rows: large, and never to be multiplied
        g = torch.cat([alone["grad_out"], torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(3))])
        _poison(n + 6, 2 * FFN, HIDDEN)  # the kernel's unwritten rows then hold NaN, as freed memory may
        both = _run(grouped, torch.cat([x, extra]), counts, torch.cat([probs, torch.rand(6)]), g)
    finally:
        monkeypatch.undo()
        grouped_mm.kernel_runs.cache_clear()
    assert torch.equal(both["out"][n:], torch.zeros(6, HIDDEN))
    _close(both["out"][:n], alone["out"], torch.float32)
    _close(both["dx"][:n], alone["dx"], torch.float32)
    _close(both["dprobs"][:n], alone["dprobs"], torch.float32)
    _close(grouped.fc1_weight.grad, w1, torch.float32)
    _close(grouped.fc2_weight.grad, w2, torch.float32)
    assert torch.isfinite(grouped.fc1_weight.grad).all() and torch.isfinite(both["dprobs"]).all()
    assert torch.equal(both["dprobs"][n:], torch.zeros(6)) and torch.equal(both["dx"][n:], torch.zeros(6, HIDDEN))


def _poison(rows: int, *widths: int) -> None:
    """Free memory of the sizes the next activations take, filled with NaN: the allocator hands it out again, so a
    kernel's unwritten rows read as NaN instead of whatever was there (CI saw one in dprobs)."""
    for width in widths:
        junk = [torch.full((rows, width), float("nan")) for _ in range(8)]
        del junk


def test_misaligned_shapes_fall_back_to_the_loop(groups: ProcessGroupCollection) -> None:
    """grouped_mm needs 16-byte strides: a bf16 ffn of 12 (24 bytes) is not one, so the loop runs."""
    cfg = _config(torch.bfloat16)
    cfg.moe_ffn_hidden_size = 12
    m = ex.GroupedExperts(E, cfg, pg_collection=groups)
    assert m.impl() == ex.LOOP
    assert _grouped(_config(torch.bfloat16), groups).impl() == ex.GROUPED
    x, counts, probs = _inputs(torch.bfloat16)
    out, _ = m(x, counts, probs)
    assert out.shape == (sum(COUNTS), HIDDEN)


def test_expanded_gradient_reaches_grouped_mm(groups: ProcessGroupCollection) -> None:
    """out.sum() hands grouped_mm's backward a stride-0 gradient, which its stride check rejects unaided."""
    grouped = _grouped(_config(torch.float32), groups)
    assert grouped.impl() == ex.GROUPED
    x, counts, probs = _inputs(torch.float32)
    x.requires_grad_(True)
    out, _ = grouped(x, counts, probs)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


class _Group:
    """Stands in for an expert-TP process group of `n` ranks (the module only asks its size)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_tp2_shards_sum_to_the_full_experts(groups: ProcessGroupCollection) -> None:
    """Weights split over 2 expert-TP ranks by the HF->Megatron mapping: each rank's partial output (before
    the dispatcher's reduce-scatter) and its input gradient sum to the TP = 1 module's."""
    from types import SimpleNamespace

    from hybridrl.trainers.megatron import mapping

    gen = torch.Generator().manual_seed(5)
    hf = [tuple(torch.randn(*s, generator=gen) * 0.2 for s in ((FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)))
          for _ in range(E)]

    def build(tp: int, rank: int) -> ex.GroupedExperts:
        m = ex.GroupedExperts(E, _config(torch.float32), pg_collection=SimpleNamespace(expt_tp=_Group(tp)))
        assert m.fc1_weight.shape == (E, 2 * FFN // tp, HIDDEN) and m.fc2_weight.shape == (E, HIDDEN, FFN // tp)
        with torch.no_grad():
            for e, (g, u, d) in enumerate(hf):
                m.fc1_weight[e].copy_(mapping.gate_up_to_megatron(g, u, tp, rank))
                m.fc2_weight[e].copy_(mapping.shard(d, 1, tp, rank))
        return m

    x, counts, probs = _inputs(torch.float32, seed=2)
    full = _run(build(1, 0), x, counts, probs)
    parts = [_run(build(2, r), x, counts, probs, full["grad_out"]) for r in range(2)]
    for k in ("out", "dx", "dprobs"):
        _close(parts[0][k] + parts[1][k], full[k], torch.float32)
    # a mis-sharded layout (gate and up not split per rank) would not sum to it
    wrong = build(2, 0)
    with torch.no_grad():
        for e, (g, u, _) in enumerate(hf):
            wrong.fc1_weight[e].copy_(torch.cat([g, u])[: 2 * FFN // 2])
    bad = _run(wrong, x, counts, probs, full["grad_out"])["out"] + parts[1]["out"]
    assert not torch.allclose(bad, full["out"], atol=1e-3)
