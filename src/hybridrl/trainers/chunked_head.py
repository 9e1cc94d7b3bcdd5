"""Per-token logprobs and entropy of an LM head over a large vocabulary, without the [tokens, vocab] logits.

The full-logits path (the model's head, then task.rl.token_logprobs_entropy) keeps the logits of every position
and, in the backward, their gradient: at Qwen's 151,936 rows that is about 4 GB each for a micro-batch of 12k
tokens in bf16, and most of the memory traffic the vocabulary adds to an update. Here the head runs chunk by
chunk over the tokens: the forward keeps only each token's logprob (and entropy), and the backward computes each
chunk's logits again and turns them straight into the gradient w.r.t. the hidden states. That is one more head
matmul per chunk, for a fraction of the bytes moved and O(chunk x vocab) memory.

The math is the full path's: logits in the matmul's dtype (bf16 under autocast), log-softmax in fp32, the
gradient g * (onehot - softmax) formed in fp32 and rounded once to the logits' dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridrl.task.rl import LOGSOFTMAX_CHUNK_BYTES

# fp32 bytes of one chunk's [tokens, vocab] log-softmax, as the full path's chunks (441 tokens at Qwen's vocabulary);
# read at each call, so that a test can make the chunks small
HEAD_CHUNK_BYTES = LOGSOFTMAX_CHUNK_BYTES


def chunk_slices(n: int, vocab: int, chunk_bytes: int) -> list[slice]:
    """Row slices of n tokens, each holding at most chunk_bytes of fp32 [rows, vocab] (at least one row)."""
    rows = max(1, chunk_bytes // (4 * max(vocab, 1)))
    return [slice(lo, min(lo + rows, n)) for lo in range(0, n, rows)]


class _HeadLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (log p(target) [N], entropy [N] or empty), both fp32.

    With `group`, the vocabulary is split over its ranks (megatron's vocab-parallel head): this rank holds rows
    vocab_start .. vocab_start + V of the whole. Each rank's log-softmax is then rescaled by w = exp(lse_rank - lse)
    (one all-gather of lse_rank per chunk), the logprob and entropy summed over the ranks (one all-reduce per
    chunk), and the gradient w.r.t. hidden all-reduced once, as the column-parallel head's input gradient is."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                chunk_bytes: int, entropy: bool, group: Any, vocab_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, vocab = hidden.shape[0], weight.shape[0]
        local = targets - vocab_start
        owned = (local >= 0) & (local < vocab)
        local = local.clamp(0, vocab - 1)
        logp = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_empty(n if entropy else 0, dtype=torch.float32)
        scale = hidden.new_ones(n if group is not None else 0, dtype=torch.float32)  # w per token (split only)
        with torch.autocast(hidden.device.type, enabled=False):
            for r in chunk_slices(n, vocab, chunk_bytes):
                x = hidden[r] @ weight.t()
                lp = torch.log_softmax(x, dim=-1, dtype=torch.float32)
                at_target = lp.gather(1, local[r, None])[:, 0]
                # -sum p log p, in place: one more chunk-sized buffer, not two
                own = -lp.exp().mul_(lp).sum(-1) if entropy else None
                if group is not None:
                    at_target, own, scale[r] = _combine(x, lp, at_target, owned[r], own, group)
                logp[r] = at_target
                if own is not None:
                    ent[r] = own
        ctx.save_for_backward(hidden, weight, local, owned, scale)
        ctx.chunk_bytes, ctx.group = chunk_bytes, group
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor  # type: ignore[override]
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        hidden, weight, local, owned, scale = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        g = grad.float()
        coef = g * scale if ctx.group is not None else g  # dL/dx = g * (onehot - w * softmax_rank(x))
        with torch.autocast(hidden.device.type, enabled=False):
            for r in chunk_slices(hidden.shape[0], weight.shape[0], ctx.chunk_bytes):
                p = torch.softmax(hidden[r] @ weight.t(), dim=-1, dtype=torch.float32)
                # the target's entry, g * (1 - w p_t), in fp32 before its one rounding, as the full path has it
                at_target = g[r] * owned[r] - coef[r] * p.gather(1, local[r, None])[:, 0]
                gx = torch.mul(p, -coef[r, None], out=torch.empty(p.shape, dtype=hidden.dtype, device=p.device))
                gx.scatter_(1, local[r, None], at_target.to(hidden.dtype)[:, None])
                if grad_hidden is not None:
                    torch.mm(gx, weight, out=grad_hidden[r])
                if grad_weight is not None:
                    grad_weight += (gx.t() @ hidden[r]).float()
        if ctx.group is not None and grad_hidden is not None:
            dist.all_reduce(grad_hidden, group=ctx.group)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None, None)


def _combine(x: torch.Tensor, lp: torch.Tensor, lp_target: torch.Tensor, owned: torch.Tensor,
             ent: torch.Tensor | None, group: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One chunk's logprob, entropy and w = p / p_rank over a vocabulary split across `group`, from this rank's
    logits x, their log-softmax lp, lp at the (clamped) target and the rank's own entropy."""
    top, at = x.max(dim=-1)
    lse_rank = top.float() - lp.gather(1, at[:, None])[:, 0]  # lp at the maximum is -log sum exp(x - max)
    parts = [torch.empty_like(lse_rank) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, lse_rank.contiguous(), group=group)
    shift = lse_rank - torch.logsumexp(torch.stack(parts), dim=0)  # log w
    w = shift.exp()
    # p = w p_rank: log p = lp + shift; the rank's share of -sum p log p is w (entropy_rank - shift)
    sums = torch.stack([torch.where(owned, lp_target + shift, 0.0),
                        w * (ent - shift) if ent is not None else torch.zeros_like(w)])
    dist.all_reduce(sums, group=group)
    return sums[0], sums[1] if ent is not None else None, w


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, entropy: bool = True,
                  chunk_bytes: int | None = None, group: Any = None,
                  vocab_start: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) of the head `weight` [V, H] on `hidden` [..., H], targets [...] -> [...] in fp32, and with
    `entropy` the entropy at each position (detached); the head's matmul in autocast's dtype where it is on.

    chunk_bytes: HEAD_CHUNK_BYTES where not given. group: the vocabulary split over a process group's ranks, this
    rank holding rows vocab_start .. + V (a group of one rank is no split). The weight gets its gradient too where
    it requires one (the trainers' is frozen)."""
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    device = hidden.device.type
    dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
             else torch.promote_types(hidden.dtype, weight.dtype))
    flat = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
    logp, ent = _HeadLogprobs.apply(flat, weight.to(dtype), targets.reshape(-1), chunk_bytes or HEAD_CHUNK_BYTES,
                                    entropy, group, vocab_start)
    return logp.view(targets.shape), ent.view(targets.shape) if entropy else None


def completion_logprobs(hidden: torch.Tensor, index: torch.Tensor, completion: torch.Tensor, targets: torch.Tensor,
                        weight: torch.Tensor, entropy: bool, **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """head_logprobs at the completion targets alone, laid out as `targets` [B, T] with zeros elsewhere (the loss
    and every reading mask them out; the prompt's positions are a third of the head's work at 128 + 256 tokens).

    hidden [P, H]: the forward's positions, flat; index [M]: the position predicting each completion target;
    completion [2, M]: the (row, col) of each in targets (grpo.Batch.completion)."""
    rows, cols = completion[0], completion[1]
    logp, ent = head_logprobs(hidden.index_select(0, index), weight, targets[rows, cols], entropy, **kw)

    def place(v: torch.Tensor) -> torch.Tensor:
        return v.new_zeros(targets.shape).index_put((rows, cols), v)

    return place(logp), None if ent is None else place(ent)
