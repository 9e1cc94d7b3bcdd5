"""The one GRPO micro-batch step and the one way to pad a batch, which both trainers use."""

from __future__ import annotations

import contextlib
import inspect
import math

import pytest
import torch

from hybridrl.study.run_config import RunConfig
from hybridrl.task.rl import policy_loss, token_logprobs_entropy
from hybridrl.trainers import grpo
from hybridrl.trainers.base import Sample
from hybridrl.trainers.grpo import grpo_backward, pad_batch

SAMPLES = [
    Sample(prompt_ids=[1, 2, 3], completion_ids=[4, 5], engine_logprobs=[-1.0, -1.0], advantage=1.0),
    Sample(prompt_ids=[6], completion_ids=[7, 8, 9, 2], engine_logprobs=[-2.0] * 4, advantage=-0.5),
    Sample(prompt_ids=[3, 3], completion_ids=[1], engine_logprobs=[-0.5], advantage=0.25),
]


def test_pad_batch_right_pads_and_masks_the_completion_targets() -> None:
    b = pad_batch(SAMPLES[:2], pad_id=0)
    assert b.ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 2]]
    b = pad_batch(SAMPLES, pad_id=-1)
    assert b.ids[2].tolist() == [3, 3, 1, -1, -1] and b.attention[2].tolist() == [1, 1, 1, 0, 0]
    # target t is token t+1: the mask marks exactly the completion tokens among the targets
    for row, s in enumerate(SAMPLES):
        assert b.targets[row][b.mask[row]].tolist() == s.completion_ids
    assert b.inputs.shape == b.targets.shape == b.mask.shape == (3, 4)


class Toy(torch.nn.Module):
    """A bigram model with a switchable 'adapter', enough to exercise the step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 8)
        self.out = torch.nn.Linear(8, 10)
        self.adapter = torch.nn.Parameter(torch.randn(8, 8) * 0.1)
        self.adapter_on = True

    def logits(self, batch: grpo.Batch) -> torch.Tensor:
        h = self.emb(batch.inputs)
        if self.adapter_on:
            h = h + h @ self.adapter
        return self.out(h)

    def logprobs(self, batch: grpo.Batch, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_logprobs_entropy(self.logits(batch), batch.targets, entropy=entropy)

    @contextlib.contextmanager
    def off(self):
        self.adapter_on = False
        try:
            yield
        finally:
            self.adapter_on = True


def _grads(model: Toy, micro_batch: int, kl_coef: float = 0.0) -> tuple[dict[str, float], list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    run = RunConfig(model="toy", micro_batch=micro_batch, kl_coef=kl_coef)
    metrics = grpo_backward(SAMPLES, run, torch.device("cpu"), model.logprobs, model.off)
    return metrics, [p.grad.clone() for p in model.parameters()]


def test_the_loss_is_one_token_mean_however_the_batch_is_split() -> None:
    model = Toy()
    whole, g_whole = _grads(model, micro_batch=8)
    split, g_split = _grads(model, micro_batch=1)
    assert whole["perf/train_tokens"] == 7.0 and math.isnan(whole["train/kl"])
    assert split["train/loss"] == pytest.approx(whole["train/loss"], abs=1e-6)
    for a, b in zip(g_whole, g_split, strict=True):
        torch.testing.assert_close(a, b)
    # and it is the policy loss over all tokens at once
    batch = pad_batch(SAMPLES)
    logp, _ = model.logprobs(batch)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([s.advantage for s in SAMPLES]), batch.mask)
    assert whole["train/loss"] == pytest.approx(float(loss), abs=1e-6)


def test_train_entropy_is_the_policy_entropy_over_completion_tokens_however_split() -> None:
    model = Toy()
    whole, _ = _grads(model, micro_batch=8)
    split, _ = _grads(model, micro_batch=1)
    batch = pad_batch(SAMPLES)
    with torch.no_grad():
        want = torch.distributions.Categorical(logits=model.logits(batch)).entropy()[batch.mask].mean()
    assert whole["train/entropy"] == pytest.approx(float(want), rel=1e-6)
    assert split["train/entropy"] == pytest.approx(float(want), rel=1e-6)
    assert 0 < whole["train/entropy"] < math.log(10)  # a spread-out policy over 10 tokens, not a uniform one


def test_a_forward_without_entropy_records_nan_not_a_partial_mean() -> None:
    model = Toy()
    run = RunConfig(model="toy", micro_batch=2)
    metrics = grpo_backward(SAMPLES, run, torch.device("cpu"), lambda b, _: model.logprobs(b, False), model.off)
    assert math.isnan(metrics["train/entropy"]) and math.isfinite(metrics["train/loss"])
    # one micro-batch of two without it: still NaN, not the mean of the other one
    calls = []

    def first_only(batch: grpo.Batch, want: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        calls.append(batch)
        return model.logprobs(batch, want and len(calls) == 1)

    assert math.isnan(grpo_backward(SAMPLES, run, torch.device("cpu"), first_only, model.off)["train/entropy"])
    assert len(calls) == 2


def test_the_kl_reference_runs_with_the_adapter_off() -> None:
    model = Toy()
    metrics, _ = _grads(model, micro_batch=2, kl_coef=0.1)
    assert metrics["train/kl"] > 0  # the adapter moves the policy away from the base
    with torch.no_grad():
        model.adapter.zero_()
    assert _grads(model, micro_batch=2, kl_coef=0.1)[0]["train/kl"] == pytest.approx(0.0, abs=1e-7)


def test_the_engine_logprob_gap_is_read_on_the_same_forward() -> None:
    metrics, _ = _grads(Toy(), micro_batch=2)
    assert metrics["check/rollout_logprob_abs_diff"] > 0
    assert metrics["check/logprob_gap_token_max"] >= metrics["check/logprob_gap_sample_max"]


def test_both_trainers_take_the_shared_step_and_pad_no_batch_of_their_own() -> None:
    from hybridrl.trainers import hf
    from hybridrl.trainers.megatron import policy

    # HFTrainer.step times HFTrainer.update (also trainer-profile's update), which takes the shared step
    assert "update" in hf.HFTrainer.step.__code__.co_names
    assert "grpo_backward" in hf.HFTrainer.update.__code__.co_names
    assert "grpo_backward" in policy.MegatronPolicy.backward.__code__.co_names
    for module in (hf, policy):
        source = inspect.getsource(module)
        assert "policy_loss" not in source and "def pad_batch" not in source, module.__name__


def _is_grads(samples: list[Sample], **over) -> tuple[torch.Tensor, dict[str, float]]:
    model = Toy()
    run = RunConfig(model="m", **{"micro_batch": 2, **over})
    metrics = grpo_backward(samples, run, torch.device("cpu"), model.logprobs, model.off)
    return model.adapter.grad.clone(), metrics


def test_rollout_is_reweights_only_tokens_the_engine_drew_from_another_policy() -> None:
    # engine logprobs equal to the trainer's own: every weight is 1 and the update is the on-policy one
    model = Toy()
    with torch.no_grad():
        own, _ = model.logprobs(pad_batch(SAMPLES))
    mask = pad_batch(SAMPLES).mask
    same = [Sample(s.prompt_ids, s.completion_ids, own[i][mask[i]].tolist(), s.advantage)
            for i, s in enumerate(SAMPLES)]
    off, m_off = _is_grads(same)
    on, m_on = _is_grads(same, rollout_is="truncate", rollout_is_threshold=2.0)
    assert torch.allclose(off, on, atol=1e-6)
    assert math.isnan(m_off["mismatch/is_capped_frac"]) and m_on["mismatch/is_capped_frac"] == 0.0
    # a stale rollout: the engine gave the second sample's tokens far lower logprobs (weights above the cap)
    stale = [same[0], Sample(same[1].prompt_ids, same[1].completion_ids,
                             [lp - 3.0 for lp in same[1].engine_logprobs], same[1].advantage), same[2]]
    truncated, m_trunc = _is_grads(stale, rollout_is="truncate", rollout_is_threshold=2.0)
    masked, m_mask = _is_grads(stale, rollout_is="mask", rollout_is_threshold=2.0)
    assert not torch.allclose(truncated, _is_grads(stale)[0]) and not torch.allclose(masked, truncated)
    assert m_trunc["mismatch/is_capped_frac"] == m_mask["mismatch/is_capped_frac"] == pytest.approx(4 / 7)
    # masking the stale sample's tokens leaves the update of the two others alone
    only_fresh, _ = _is_grads([same[0], same[2]], micro_batch=2)
    assert torch.allclose(masked * 7, only_fresh * 3, atol=1e-5)  # token means over 7 and 3 tokens


# Tensor methods that make the host wait for the device when the tensor lives on a GPU
HOST_READS = ("cpu", "item", "tolist", "nonzero", "masked_select", "__bool__", "__float__", "__int__")


def test_the_host_reads_nothing_from_the_device_between_micro_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU each read would stall the queue until the last backward is done, so the next forward could not be
    queued while it runs: the update reads its metrics once, after the last micro-batch."""
    events: list[str] = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _f=real, **k: events.append("read") or _f(*a, **k))
    model = Toy()

    def forward(batch: grpo.Batch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        events.append("forward")
        return model.logprobs(batch, entropy)

    run = RunConfig(model="toy", micro_batch=1, kl_coef=0.1, rollout_is="truncate", rollout_is_threshold=2.0)
    metrics = grpo_backward(SAMPLES, run, torch.device("cpu"), forward, model.off)
    first, last = events.index("forward"), len(events) - 1 - events[::-1].index("forward")
    assert events[first : last + 1].count("forward") == 2 * len(SAMPLES)  # the policy's and the reference's
    assert "read" not in events[first:last], events[first:last]
    assert "read" in events[last:]  # the metrics, once the batch is done
    assert all(math.isfinite(metrics[k]) for k in ("train/loss", "train/kl", "mismatch/kl_k3", "train/entropy"))


def _of_length(n: int) -> Sample:
    return Sample(prompt_ids=[1], completion_ids=[2] * (n - 1), engine_logprobs=[-1.0] * (n - 1), advantage=0.0)


def test_a_split_batch_gives_every_rank_as_many_micro_batches_and_the_whole_batchs_denominator() -> None:
    samples = [_of_length(n) for n in (3, 4, 5, 6, 7)]  # in the trainer's padded order, by length
    packed = RunConfig(model="toy", micro_batch=2)
    shards = [grpo.split_batch(samples, packed, 2, rank, group=None) for rank in (0, 1)]
    lengths = [[[len(s.prompt_ids) + len(s.completion_ids) for s in c] for c in shard.chunks] for shard in shards]
    # rank 1's two samples make one micro-batch of 2, re-cut into two so that every forward has a partner
    assert lengths == [[[3, 5], [7]], [[4], [6]]]
    assert shards[0].forward_tokens == shards[1].forward_tokens == [[8, 4], [7, 6]]  # packed: the lengths summed
    assert shards[0].n_tokens == shards[1].n_tokens == sum(n - 1 for n in (3, 4, 5, 6, 7))
    padded = RunConfig(model="toy", micro_batch=2, pack_sequences=False)
    assert grpo.split_batch(samples, padded, 2, 0, None).forward_tokens == [[2 * 4, 1 * 3], [1 * 6, 1 * 5]]
    with pytest.raises(ValueError, match="a batch of 1 samples does not split over 2 ranks"):
        grpo.split_batch(samples[:1], packed, 2, 0, None)
    with pytest.raises(ValueError, match="does not split into 2 micro-batches on each of 2 ranks"):
        grpo.split_batch(samples[:3], RunConfig(model="toy", micro_batch=1), 2, 0, None)
