"""The GRPO micro-batch step both trainers take: pad, forward, clipped-ratio loss, backward, gap readings.

A trainer supplies only its forward pass (per-token logprobs of a padded batch) and a way to switch its LoRA
off for the reference pass; the loss, its token weighting and the metrics are the same for every trainer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.study.run_config import RunConfig
from hybridrl.task.rl import LogprobGaps, engine_logprob_tensor, policy_loss, rollout_is_weights
from hybridrl.trainers.base import Sample
from hybridrl.trainers.packing import Packed, pack


@dataclass
class Batch:
    """Prompt + completion rows, right padded: ids [B, T], attention [B, T], and the completion mask over
    the T-1 targets (target t is token t+1). With `packed`, the forward runs on the packed row instead and
    returns its logprobs in this padded layout (Packed.unpack). completion [2, M]: the (row, col) of each
    completion target, the mask's nonzero found on the host (pad_batch), so that a forward which computes only
    those positions never waits for the device to find them."""

    ids: torch.Tensor
    attention: torch.Tensor
    mask: torch.Tensor
    packed: Packed | None = None
    completion: torch.Tensor | None = None
    # a batch split over ranks whose layers exchange tokens (Shard): each rank's forward tokens in this micro-batch
    split_tokens: list[int] | None = None

    @property
    def inputs(self) -> torch.Tensor:
        """ids[:, :-1]: the positions that predict a target."""
        return self.ids[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        return self.ids[:, 1:]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.ids.to(device), self.attention.to(device), self.mask.to(device),
                     None if self.packed is None else self.packed.to(device),
                     None if self.completion is None else self.completion.to(device), self.split_tokens)

    def completion_at(self) -> torch.Tensor:
        """completion, or the mask's nonzero where the batch was built without it (the device is waited for)."""
        return self.completion if self.completion is not None else self.mask.nonzero().t()


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
    return Batch(ids, attention, mask, completion=mask.nonzero().t())


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


def forward_tokens(chunk: list[Sample], run: RunConfig) -> int:
    """The tokens a forward of this micro-batch computes: packed, the samples' lengths summed; padded, its rows times
    the longest less one (Batch.inputs)."""
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in chunk]
    return sum(lengths) if run.pack_sequences else len(chunk) * (max(lengths) - 1)


@dataclass
class Shard:
    """One rank's part of a batch split over a group of ranks (the Megatron trainer's ep_batch split): its
    micro-batches, every rank's forward tokens in each of them, the whole batch's completion tokens (the loss's
    denominator) and the group over which the step's sums are taken."""

    chunks: list[list[Sample]]
    forward_tokens: list[list[int]]  # [micro-batch][rank]
    n_tokens: int
    group: Any


def split_batch(samples: list[Sample], run: RunConfig, ranks: int, rank: int, group: Any) -> Shard:
    """Samples k, k + ranks, ... to rank k, in the order given (the trainer's padded order is by length, so the
    shares' lengths match), each share in micro-batches as micro_batches makes them. A micro-batch's forward is a
    collective over the group, so where the shares' counts differ, every share is cut into the largest count of
    runs whose sizes differ by one at most (a token budget then holds approximately)."""
    if len(samples) < ranks:
        raise ValueError(f"a batch of {len(samples)} samples does not split over {ranks} ranks")
    shares = [samples[r::ranks] for r in range(ranks)]
    chunked = [micro_batches(share, run) for share in shares]
    count = max(len(c) for c in chunked)
    if count > min(len(share) for share in shares):
        raise ValueError(f"a batch of {len(samples)} samples in micro-batches of {run.micro_batch} does not split "
                         f"into {count} micro-batches on each of {ranks} ranks; give a batch that {ranks} divides")
    chunked = [c if len(c) == count else _runs(share, count) for c, share in zip(chunked, shares, strict=True)]
    tokens = [[forward_tokens(c[i], run) for c in chunked] for i in range(count)]
    return Shard(chunked[rank], tokens, sum(len(s.completion_ids) for s in samples), group)


def _runs(samples: list[Sample], count: int) -> list[list[Sample]]:
    """samples in `count` consecutive runs whose sizes differ by one at most."""
    size, extra = divmod(len(samples), count)
    out, lo = [], 0
    for i in range(count):
        hi = lo + size + (i < extra)
        out.append(samples[lo:hi])
        lo = hi
    return out


# a trainer's forward: (batch, entropy wanted) -> per-token log p(target) [B, T-1] in fp32 and, when wanted, the
# policy's entropy at each of those positions [B, T-1] (detached; else None). Only the positions in batch.mask are
# read: a forward may leave the others 0 (the trainers' chunked head computes the completion targets alone)
LogprobFn = Callable[[Batch, bool], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class MicroBatch:
    """One micro-batch, its tensors on the trainer's device: the batch, one advantage per row, the engine's
    logprobs where it returned them (engine_logprob_tensor), and its share of the batch's completion tokens."""

    batch: Batch
    advantages: torch.Tensor
    engine: torch.Tensor
    engine_present: torch.Tensor
    weight: float


def prepare(samples: list[Sample], run: RunConfig, device: torch.device, pad_id: int = 0,
            shard: Shard | None = None) -> list[MicroBatch]:
    """Every micro-batch of the update built on the host and copied to the device before any forward: a copy
    from the host waits for the device, so one made between micro-batches would stall the queue. With a shard,
    its micro-batches, weighted against the whole batch's tokens."""
    n_tokens = max(shard.n_tokens if shard else sum(len(s.completion_ids) for s in samples), 1)
    out = []
    for i, chunk in enumerate(shard.chunks if shard else micro_batches(samples, run)):
        batch = pad_batch(chunk, pad_id)
        batch.split_tokens = shard.forward_tokens[i] if shard else None
        if run.pack_sequences:
            batch.packed = pack(chunk)
        engine, present = engine_logprob_tensor([s.engine_logprobs for s in chunk], batch.mask)
        weight = int(batch.mask.sum()) / n_tokens
        out.append(MicroBatch(batch.to(device), torch.tensor([s.advantage for s in chunk]).to(device),
                              engine.to(device), present.to(device), weight))
    return out


def grpo_backward(samples: list[Sample], run: RunConfig, device: torch.device, logprobs: LogprobFn,
                  adapter_off: Callable[[], contextlib.AbstractContextManager], pad_id: int = 0,
                  shard: Shard | None = None) -> dict[str, float]:
    """Forward and backward over the batch in micro-batches (micro_batches), in the order given; leaves the
    LoRA gradients in .grad (the caller zeroes them first and steps the optimizer after).

    One forward per micro-batch: one optimizer step per batch means the sampling policy is the current one, so
    the old logprobs are this forward's, detached (ratio 1, gradient of the clipped objective intact); a second
    pass runs only for the KL reference (kl_coef > 0, LoRA off, no grad).

    logprobs(batch, entropy) -> LogprobFn's pair, from the packed row when batch.packed is set (as
    run.pack_sequences asks); adapter_off() disables LoRA for the KL reference.
    The loss is a token mean over the whole batch, however it is split; so is train/entropy (verl's
    actor/entropy), the policy's entropy over the completion tokens.

    The host never waits for the device between micro-batches (prepare copies everything first; the readings
    add up on the device and are read once at the end), so it queues the next forward while the GPU still runs
    the last backward.

    shard: this rank's part of a batch split over a group (split_batch; `samples` are ignored); its gradients are
    its share of the whole batch's, and the readings are summed over the group before they are read.
    """
    n_tokens = shard.n_tokens if shard else sum(len(s.completion_ids) for s in samples)
    # loss, kl, clipfrac, share of tokens the IS cap or mask changed, entropy: token means over the batch
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    has_entropy = True
    gaps = LogprobGaps()
    for mb in prepare(samples, run, device, pad_id, shard):
        batch = mb.batch
        logp, entropy = logprobs(batch, True)
        old = logp.detach()  # one update per batch: the sampling policy is the current one
        ref = None
        if run.kl_coef > 0:
            with torch.no_grad(), adapter_off():
                ref, _ = logprobs(batch, False)
        is_weights = None
        changed = totals.new_zeros(())
        if run.rollout_is != "off":  # the engine's logprobs are the behaviour policy's
            is_weights = rollout_is_weights(old, mb.engine, batch.mask, run.rollout_is_threshold, run.rollout_is)
            raw = torch.exp(old - mb.engine)
            # tokens the cap or the mask changed, as a share of the batch's
            changed = ((raw > run.rollout_is_threshold) & batch.mask).sum() / max(n_tokens, 1)
        loss, stats = policy_loss(logp, old, mb.advantages, batch.mask, run.clip_eps, ref, run.kl_coef, is_weights)
        (loss * mb.weight).backward()
        # a forward that cannot give the entropy: the step records NaN, not a partial mean
        has_entropy = has_entropy and entropy is not None
        ent = (totals.new_zeros(()) if entropy is None
               else torch.where(batch.mask, entropy, 0.0).sum() / max(n_tokens, 1))
        totals += torch.stack([loss.detach() * mb.weight, stats["train/kl"] * mb.weight,
                               stats["train/clipfrac"] * mb.weight, changed, ent]).double()
        gaps.add(old, mb.engine, mb.engine_present)
    if shard is not None:
        dist.all_reduce(totals, group=shard.group)
        gaps.reduce(shard.group)
    loss, kl, clipfrac, is_changed, entropy = totals.tolist()  # the one wait for the device
    return {
        "train/loss": loss,
        "train/kl": kl if run.kl_coef > 0 else math.nan,
        "train/clipfrac": clipfrac,
        "train/entropy": entropy if has_entropy else math.nan,
        "perf/train_tokens": float(n_tokens),
        # share of tokens whose importance weight the cap (truncate) or the mask changed; NaN with rollout_is off
        "mismatch/is_capped_frac": is_changed if run.rollout_is != "off" else math.nan,
        **gaps.metrics(n_tokens),
    }
