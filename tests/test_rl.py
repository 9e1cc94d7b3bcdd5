import math

import pytest
import torch

from hybridrl.task.rl import group_advantages, policy_loss, token_logprobs, token_logprobs_entropy


def test_group_advantages_normalise_within_groups():
    adv = group_advantages([1, 0, 0, 1, 5, 5, 5, 5], group_size=4)
    assert adv[:4] == pytest.approx([1, -1, -1, 1], abs=1e-4)
    assert adv[4:] == [0, 0, 0, 0]  # equal rewards carry no signal
    assert sum(adv[:4]) == pytest.approx(0, abs=1e-9)


def test_group_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1, 0, 1], group_size=4)


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(0, 7, (2, 3))
    lp = token_logprobs(logits, targets)
    assert lp.shape == (2, 3)
    assert lp[1, 2] == pytest.approx(torch.log_softmax(logits[1, 2], -1)[targets[1, 2]].item(), abs=1e-6)


def test_policy_loss_on_policy_is_minus_mean_advantage():
    logp = torch.log(torch.full((2, 3), 0.5))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0])
    loss, stats = policy_loss(logp, logp.clone(), adv, mask)
    # token-level mean: 2 tokens with +1, 3 tokens with -2
    assert loss.item() == pytest.approx(-(2 * 1.0 + 3 * -2.0) / 5)
    assert stats["train/clipfrac"] == 0.0


def test_policy_loss_clips_the_ratio():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(2.0), math.log(0.5)]])  # ratios 2.0 and 0.5
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    # positive advantage: min(r*A, clip(r)*A) -> 1.2 for r=2 and 0.5 for r=0.5
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    assert stats["train/clipfrac"] == 1.0


def test_policy_loss_gradient_pushes_up_positive_advantage():
    logits = torch.zeros(1, 1, 4, requires_grad=True)
    target = torch.tensor([[2]])
    logp = token_logprobs(logits, target)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool))
    loss.backward()
    assert logits.grad[0, 0, 2] < 0  # descending the loss raises the chosen token's logit


def test_kl_term_is_zero_at_reference_and_positive_away():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, same = policy_loss(logp, logp, torch.tensor([0.0]), mask, ref_logp=logp, kl_coef=0.1)
    assert float(same["train/kl"]) == pytest.approx(0.0, abs=1e-9)
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    loss, away = policy_loss(logp, logp, torch.tensor([0.0]), mask, ref_logp=ref, kl_coef=0.1)
    assert away["train/kl"] > 0
    assert loss.item() == pytest.approx(0.1 * float(away["train/kl"]), rel=1e-5)


def _gaps(trainer: torch.Tensor, mask: torch.Tensor, engine_lists: list[list[float]], into=None):
    """LogprobGaps read over one micro-batch, the engine's logprobs laid out as the trainers lay them out."""
    from hybridrl.task.rl import LogprobGaps, engine_logprob_tensor

    gaps = LogprobGaps() if into is None else into
    gaps.add(trainer, *engine_logprob_tensor(engine_lists, mask))
    return gaps


def test_logprob_gaps_tell_whole_requests_from_stray_tokens():
    from hybridrl.task.rl import LogprobGaps

    trainer = torch.tensor([[-1.0, -2.0, -3.0, 0.0],    # 3 completion tokens, then padding
                            [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    # row 0: one stray token off by 0.3; row 1: every token off by 0.05 (as a stale adapter would be)
    gaps = _gaps(trainer, mask, [[-1.0, -2.3, -3.0], [-1.05, -1.05, -1.05, -1.05]])
    m = gaps.metrics(n_tokens=7)
    assert m["check/rollout_logprob_abs_diff"] == pytest.approx((0.3 + 4 * 0.05) / 7)
    assert m["check/logprob_gap_token_max"] == pytest.approx(0.3)
    assert m["check/logprob_gap_sample_max"] == pytest.approx(0.1)  # row 0: 0.3 over 3 tokens
    # the engine may return fewer logprobs than tokens (a cut stream): only those are compared
    short = _gaps(trainer[:1], mask[:1], [[-1.5]])
    assert short.metrics(3)["check/rollout_logprob_abs_diff"] == pytest.approx(0.5 / 3)
    assert short.metrics(3)["check/logprob_gap_sample_max"] == pytest.approx(0.5)
    assert math.isnan(LogprobGaps().metrics(0)["check/logprob_gap_token_max"])


def test_logprob_gaps_over_micro_batches_read_as_over_the_whole_batch():
    trainer = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-1.0, -1.0, -1.0, -1.0], [-2.0, -2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True], [True, True, False, False]])
    engine = [[-1.0, -2.3, -3.0], [-1.05, -1.05, -1.05, -1.05], []]  # the last row: no logprobs came back
    whole = _gaps(trainer, mask, engine).metrics(9)
    split = _gaps(trainer[2:], mask[2:], engine[2:], into=_gaps(trainer[:2], mask[:2], engine[:2])).metrics(9)
    assert split == pytest.approx(whole)
    assert whole["check/logprob_gap_token_max"] == pytest.approx(0.3)  # the worst token is in the first part
    assert whole["check/logprob_gap_sample_max"] == pytest.approx(0.1)
    # the row with no engine logprobs counts toward the mean's tokens but adds no gap and no weight
    assert whole["check/rollout_logprob_abs_diff"] == pytest.approx(0.5 / 9)
    assert whole["mismatch/is_weight_mean"] == pytest.approx((2 + math.exp(0.3) + 4 * math.exp(0.05)) / 7)


def test_mismatch_metrics_of_agreeing_and_disagreeing_policies():
    from hybridrl.task.rl import LogprobGaps

    mask = torch.tensor([[True, True, False]])
    same = _gaps(torch.tensor([[-1.0, -2.0, 0.0]]), mask, [[-1.0, -2.0]])
    m = same.metrics(2)
    assert (m["mismatch/kl_k3"], m["mismatch/is_weight_mean"], m["mismatch/ess"]) == pytest.approx((0.0, 1.0, 1.0))
    off = _gaps(torch.tensor([[-1.0, -2.0, 0.0]]), mask, [[-1.5, -1.0]])  # log ratios +0.5 and -1.0
    m = off.metrics(2)
    w = [math.exp(0.5), math.exp(-1.0)]
    assert m["mismatch/is_weight_mean"] == pytest.approx(sum(w) / 2)
    assert m["mismatch/kl_k3"] == pytest.approx(((w[0] - 1 - 0.5) + (w[1] - 1 + 1.0)) / 2)
    assert m["mismatch/ess"] == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)))
    assert 0 < m["mismatch/ess"] < 1 and m["mismatch/kl_k3"] > 0
    assert math.isnan(LogprobGaps().metrics(0)["mismatch/ess"])


def test_rollout_is_weights_truncate_or_mask_and_reweight_the_loss():
    from hybridrl.task.rl import engine_logprob_tensor, rollout_is_weights

    mask = torch.tensor([[True, True, True, False]])
    old = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    engine, present = engine_logprob_tensor([[-1.0, -3.0, -0.5]], mask)  # weights 1, e^2 (stale), e^-0.5
    assert engine.tolist() == [[-1.0, -3.0, -0.5, 0.0]] and present.tolist() == [[True, True, True, False]]
    truncated = rollout_is_weights(old, engine, mask, threshold=2.0, mode="truncate")
    assert truncated[0].tolist() == pytest.approx([1.0, 2.0, math.exp(-0.5), 0.0])
    masked = rollout_is_weights(old, engine, mask, threshold=2.0, mode="mask")
    assert masked[0].tolist() == pytest.approx([1.0, 0.0, math.exp(-0.5), 0.0])  # the stale token is dropped
    with pytest.raises(ValueError, match="truncate or mask"):
        rollout_is_weights(old, engine, mask, 2.0, "clip")
    # the weights scale each token's term: a token weighted 0 leaves no gradient
    logp = old.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), mask, is_weights=masked)
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] != 0


def _unchunked(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1, 4 * 11 * 3, 4 * 11 * 40, 1 << 28])  # one position, 3, 40, all rows
def test_chunked_token_logprobs_equal_the_unchunked_ones_and_their_gradients(dtype, chunk_bytes):
    torch.manual_seed(0)
    base = torch.randn(3, 6, 11) * 4
    targets = torch.randint(0, 11, (3, 5))
    grad_out = torch.randn(3, 5)
    results = []
    for fn in (_unchunked, lambda x, t: token_logprobs(x, t, chunk_bytes=chunk_bytes)):
        x = base.to(dtype).requires_grad_(True)
        lp = fn(x[:, :-1], targets)  # a non-contiguous slice, as the trainers pass it
        (lp * grad_out).sum().backward()
        results.append((lp.detach(), x.grad))
    (lp_ref, g_ref), (lp, g) = results
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-6 if dtype == torch.float32 else 0)


def test_token_logprobs_without_grad_need_no_autograd():
    logits = torch.randn(2, 4, 9)
    targets = torch.randint(0, 9, (2, 4))
    with torch.no_grad():
        lp = token_logprobs(logits, targets, chunk_bytes=4 * 9)
    torch.testing.assert_close(lp, _unchunked(logits, targets), rtol=0, atol=0)


@pytest.mark.parametrize("chunk_bytes", [1, 4 * 11 * 3, 1 << 28])
def test_entropy_comes_from_the_same_chunks_and_leaves_the_gradient_alone(chunk_bytes):
    torch.manual_seed(1)
    base = torch.randn(3, 6, 11) * 3
    targets = torch.randint(0, 11, (3, 5))
    want = torch.distributions.Categorical(logits=base[:, :-1]).entropy()
    x = base.clone().requires_grad_(True)
    lp, ent = token_logprobs_entropy(x[:, :-1], targets, chunk_bytes=chunk_bytes)
    torch.testing.assert_close(ent, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp, token_logprobs(base[:, :-1], targets, chunk_bytes=chunk_bytes), rtol=0, atol=0)
    assert not ent.requires_grad
    lp.sum().backward()
    y = base.clone().requires_grad_(True)
    token_logprobs(y[:, :-1], targets, chunk_bytes=chunk_bytes).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)
    # a peaked row has near-zero entropy, a flat one log V
    flat_peak = torch.stack([torch.zeros(11), torch.eye(11)[3] * 50]).unsqueeze(0)
    with torch.no_grad():
        _, e = token_logprobs_entropy(flat_peak, torch.zeros(1, 2, dtype=torch.long), chunk_bytes=chunk_bytes)
    assert e[0, 0] == pytest.approx(math.log(11), rel=1e-6) and e[0, 1] < 1e-6
