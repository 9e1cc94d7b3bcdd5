"""The GRPO micro-batch step both trainers take: pad, forward, clipped-ratio loss, backward, gap readings.

A trainer supplies only its forward pass (per-token logprobs of a padded batch) and a way to switch its LoRA
off for the reference pass; the loss, its token weighting and the metrics are the same for every trainer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridrl.study.run_config import RunConfig
from hybridrl.task.rl import LogprobGaps, engine_logprob_tensor, policy_loss, rollout_is_weights
from hybridrl.trainers.base import Sample
from hybridrl.trainers.packing import Packed, pack


@dataclass
class Batch:
    """Prompt + completion rows, right padded: ids [B, T], attention [B, T], and the completion mask over
    the T-1 targets (target t is token t+1). With `packed`, the forward runs on the packed row instead and
    returns its logprobs in this padded layout (Packed.unpack)."""

    ids: torch.Tensor
    attention: torch.Tensor
    mask: torch.Tensor
    packed: Packed | None = None

    @property
    def inputs(self) -> torch.Tensor:
        """ids[:, :-1]: the positions that predict a target."""
        return self.ids[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        return self.ids[:, 1:]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.ids.to(device), self.attention.to(device), self.mask.to(device),
                     None if self.packed is None else self.packed.to(device))


def pad_batch(samples: list[Sample], pad_id: int = 0) -> Batch:
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
    for i, (s, seq) in enumerate(zip(samples, seqs, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
        # completion targets start at len(prompt) - 1: that position predicts the first completion token
        mask[i, len(s.prompt_ids) - 1 : len(seq) - 1] = True
    return Batch(ids, attention, mask)


def micro_batches(samples: list[Sample], run: RunConfig) -> list[list[Sample]]:
    """Consecutive slices of the batch: run.micro_batch samples each, or, with run.micro_batch_tokens, as many
    as keep the tokens a forward computes within that budget: their sum when packed, rows x longest padded."""
    if run.micro_batch_tokens is None:
        return [samples[lo : lo + run.micro_batch] for lo in range(0, len(samples), run.micro_batch)]
    out: list[list[Sample]] = []
    cur: list[Sample] = []
    width = total = 0
    for s in samples:
        n = len(s.prompt_ids) + len(s.completion_ids)
        size = total + n if run.pack_sequences else (len(cur) + 1) * max(width, n)
        if cur and size > run.micro_batch_tokens:
            out.append(cur)
            cur, width, total = [], 0, 0
        cur.append(s)
        width, total = max(width, n), total + n
    if cur:
        out.append(cur)
    return out


# a trainer's forward: (batch, entropy wanted) -> per-token log p(target) [B, T-1] in fp32 and, when wanted, the
# policy's entropy at each of those positions [B, T-1] (detached; else None)
LogprobFn = Callable[[Batch, bool], tuple[torch.Tensor, torch.Tensor | None]]


def grpo_backward(samples: list[Sample], run: RunConfig, device: torch.device, logprobs: LogprobFn,
                  adapter_off: Callable[[], contextlib.AbstractContextManager], pad_id: int = 0) -> dict[str, float]:
    """Forward and backward over the batch in micro-batches (micro_batches), in the order given; leaves the
    LoRA gradients in .grad (the caller zeroes them first and steps the optimizer after).

    One forward per micro-batch: one optimizer step per batch means the sampling policy is the current one, so
    the old logprobs are this forward's, detached (ratio 1, gradient of the clipped objective intact); a second
    pass runs only for the KL reference (kl_coef > 0, LoRA off, no grad).

    logprobs(batch, entropy) -> LogprobFn's pair, from the packed row when batch.packed is set (as
    run.pack_sequences asks); adapter_off() disables LoRA for the KL reference.
    The loss is a token mean over the whole batch, however it is split; so is train/entropy (verl's
    actor/entropy), the policy's entropy over the completion tokens.
    """
    n_tokens = sum(len(s.completion_ids) for s in samples)
    totals = {"loss": 0.0, "kl": 0.0, "clipfrac": 0.0, "is_changed": 0.0, "entropy": 0.0}
    gaps = LogprobGaps()
    for chunk in micro_batches(samples, run):
        batch = pad_batch(chunk, pad_id)
        if run.pack_sequences:
            batch.packed = pack(chunk)
        batch = batch.to(device)
        logp, entropy = logprobs(batch, True)
        old = logp.detach()  # one update per batch: the sampling policy is the current one
        ref = None
        if run.kl_coef > 0:
            with torch.no_grad(), adapter_off():
                ref, _ = logprobs(batch, False)
        adv = torch.tensor([s.advantage for s in chunk], device=device, dtype=torch.float32)
        is_weights = None
        if run.rollout_is != "off":  # the engine's logprobs are the behaviour policy's
            engine = engine_logprob_tensor([s.engine_logprobs for s in chunk], batch.mask)
            is_weights = rollout_is_weights(old, engine, batch.mask, run.rollout_is_threshold, run.rollout_is)
            raw = torch.exp(old - engine)
            changed = (raw > run.rollout_is_threshold) & batch.mask  # tokens the cap or the mask changed
            totals["is_changed"] += changed.sum().item() / max(n_tokens, 1)
        loss, stats = policy_loss(logp, old, adv, batch.mask, run.clip_eps, ref, run.kl_coef, is_weights)
        weight = batch.mask.sum().item() / max(n_tokens, 1)
        (loss * weight).backward()
        totals["loss"] += loss.item() * weight
        totals["kl"] += stats["train/kl"] * weight
        totals["clipfrac"] += stats["train/clipfrac"] * weight
        if entropy is None:  # a forward that cannot give it: the step records NaN, not a partial mean
            totals["entropy"] = math.nan
        else:
            totals["entropy"] += entropy[batch.mask].sum().item() / max(n_tokens, 1)
        gaps.add(old, batch.mask, [s.engine_logprobs for s in chunk])
    return {
        "train/loss": totals["loss"],
        "train/kl": totals["kl"] if run.kl_coef > 0 else math.nan,
        "train/clipfrac": totals["clipfrac"],
        "train/entropy": totals["entropy"],
        "perf/train_tokens": float(n_tokens),
        # share of tokens whose importance weight the cap (truncate) or the mask changed; NaN with rollout_is off
        "mismatch/is_capped_frac": totals["is_changed"] if run.rollout_is != "off" else math.nan,
        **gaps.metrics(n_tokens),
    }
