"""MoE token permutation by gathers alone, for megatron-core's all-gather dispatcher without Transformer Engine.

Without TE's fused permute, megatron's `permute` gathers each token's copies into expert order (index_select),
whose backward is an atomic `index_add_` of 6144 x 8 rows, and its `unpermute` sums the experts' outputs back with
an atomic `scatter_add_`. On one H200 these two took about 15% of a 48-layer Qwen3-30B-A3B-shaped update's GPU time
(results/reference/2026-11-25-h200-moerounds, profile). Where every token has exactly top-k local experts (one
expert-parallel rank, no capacity dropping), the copies of a token are the rows t*k .. t*k+k-1 of a token-major
layout, so both directions become a gather with a permutation and a sum over k: no atomics, and a sum that rounds
once instead of once per expert. Anything else falls back to megatron's own code.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


class _Dispatch(torch.autograd.Function):
    """x [T, H] -> rows [T*k, H] in expert order; backward gathers back to token order and sums each token's k."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return x.index_select(0, tokens)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (order,) = ctx.saved_tensors
        rows = grad.index_select(0, order)
        return rows.view(-1, ctx.k, rows.shape[-1]).sum(1), None, None, None


class _Combine(torch.autograd.Function):
    """Expert-ordered rows [T*k, H] -> [T, H], each token's k rows summed; backward gathers into expert order."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        per_token = rows.index_select(0, order)
        return per_token.view(-1, k, rows.shape[-1]).sum(1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (tokens,) = ctx.saved_tensors
        return grad.index_select(0, tokens), None, None, None


def expert_order(routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, order) of a [T, E] boolean routing map: tokens[i] is the token of expert-ordered row i (megatron's
    sorted_indices: expert by expert, tokens ascending); order[t*k + j] is the expert-ordered row of token t's
    j-th expert (experts ascending), so order is a permutation of the rows."""
    by_expert = routing_map.t()
    pairs = by_expert.nonzero()  # row-major over [E, T]: expert order
    rank = torch.empty(by_expert.shape, dtype=torch.long, device=routing_map.device)
    rank[pairs[:, 0], pairs[:, 1]] = torch.arange(pairs.shape[0], device=routing_map.device)
    return pairs[:, 1], rank.t()[routing_map]


class GatherDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's all-gather dispatcher with `_Dispatch`/`_Combine` for its local permutation where every token
    has exactly top-k local experts; megatron's own path otherwise (several expert-parallel ranks, capacity)."""

    def _gathers_apply(self) -> bool:
        cfg = self.config
        return (self.num_local_experts == cfg.num_moe_experts and cfg.moe_expert_capacity_factor is None
                and not cfg.moe_permute_fusion)

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> tuple[Any, Any, Any]:
        self._order = None
        if not self._gathers_apply():
            return super().dispatch_postprocess(hidden_states, probs)
        local_map = self.routing_map  # every expert is local
        tokens, order = expert_order(local_map)
        if tokens.numel() != hidden_states.shape[0] * self.router_topk:  # not top-k per token after all
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        self._tokens, self._order = tokens, order
        tokens_per_expert = local_map.sum(dim=0).long().cpu()
        self.local_probs = probs.t().contiguous().masked_select(local_map.t().contiguous())
        self.routing_map = None
        return _Dispatch.apply(hidden_states, tokens, order, self.router_topk), tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        order, self._order = getattr(self, "_order", None), None
        if order is None:
            return super().combine_preprocess(hidden_states)
        return _Combine.apply(hidden_states, self._tokens, order, self.router_topk)


def use_gather_dispatch(model: torch.nn.Module, on: bool = True) -> int:
    """Give every MoE layer's all-gather dispatcher the gather-only permutation (on) or megatron's own (off);
    returns how many dispatchers. The dispatcher is built inside MoELayer from the config, so its class is
    switched in place: GatherDispatcher adds no state of its own beyond a step's indices."""
    cls = GatherDispatcher if on else MoEAllGatherTokenDispatcher
    count = 0
    for m in model.modules():
        d = getattr(m, "token_dispatcher", None)
        if isinstance(d, MoEAllGatherTokenDispatcher):
            d.__class__ = cls
            count += 1
    return count
