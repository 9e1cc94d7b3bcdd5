"""The token exchange of expert parallelism over a split batch (run key ep_batch: split).

Each EP rank runs its own share of the batch. A MoE layer gathers every rank's tokens, so that each rank's experts
see all the tokens routed to them, and sums the ranks' partial outputs back to the rank that holds each token. The
ranks' token counts differ, but every rank knows them on the host (each holds the whole batch's samples), so the
exchange pads to the largest and reads nothing from the GPU. It uses all-gather and all-reduce only: gloo, which the
CPU parity tests run over, has no reduce-scatter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_rows(x: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
    """Every rank's rows x [counts[rank], ...] -> all of them [sum(counts), ...], in rank order."""
    top = max(counts)
    padded = x.new_zeros((top, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])


def sum_own_rows(y: torch.Tensor, counts: list[int], rank: int, group: Any) -> torch.Tensor:
    """Every rank's rows y [sum(counts), ...] summed over the ranks; this rank keeps its own block."""
    total = y.clone()
    dist.all_reduce(total, group=group)
    lo = sum(counts[:rank])
    return total[lo: lo + counts[rank]]


class GatherRows(torch.autograd.Function):
    """gather_rows; its backward sums each row's gradient over the ranks that used it (sum_own_rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        return gather_rows(x, counts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return sum_own_rows(grad.contiguous(), ctx.counts, ctx.rank, ctx.group), None, None, None


class SumOwnRows(torch.autograd.Function):
    """sum_own_rows; its backward hands every rank the gradients of all the rows (gather_rows)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, counts: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.counts, ctx.group = counts, group
        return sum_own_rows(y, counts, rank, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return gather_rows(grad.contiguous(), ctx.counts, ctx.group), None, None, None
