"""Packed micro-batches: the layout, attention that keeps sequences apart, and the same logprobs and gradients
as padded rows in the HF trainer (the Megatron trainer's packed path is in test_megatron_parity)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridrl.study.run_config import RunConfig
from hybridrl.tools import trainer_bench
from hybridrl.trainers.base import Sample
from hybridrl.trainers.grpo import grpo_backward, micro_batches, pad_batch
from hybridrl.trainers.packing import kernel_runs, pack, varlen_causal_attention


def _samples(n: int, vocab: int = 64, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(1, 9), rng.randint(1, 12)
        out.append(Sample(prompt_ids=[rng.randrange(2, vocab) for _ in range(p)],
                          completion_ids=[rng.randrange(2, vocab) for _ in range(c)],
                          engine_logprobs=[-3.0] * c, advantage=rng.gauss(0, 1)))
    return out


def test_pack_lays_samples_back_to_back_and_unpacks_to_the_padded_layout() -> None:
    samples = _samples(4)
    p, b = pack(samples), pad_batch(samples)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    assert p.ids.shape == (1, sum(lengths)) and p.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0)]
    assert p.cu_seqlens.dtype == torch.int32 and p.max_len == max(lengths)
    # positions restart at 0 in every sequence (RoPE)
    assert p.positions[0].tolist() == [i for n in lengths for i in range(n)]
    # the packed row's targets, unpacked, are the padded rows' targets wherever a row is real
    unpacked = p.unpack(p.targets.float())
    real = b.attention[:, 1:].bool()
    assert unpacked.shape == b.targets.shape
    assert torch.equal(unpacked[real], b.targets[real].float()) and not unpacked[~real].any()
    # the completion mask picks out exactly each sample's completion
    for row, s in enumerate(samples):
        assert unpacked[row][b.mask[row]].long().tolist() == s.completion_ids


def test_varlen_attention_equals_padded_sdpa_and_keeps_sequences_apart() -> None:
    torch.manual_seed(0)
    lengths = [3, 7, 1, 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lengths), 4, 8)
    k, v = torch.randn(sum(lengths), 2, 8), torch.randn(sum(lengths), 2, 8)  # grouped-query: 2 KV heads
    assert not kernel_runs(q)  # CPU fp32: the SDPA loop
    out = varlen_causal_attention(q, k, v, cu, max(lengths), scale=0.3)
    for j, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        qs = q[lo:hi].transpose(0, 1)[None]
        ks, vs = (t[lo:hi].repeat_interleave(2, dim=1).transpose(0, 1)[None] for t in (k, v))
        want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.3)[0].transpose(0, 1)
        torch.testing.assert_close(out[lo:hi], want, msg=f"sequence {j}")
    # changing the second sequence leaves the others untouched: nothing attends across a boundary
    # (new random keys: adding one vector to every key of a sequence shifts its scores alike and changes nothing)
    k2 = k.clone()
    k2[3:10] = torch.randn(7, 2, 8)
    out2 = varlen_causal_attention(q, k2, v, cu, max(lengths), scale=0.3)
    torch.testing.assert_close(out2[:3], out[:3])
    torch.testing.assert_close(out2[10:], out[10:])
    assert not torch.allclose(out2[3:10], out[3:10])


def test_packed_micro_batches_count_real_tokens_padded_ones_rows_times_longest() -> None:
    def s(n: int) -> Sample:
        return Sample(prompt_ids=[1], completion_ids=[1] * (n - 1), engine_logprobs=[0.0] * (n - 1), advantage=0.0)

    batch = [s(2), s(6), s(3)]
    sizes = {pack: [[len(x.prompt_ids) + len(x.completion_ids) for x in mb] for mb in micro_batches(
        batch, RunConfig(model="m", micro_batch_tokens=12, pack_sequences=pack))] for pack in (True, False)}
    assert sizes[True] == [[2, 6, 3]]  # 11 real tokens fit in 12
    assert sizes[False] == [[2, 6], [3]]  # 3 rows x 6 = 18 padded tokens do not


@pytest.mark.parametrize("shape", ["tiny", "tiny-moe"])
def test_hf_trainer_packed_gives_the_padded_logprobs_loss_and_gradients(shape: str, tmp_path: Path) -> None:
    from hybridrl.trainers.hf import PACKED_ATTENTION, HFTrainer

    spec = trainer_bench.SHAPES[shape]
    model = trainer_bench.random_model(tmp_path / "model", spec, "float32")
    samples = _samples(6)
    got = {}
    for packed in (True, False):
        run = trainer_bench.bench_run(spec, "hf", "cpu", 4, None, pack=packed).model_copy(update={"kl_coef": 0.05})
        tr = HFTrainer(model, run, "cpu")
        assert (tr.model.config._attn_implementation == PACKED_ATTENTION) is packed
        tr.optimizer.zero_grad(set_to_none=True)
        metrics = grpo_backward(samples, run, tr.device, tr._logprobs, tr.model.disable_adapter)
        got[packed] = metrics, {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    (m_pack, g_pack), (m_pad, g_pad) = got[True], got[False]
    for key in ("train/loss", "train/kl", "train/entropy", "check/logprob_gap_token_max", "mismatch/kl_k3"):
        assert m_pack[key] == pytest.approx(m_pad[key], rel=1e-5, abs=1e-7), key
    assert set(g_pack) == set(g_pad) and g_pack
    for name, g in g_pad.items():
        assert float((g_pack[name] - g).norm() / g.norm().clamp(min=1e-12)) < 1e-4, name


def test_packed_attention_refuses_a_sliding_window_with_the_setting_to_change() -> None:
    from hybridrl.trainers.hf import packed_attention

    q = torch.randn(1, 2, 5, 4)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    out, _ = packed_attention(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=cu, max_length_q=3)
    assert out.shape == (1, 5, 2, 4)
    with pytest.raises(ValueError, match="set pack_sequences: false"):
        packed_attention(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=cu, max_length_q=3, sliding_window=4)
