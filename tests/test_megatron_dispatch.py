"""The gather-only MoE permutation against megatron-core's own all-gather dispatcher: the same expert-ordered rows,
the same combined tokens and the same gradients, and megatron's path wherever the gathers do not apply."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/setup-megatron-cpu.sh)")

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from hybridrl.trainers.megatron import dispatch  # noqa: E402

T, E, K, H = 11, 5, 2, 8


def _config(**kw: Any) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                             moe_router_topk=K, moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
                             gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, **kw)


def _routing(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k routing map [T, E] and its probs, expert 3 chosen by no token."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=gen)
    scores[:, 3] = -1
    top = scores.topk(K, dim=1).indices
    routing = torch.zeros(T, E, dtype=torch.bool).scatter(1, top, True)
    return routing, torch.where(routing, scores, torch.zeros(()))


def _round_trip(d: MoEAllGatherTokenDispatcher, routing: torch.Tensor, probs: torch.Tensor) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    d.routing_map = routing.clone()
    rows, per_expert, local_probs = d.dispatch_postprocess(x, probs)
    # an expert stand-in whose gradient differs row by row: each row scaled by its expert-ordered position, and
    # by its routing prob, as the experts weight their output
    scale = torch.arange(1, rows.shape[0] + 1, dtype=rows.dtype).unsqueeze(1)
    out = d.combine_preprocess(rows * scale * local_probs.unsqueeze(1))
    out.backward(torch.randn(out.shape, generator=gen))
    return {"rows": rows.detach(), "per_expert": per_expert, "probs": local_probs.detach(), "out": out.detach(),
            "dx": x.grad, "dprobs": probs.grad}


SCATTERS = ("scatter_add_", "index_add_")  # megatron's unpermute and its gather's backward
# what waits for the GPU from Python: a copy to the host, a read of a value, a size known only on the device
SYNCS = ("cpu", "item", "tolist", "nonzero", "masked_select", "__bool__")


def _counting(names: tuple[str, ...], fn: Any) -> tuple[Any, int]:
    """fn's result and how many calls of these Tensor methods it made from Python."""
    calls = []
    real = {name: getattr(torch.Tensor, name) for name in names}
    for name, f in real.items():
        setattr(torch.Tensor, name, lambda *a, _f=f, **k: calls.append(1) or _f(*a, **k))
    try:
        return fn(), len(calls)
    finally:
        for name, f in real.items():
            setattr(torch.Tensor, name, f)


def test_expert_order_is_megatrons_order_and_a_permutation() -> None:
    routing = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)  # 3 tokens, 3 experts, k = 2
    tokens, order, experts = dispatch.expert_order(routing, 2)
    assert tokens.tolist() == [0, 2, 1, 2, 0, 1]  # expert 0: tokens 0, 2; expert 1: 1, 2; expert 2: 0, 1
    assert experts.tolist() == [0, 0, 1, 1, 2, 2]
    assert order.tolist() == [0, 4, 2, 5, 1, 3]  # token 0's experts 0, 2 sit at rows 0, 4; token 1's 1, 2 at 2, 5
    assert sorted(order.tolist()) == list(range(6))
    assert tokens[order].tolist() == [0, 0, 1, 1, 2, 2]  # token-major: each token's k rows side by side


def test_gathers_give_megatrons_rows_output_and_gradients(groups: ProcessGroupCollection) -> None:
    routing, probs = _routing()
    cfg = _config()
    ours = MoEAllGatherTokenDispatcher(E, list(range(E)), cfg, pg_collection=groups)
    theirs = MoEAllGatherTokenDispatcher(E, list(range(E)), cfg, pg_collection=groups)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token_dispatcher = ours

    assert dispatch.use_gather_dispatch(Model()) == 1 and type(ours) is dispatch.GatherDispatcher
    got, got_scatters = _counting(SCATTERS, lambda: _round_trip(ours, routing, probs))
    want, want_scatters = _counting(SCATTERS, lambda: _round_trip(theirs, routing, probs))
    assert got_scatters == 0 < want_scatters  # megatron sums back with an atomic scatter; the gathers do not
    assert ours._tokens is None and ours._order is None  # no index outlives the layer's forward on the dispatcher
    assert got["per_expert"].tolist() == want["per_expert"].tolist() == routing.sum(0).tolist()
    for key in ("rows", "probs", "out", "dx", "dprobs"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("local", [[0, 1], [2, 3], [3], [4], [1, 2, 3, 4]])
def test_an_expert_parallel_rank_s_gathers_give_megatrons_rows_for_its_experts(groups: ProcessGroupCollection,
                                                                              local: list[int]) -> None:
    """A rank holding a contiguous block of the experts (expert 3 is chosen by no token: [3] has no rows at all)
    gets megatron's rows, output and gradients for that block, without atomics and with one wait for the device."""
    routing, probs = _routing(seed=4)
    cfg = _config()
    ours = MoEAllGatherTokenDispatcher(len(local), local, cfg, pg_collection=groups)
    ours.__class__ = dispatch.GatherDispatcher
    theirs = MoEAllGatherTokenDispatcher(len(local), local, cfg, pg_collection=groups)
    (got, got_syncs), got_scatters = _counting(SCATTERS, lambda: _counting(SYNCS, lambda: _round_trip(
        ours, routing, probs)))
    want, want_scatters = _counting(SCATTERS, lambda: _round_trip(theirs, routing, probs))
    assert got_scatters == 0 < want_scatters and got_syncs == 1
    assert got["per_expert"].tolist() == want["per_expert"].tolist() == routing[:, local].sum(0).tolist()
    assert got["rows"].shape[0] == int(routing[:, local].sum())
    for key in ("rows", "probs", "out", "dx", "dprobs"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6)


class _Unwritten(torch.autograd.Function):
    """Rows from n on as the grouped kernel leaves rows past its groups: NaN, in the output and in the gradient."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, n: int) -> torch.Tensor:
        ctx.n = n
        return torch.cat([rows[:n], torch.full_like(rows[n:], float("nan"))])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.cat([grad[: ctx.n], torch.full_like(grad[ctx.n:], float("nan"))]), None


def _by_expert_round_trip(d: MoEAllGatherTokenDispatcher, routing: torch.Tensor, probs: torch.Tensor,
                          local: list[int]) -> dict[str, Any]:
    """As _round_trip, through an expert stand-in that scales each row by its expert (not by its position, which
    differs between the two layouts) and writes nothing past the local experts' rows."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    per_expert = routing[:, local].sum(0)
    scale = torch.repeat_interleave(torch.tensor(local, dtype=x.dtype) + 1, per_expert)
    n = int(per_expert.sum())
    d.routing_map = routing.clone()
    rows, counts, local_probs = d.dispatch_postprocess(x, probs)
    scale = torch.cat([scale, scale.new_ones(rows.shape[0] - n)]).unsqueeze(1)
    out = d.combine_preprocess(_Unwritten.apply(rows * scale * local_probs.unsqueeze(1), n))
    out.backward(torch.randn(out.shape, generator=gen))
    return {"rows": rows.shape[0], "per_expert": counts, "out": out.detach(), "dx": x.grad, "dprobs": probs.grad}


@pytest.mark.parametrize("local", [[0, 1], [2, 3], [3], [4], [1, 2, 3]])
def test_a_masked_expert_parallel_rank_never_waits_and_gives_megatrons_output_and_gradients(
        groups: ProcessGroupCollection, local: list[int]) -> None:
    """ep_dispatch masked: the rank keeps every token's rows, its experts' first, and reads nothing on the host; what
    the other ranks' rows hold (NaN here, both ways) reaches neither the combined tokens nor any gradient."""
    routing, probs = _routing(seed=5)
    cfg = _config()
    ours = MoEAllGatherTokenDispatcher(len(local), local, cfg, pg_collection=groups)
    ours.__class__ = dispatch.GatherDispatcher
    ours.masked = True
    theirs = MoEAllGatherTokenDispatcher(len(local), local, cfg, pg_collection=groups)
    got, syncs = _counting(SYNCS, lambda: _by_expert_round_trip(ours, routing, probs, local))
    want = _by_expert_round_trip(theirs, routing, probs, local)
    assert syncs == 0 and got["rows"] == T * K > want["rows"]
    assert got["per_expert"].tolist() == want["per_expert"].tolist()
    for key in ("out", "dx", "dprobs"):
        assert torch.isfinite(got[key]).all(), key
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6)


def test_the_gathers_never_wait_for_the_device(groups: ProcessGroupCollection) -> None:
    routing, probs = _routing(seed=3)
    ours = MoEAllGatherTokenDispatcher(E, list(range(E)), _config(), pg_collection=groups)
    ours.__class__ = dispatch.GatherDispatcher
    theirs = MoEAllGatherTokenDispatcher(E, list(range(E)), _config(), pg_collection=groups)
    _, our_syncs = _counting(SYNCS, lambda: _round_trip(ours, routing, probs))
    _, their_syncs = _counting(SYNCS, lambda: _round_trip(theirs, routing, probs))
    assert our_syncs == 0 < their_syncs  # megatron reads its counts on the host and selects by masks


def test_a_token_without_k_experts_stops_the_gathers_loudly(groups: ProcessGroupCollection) -> None:
    routing, probs = _routing(seed=2)
    plain = MoEAllGatherTokenDispatcher(E, list(range(E)), _config(), pg_collection=groups)
    plain.__class__ = dispatch.GatherDispatcher
    short = routing.clone()
    short[0] = False  # a token with no expert: not what a top-k router without capacity makes
    plain.routing_map = short
    with pytest.raises(RuntimeError):  # on a GPU a device-side assert: the rows would be wrong, not just slow
        plain.dispatch_postprocess(torch.randn(T, H), probs)


def test_megatrons_path_where_the_gathers_do_not_apply(groups: ProcessGroupCollection) -> None:
    routing, probs = _routing(seed=2)
    capped = MoEAllGatherTokenDispatcher(E, list(range(E)), _config(moe_expert_capacity_factor=2.0),
                                         pg_collection=groups)
    capped.__class__ = dispatch.GatherDispatcher
    assert not capped._gathers_apply()  # a capacity can drop tokens: not k rows a token
    short = routing.clone()
    short[0] = False  # a dropped token: megatron's permute takes the rows the capacity left
    capped.routing_map = short
    rows, _, _ = capped.dispatch_postprocess(torch.randn(T, H), probs)
    assert rows.shape[0] == (T - 1) * K and capped._order is None
    assert capped.combine_preprocess(rows).shape == (T, H)
    assert dispatch.use_gather_dispatch(torch.nn.Sequential(), on=True) == 0
