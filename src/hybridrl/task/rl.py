"""GRPO pieces: group-normalised advantages and the clipped-ratio policy loss with an optional KL term."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """(r - mean(group)) / (std(group) + eps) for consecutive groups of `group_size` completions.

    A group whose rewards are all equal carries no signal and gets zero advantage.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    r = torch.tensor(list(rewards), dtype=torch.float64).view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + eps)).view(-1).tolist()


# fp32 bytes of one log-softmax chunk: the positions per chunk are this over 4 x vocab (at least 1)
LOGSOFTMAX_CHUNK_BYTES = 1 << 28


def logit_chunks(logits: torch.Tensor, chunk_bytes: int) -> list[tuple[slice, slice]]:
    """(rows, positions) slices of [B, T, V] logits, each at most chunk_bytes in fp32 (or one position); slices
    keep every chunk a view, so a non-contiguous logits[:, :-1] is never copied whole."""
    b, t, v = logits.shape
    step = max(1, chunk_bytes // (4 * max(v, 1)))
    if step >= t:  # whole rows fit: several rows per chunk
        rows = step // max(t, 1)
        return [(slice(i, min(i + rows, b)), slice(0, t)) for i in range(0, b, rows)]
    return [(slice(i, i + 1), slice(lo, min(lo + step, t))) for i in range(b) for lo in range(0, t, step)]


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(logits.float()).gather(target), one chunk of positions at a time, in forward and in backward:
    only a chunk's fp32 log-softmax exists at once (the unchunked form keeps [B, T, V] fp32 for backward). Each
    row is computed by the same ops as the unchunked form, so values and gradients are equal to it.

    With `entropy` the forward also returns each position's entropy -sum p log p from the same chunk's
    log-softmax (no gradient; an empty tensor without it)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk_bytes: int,  # type: ignore[override]
                entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        ent = torch.empty(targets.shape if entropy else (0,), dtype=torch.float32, device=logits.device)
        for r, c in logit_chunks(logits, chunk_bytes):
            logp = torch.log_softmax(logits[r, c].float(), dim=-1)
            out[r, c] = logp.gather(-1, targets[r, c].unsqueeze(-1)).squeeze(-1)
            if entropy:  # in place: one more chunk-sized buffer, not two
                ent[r, c] = -logp.exp().mul_(logp).sum(-1)
        ctx.save_for_backward(logits, targets)
        ctx.chunk_bytes = chunk_bytes
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad: torch.Tensor,  # type: ignore[override]
                 _: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, targets = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for r, c in logit_chunks(logits, ctx.chunk_bytes):
            logp = torch.log_softmax(logits[r, c].float(), dim=-1)
            g = grad[r, c].unsqueeze(-1)
            # d/dx log_softmax(x)[t] . g = g * (onehot(t) - softmax(x)), as autograd's log_softmax backward
            gx = torch.zeros_like(logp).scatter_(-1, targets[r, c].unsqueeze(-1), g)
            grad_logits[r, c] = (gx - torch.exp(logp) * g).to(logits.dtype)
        return grad_logits, None, None, None


def token_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk_bytes: int = LOGSOFTMAX_CHUNK_BYTES,
                           entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logprobs and, with `entropy`, from the same chunks the policy's entropy at each position ([B, T],
    float32, detached: the spread of the next-token distribution the sampled token was drawn from); else None."""
    if logits.requires_grad and torch.is_grad_enabled():
        logp, ent = _ChunkedTokenLogprobs.apply(logits, targets, chunk_bytes, entropy)
    else:
        with torch.no_grad():
            logp, ent = _ChunkedTokenLogprobs.forward(_NoCtx(), logits, targets, chunk_bytes, entropy)
    return logp, ent if entropy else None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   chunk_bytes: int = LOGSOFTMAX_CHUNK_BYTES) -> torch.Tensor:
    """log p(target) per position; logits [B, T, V], targets [B, T] -> [B, T] in float32.

    The fp32 log-softmax is computed over chunks of at most chunk_bytes, never over the whole batch at once.
    """
    return token_logprobs_entropy(logits, targets, chunk_bytes, entropy=False)[0]


class _NoCtx:
    """Stands in for autograd's ctx where no backward will run."""

    def save_for_backward(self, *_: torch.Tensor) -> None:
        pass

    def mark_non_differentiable(self, *_: torch.Tensor) -> None:
        pass


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-ratio GRPO loss, averaged over valid tokens, and its train/kl and train/clipfrac as detached 0-d
    tensors on the loss's device (a float() of them waits for the device: the trainers read them once a batch).

    logp/old_logp/ref_logp/mask/is_weights: [B, T]; advantages: [B] (one per completion).
    KL uses the k3 estimator exp(ref - logp) - (ref - logp) - 1, which is >= 0 and unbiased.
    is_weights (rollout_is_weights) correct for samples the engine drew from another policy than old_logp's.
    """
    mask = mask.to(logp.dtype)
    n_tokens = mask.sum().clamp(min=1.0)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.to(logp.dtype)
    kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None:
        delta = ref_logp - logp
        kl_tok = torch.exp(delta) - delta - 1.0
        kl = (kl_tok * mask).sum() / n_tokens
        if kl_coef:
            per_token = per_token + kl_coef * kl_tok
    loss = (per_token * mask).sum() / n_tokens
    clipfrac = (((ratio - 1.0).abs() > clip_eps).to(logp.dtype) * mask).sum() / n_tokens
    return loss, {"train/kl": kl.detach(), "train/clipfrac": clipfrac.detach()}


def rollout_is_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, threshold: float,
                       mode: str) -> torch.Tensor:
    """Token-level importance weights pi_old / pi_engine for samples the engine drew (behaviour policy), as
    verl's rollout_is and slime's TIS: "truncate" caps each weight at `threshold`; "mask" drops the tokens whose
    weight exceeds it (weight 0) and keeps the others' weights. Padding gets 0. No gradient flows through them."""
    if mode not in ("truncate", "mask"):
        raise ValueError(f"rollout_is mode {mode!r}: truncate or mask")
    w = torch.exp((old_logp - engine_logp).detach().float())
    w = w.clamp(max=threshold) if mode == "truncate" else w * (w <= threshold)
    return w * mask.float()


def engine_logprob_tensor(engine_logprobs: Sequence[Sequence[float]],
                          mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's sampled-token logprobs laid out like `mask` ([B, T]; each row's completion positions, in
    order), and where they are: an engine may return fewer logprobs than a row has completion tokens (a cut
    stream). Built on the host from a host mask, so that a trainer can copy it to the GPU before its forward."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    present = torch.zeros(mask.shape, dtype=torch.bool)
    for i, row in enumerate(engine_logprobs):
        positions = mask[i].nonzero().flatten()
        n = min(len(positions), len(row))
        out[i, positions[:n]] = torch.tensor(list(row[:n]), dtype=torch.float32)
        present[i, positions[:n]] = True
    return out, present


class LogprobGaps:
    """Trainer-vs-engine logprob gaps over one batch, |trainer logprob - engine logprob| per completion token.

    The gate reads the mean per token; the worst token and the worst sample's mean say where an excess comes
    from: a few tokens, or some requests as a whole (e.g. rolled out with a stale adapter). The readings stay on
    the trainer's device until metrics(), so that reading a micro-batch does not wait for its backward.
    """

    # the running readings, in this order (float64: sums over a whole batch); the two maxima are kept apart
    SUMS = ("tokens", "total", "k3", "w_sum", "w_sq")
    MAXIMA = ("token_max", "sample_max")

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.maxima: torch.Tensor | None = None

    def add(self, trainer_logp: torch.Tensor, engine: torch.Tensor, present: torch.Tensor) -> None:
        """trainer_logp [B, T] over target positions; engine and present as engine_logprob_tensor gives them,
        on trainer_logp's device."""
        delta = torch.where(present, trainer_logp.detach().float() - engine, 0.0).double()  # log(pi_t / pi_e)
        gap = delta.abs()
        w = torch.exp(delta) * present  # importance weights pi_trainer / pi_engine per token; 0 where none
        sums = torch.stack([present.sum().double(), gap.sum(),
                            (w - present.double() - delta).sum(),  # KL(engine || trainer), k3 estimator
                            w.sum(), (w * w).sum()])
        # a row without engine logprobs reads 0, below any real row's mean
        maxima = torch.stack([gap.max(), (gap.sum(1) / present.sum(1).clamp(min=1)).max()])
        self.sums = sums if self.sums is None else self.sums + sums
        self.maxima = maxima if self.maxima is None else torch.maximum(self.maxima, maxima)

    def reduce(self, group: object) -> None:
        """The readings summed (the maxima: their largest) over a group of ranks that each read part of one batch."""
        import torch.distributed as dist

        if self.sums is None or self.maxima is None:
            raise RuntimeError("LogprobGaps.reduce: this rank read no micro-batch")
        dist.all_reduce(self.sums, group=group)
        dist.all_reduce(self.maxima, op=dist.ReduceOp.MAX, group=group)

    def metrics(self, n_tokens: int) -> dict[str, float]:
        """The gate's mean over all n_tokens completion tokens, and the worst token and sample (NaN if none)."""
        r = dict.fromkeys((*self.SUMS, *self.MAXIMA), 0.0)
        if self.sums is not None and self.maxima is not None:
            r.update(zip((*self.SUMS, *self.MAXIMA), torch.cat([self.sums, self.maxima]).tolist(), strict=True))
        none = r["tokens"] == 0
        return {"check/rollout_logprob_abs_diff": r["total"] / max(n_tokens, 1),
                "check/logprob_gap_token_max": math.nan if none else r["token_max"],
                "check/logprob_gap_sample_max": math.nan if none else r["sample_max"],
                "mismatch/kl_k3": math.nan if none else r["k3"] / r["tokens"],
                "mismatch/is_weight_mean": math.nan if none else r["w_sum"] / r["tokens"],
                # Kish's effective sample size over the tokens, as a share of them: 1 when engine and trainer agree
                "mismatch/ess": math.nan if none or not r["w_sq"] else r["w_sum"] ** 2 / (r["tokens"] * r["w_sq"])}
