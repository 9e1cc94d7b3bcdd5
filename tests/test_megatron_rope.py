"""The Megatron trainer's RoPE application: megatron's math with cos and sin made once per forward, and megatron's
own function for every case it does not cover."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/setup-megatron-cpu.sh)")

from megatron.core.models.common.embeddings import rope_utils  # noqa: E402
from megatron.core.transformer import attention  # noqa: E402

from hybridrl.trainers.megatron import rope  # noqa: E402

PLAIN = SimpleNamespace(rotary_interleaved=False, apply_rope_fusion=False)
ONE_RANK = SimpleNamespace(size=lambda: 1)  # no context parallelism


def _freqs(n: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    f = torch.outer(torch.arange(n).float(), inv)
    emb = torch.cat((f, f), dim=-1)[:, None, None, :]
    emb.rope_tables = {}  # as HFRotaryEmbedding.forward hands it out
    return emb


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_apply_rope_is_megatrons_rope(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    t = torch.randn(7, 1, 4, 16, dtype=dtype, requires_grad=True)
    freqs = _freqs(7, 16)
    want = rope_utils.apply_rotary_pos_emb(t, freqs, config=PLAIN, cp_group=ONE_RANK)
    got = rope.apply_rope(t, freqs, config=PLAIN, cp_group=ONE_RANK)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    g = torch.randn_like(got)
    (grad_got,) = torch.autograd.grad(got, t, g)
    (grad_want,) = torch.autograd.grad(want, t, g)
    torch.testing.assert_close(grad_got.float(), grad_want.float(), rtol=tol, atol=tol)
    # the tables are made once for the forward's tensor and reused by every later layer
    assert list(freqs.rope_tables) == [dtype]
    cos = freqs.rope_tables[dtype][0]
    rope.apply_rope(t, freqs, config=PLAIN)
    assert freqs.rope_tables[dtype][0] is cos


def test_cases_it_does_not_cover_go_to_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def megatron_apply(t: torch.Tensor, freqs: torch.Tensor, **kw: object) -> torch.Tensor:
        calls.append(kw)
        return t

    monkeypatch.setattr(rope, "_MEGATRON_APPLY", megatron_apply)
    t, freqs = torch.randn(5, 1, 2, 8), _freqs(5, 8)
    rope.apply_rope(t, freqs, config=PLAIN, mscale=1.5)  # yarn's attention scaling
    rope.apply_rope(t, freqs, config=SimpleNamespace(rotary_interleaved=True))
    rope.apply_rope(t, _freqs(5, 4), config=PLAIN)  # rotary on part of the head
    rope.apply_rope(t, freqs, config=PLAIN, cu_seqlens=torch.tensor([0, 5]))  # megatron's 'thd' rows
    bare = torch.cat((freqs, freqs), dim=0)[:5]  # a tensor without the forward's tables
    rope.apply_rope(t, bare, config=PLAIN)
    assert len(calls) == 5
    rope.apply_rope(t, freqs, config=PLAIN)
    assert len(calls) == 5


def test_install_points_megatrons_attention_at_it() -> None:
    rope.install()
    assert attention.apply_rotary_pos_emb is rope.apply_rope
