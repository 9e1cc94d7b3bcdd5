"""MoE token permutation by gathers alone, for megatron-core's all-gather dispatcher without Transformer Engine.

Without TE's fused permute, megatron's `permute` gathers each token's copies into expert order (index_select),
whose backward is an atomic `index_add_` of 6144 x 8 rows, and its `unpermute` sums the experts' outputs back with
an atomic `scatter_add_`. On one H200 these two took about 15% of a 48-layer Qwen3-30B-A3B-shaped update's GPU time
(trainer-profile). Where every token has exactly top-k experts (no capacity dropping), the copies of a token are
the slots t*k .. t*k+k-1 of a token-major layout, so both directions become a gather with a permutation and a sum
over k: no atomics, and a sum that rounds once instead of once per expert. A capacity falls back to megatron's own
code; a token with other than k experts where none is set (not what megatron's top-k router makes) stops the run
with a device-side assert rather than permute wrongly.

With every expert on the rank (EP 1) the row count is known (T*k), so the indices come from topk and a sort, and
the expert counts stay on the GPU: no host synchronisation in a MoE layer. An expert-parallel rank keeps the
contiguous run of expert-ordered rows that belong to its experts, whose ends it reads once from the GPU; a slot of
another rank's expert adds zero to its token. Megatron's path waits for the GPU three times a layer (the counts'
.cpu(), two masked_selects), which drains the launch queue of an update that is bound by the host's launches.
With `masked` (run key ep_dispatch: masked) an expert-parallel rank reads nothing either: it keeps every token's
rows, its own experts' first (the routing map rotated so that they lead), and masks the rest on the GPU, at the
cost of holding the other ranks' rows too.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from hybridrl.trainers.megatron import ep_tokens


def _sum_slots(rows: torch.Tensor, slot_row: torch.Tensor, valid: torch.Tensor | None, k: int) -> torch.Tensor:
    """Expert-ordered rows [n, H] -> [T, H]: token t's slots t*k .. t*k+k-1 summed, slot s being row slot_row[s];
    where `valid` is given, a slot it marks False (an expert of another EP rank) adds zero. Gathers only."""
    num_tokens = slot_row.shape[0] // k
    if valid is None:
        per_slot = rows.index_select(0, slot_row)
    elif rows.shape[0] == 0:  # none of this rank's experts was chosen
        return rows.new_zeros(num_tokens, rows.shape[-1])
    else:
        per_slot = rows.index_select(0, slot_row.clamp(0, rows.shape[0] - 1))
        per_slot = torch.where(valid.unsqueeze(-1), per_slot, per_slot.new_zeros(()))
    return per_slot.view(num_tokens, k, rows.shape[-1]).sum(1)


class _Dispatch(torch.autograd.Function):
    """x [T, H] -> this rank's rows [n, H] in expert order (rows[i] = x[tokens[i]]); backward sums each token's
    rows' gradients back by gathers (_sum_slots)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tokens: torch.Tensor, slot_row: torch.Tensor,
                valid: torch.Tensor | None, k: int) -> torch.Tensor:
        ctx.save_for_backward(slot_row, valid)
        ctx.k = k
        return x.index_select(0, tokens)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        slot_row, valid = ctx.saved_tensors
        return _sum_slots(grad, slot_row, valid, ctx.k), None, None, None, None


class _Combine(torch.autograd.Function):
    """This rank's expert-ordered rows [n, H] -> [T, H], each token's rows summed (_sum_slots); backward gathers
    each row's token gradient."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, tokens: torch.Tensor, slot_row: torch.Tensor,
                valid: torch.Tensor | None, k: int) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        return _sum_slots(rows, slot_row, valid, k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (tokens,) = ctx.saved_tensors
        return grad.index_select(0, tokens), None, None, None, None


class _Pick(torch.autograd.Function):
    """x[index] of a flat x at distinct indices; backward copies into place (index_select's backward would
    accumulate with atomics, needless where no index repeats)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.size = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.size).index_copy_(0, index, grad), None


def expert_order(routing_map: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, order, experts) of a [T, E] boolean routing map with exactly k experts per token: tokens[i] and
    experts[i] are the token and expert of expert-ordered row i (megatron's sorted_indices: expert by expert, tokens
    ascending); order[t*k + j] is the expert-ordered row of token t's j-th expert (experts ascending), so order is a
    permutation of the rows. No host synchronisation: every size is T*k."""
    num_tokens, num_experts = routing_map.shape
    dev = routing_map.device
    # the smaller the expert index, the larger its score: topk's sorted output lists each token's experts ascending
    score = torch.where(routing_map, torch.arange(num_experts, 0, -1, device=dev, dtype=torch.int32), 0)
    per_token = score.topk(k, dim=1).indices.reshape(-1)  # token-major slots t*k + j
    # expert-ordered row i holds token-major slot slots[i], of expert experts[i]
    experts, slots = per_token.sort(stable=True)
    rows = torch.arange(num_tokens * k, device=dev)
    order = torch.empty_like(slots).scatter_(0, slots, rows)
    return slots.div(k, rounding_mode="floor"), order, experts


class GatherDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's all-gather dispatcher with `_Dispatch`/`_Combine` for its local permutation where every token
    has exactly top-k experts (no capacity); megatron's own path otherwise. Its experts may be all of them (EP 1) or
    a rank's contiguous block (EP > 1): then the rows are that block's share of the expert-ordered rows, one host
    read a layer finding where it starts and ends."""

    masked = False  # EP > 1: every token's rows kept and the other ranks' masked, instead of the one host read

    def _gathers_apply(self) -> bool:
        cfg = self.config
        return cfg.moe_expert_capacity_factor is None and not cfg.moe_permute_fusion

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> tuple[Any, Any, Any]:
        self._order = None
        if not self._gathers_apply():
            return super().dispatch_postprocess(hidden_states, probs)
        routing = self.routing_map  # [T, E]: every token's experts, this rank's and the others'
        num_tokens, num_experts = routing.shape
        k = self.router_topk
        # the router's top-k gives every token k experts where nothing is dropped; checked without waiting for the GPU
        torch._assert_async(routing.sum(dim=1).eq(k).all())
        counts = routing.sum(dim=0)  # on the GPU: GroupedExperts takes its offsets there
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        valid = own = None
        if last - first < num_experts and self.masked:
            # this rank's experts lead the rotated map, so their rows come first; the experts leave the rows after
            # theirs unwritten (GroupedExperts.foreign_rows), and the masks keep those out of both directions
            tokens, slot_row, rotated = expert_order(routing.roll(-first, dims=1), k)
            own = rotated < last - first
            experts = (rotated + first) % num_experts
            valid = slot_row < own.sum()
        else:
            tokens, slot_row, experts = expert_order(routing, k)
            if last - first < num_experts:
                # this rank's experts own the expert-ordered rows lo .. hi-1: the one wait for the GPU in this layer
                ends = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
                lo, hi = ends[[first, last]].tolist()
                tokens, experts = tokens[lo:hi], experts[lo:hi]
                slot_row = slot_row - lo
                valid = (slot_row >= 0) & (slot_row < hi - lo)
        self.hidden_shape_before_permute = hidden_states.shape
        self._tokens, self._order, self._valid = tokens, slot_row, valid
        self.local_probs = _Pick.apply(probs.reshape(-1), tokens * num_experts + experts)
        if own is not None:  # another rank's expert: no prob, and no gradient back to the router from this rank
            self.local_probs = torch.where(own, self.local_probs, 0.0)
        self.routing_map = None
        rows = _Dispatch.apply(hidden_states, tokens, slot_row, valid, k)
        return rows, counts[first:last], self.local_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # the indices live on in the autograd graph only: none stay on the GPU after the update (colocate offload)
        order, self._order = getattr(self, "_order", None), None
        tokens, self._tokens = getattr(self, "_tokens", None), None
        valid, self._valid = getattr(self, "_valid", None), None
        if order is None:
            return super().combine_preprocess(hidden_states)
        return _Combine.apply(hidden_states, tokens, order, valid, self.router_topk)


class ExpertParallelDispatcher(GatherDispatcher):
    """Expert parallelism at expert TP 1, the batch replicated or split over the EP ranks.

    Replicated (`counts` None: every rank runs the whole batch, only the experts are split): nothing moves before the
    experts. Each rank routes all tokens, keeps those of its own experts (GatherDispatcher's gathers), and the
    partial outputs are summed over the EP group. Autograd, with y = sum over ranks r of f_r(x, probs):
      forward  - all-reduce of the partial outputs (its backward hands each rank the same gradient of y);
      backward - the gradients of x and of the routing probs that reach the experts are summed over the group
                 (copy_to_region): each rank's own holds its experts' share only, and the router's backward
                 and the layers below need the whole.
    megatron's all-gather dispatcher would instead gather EP x the tokens (every rank the same ones again) and
    reduce-scatter them: twice the expert work, and reduce-scatter, which gloo does not have.

    Split (`counts`: each rank's token count in this forward, set before it by the policy): every rank's tokens,
    routing and probs are gathered first, and each rank keeps its own tokens' sums of the partial outputs
    (ep_tokens.py)."""

    counts: list[int] | None = None

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, probs = super().dispatch_preprocess(hidden_states, routing_map, probs)
        if self.ep_size > 1 and self.counts is None:
            hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group=self.ep_group)
            probs = copy_to_tensor_model_parallel_region(probs, group=self.ep_group)
        return hidden_states, probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp_size > 1:
            raise RuntimeError("ExpertParallelDispatcher takes expert TP 1 (the trainer's MoE runs at train_tp 1)")
        if self.ep_size > 1 and self.counts is not None:
            if hidden_states.shape[0] != self.counts[self.ep_rank]:
                raise RuntimeError(f"EP rank {self.ep_rank} has {hidden_states.shape[0]} tokens in this MoE layer, "
                                   f"and its split batch said {self.counts[self.ep_rank]}")
            group, rank = self.ep_group, self.ep_rank
            self.routing_map = ep_tokens.gather_rows(self.routing_map.to(torch.uint8), self.counts, group).bool()
            probs = ep_tokens.GatherRows.apply(probs, self.counts, rank, group)
            hidden_states = ep_tokens.GatherRows.apply(hidden_states, self.counts, rank, group)
        return hidden_states, probs

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return hidden_states
        # summed in the probs' dtype (fp32), as megatron's reduce-scatter does
        wide = hidden_states.to(self.local_probs.dtype)
        summed = (reduce_from_tensor_model_parallel_region(wide, group=self.ep_group) if self.counts is None
                  else ep_tokens.SumOwnRows.apply(wide, self.counts, self.ep_rank, self.ep_group))
        return summed.to(hidden_states.dtype)


class _MaskedExpertParallel(ExpertParallelDispatcher):
    """The same communication, each rank keeping every token's rows and masking the other ranks' (no host read)."""

    masked = True


class _MegatronPermuteExpertParallel(ExpertParallelDispatcher):
    """The same communication with megatron's own local permutation throughout (megatron_permute)."""

    def _gathers_apply(self) -> bool:
        return False


def expert_parallel_dispatchers(model: torch.nn.Module) -> list[ExpertParallelDispatcher]:
    """The model's MoE dispatchers at EP > 1 (after use_gather_dispatch), whose `counts` a split batch sets."""
    return [d for m in model.modules() if isinstance(d := getattr(m, "token_dispatcher", None),
                                                      ExpertParallelDispatcher)]


def use_gather_dispatch(model: torch.nn.Module, on: bool = True, masked: bool = False) -> int:
    """Give every MoE layer's all-gather dispatcher the gather-only permutation (on) or megatron's own (off);
    returns how many dispatchers. The dispatcher is built inside MoELayer from the config, so its class is
    switched in place: the classes here add no state beyond a layer's indices between its dispatch and its combine.
    At expert parallelism > 1 the dispatcher is ExpertParallelDispatcher either way; masked: each rank keeps every
    token's rows and masks the others' (_MaskedExpertParallel, its experts told so)."""
    if masked and not on:
        raise ValueError("masked expert-parallel rows are a way of the gathers; megatron's own permutation reads "
                         "its counts on the host")
    count = 0
    for m in model.modules():
        d = getattr(m, "token_dispatcher", None)
        if isinstance(d, MoEAllGatherTokenDispatcher):
            if d.ep_size > 1:
                d.__class__ = ((_MaskedExpertParallel if masked else ExpertParallelDispatcher) if on
                               else _MegatronPermuteExpertParallel)
                m.experts.foreign_rows = masked
            else:
                d.__class__ = GatherDispatcher if on else MoEAllGatherTokenDispatcher
            count += 1
    return count
