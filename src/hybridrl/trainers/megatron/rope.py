"""Rotary position embedding for the Megatron trainer: HF's inverse frequencies, per-token positions for packed
rows, and an application that makes cos and sin once per forward.

megatron's own application recomputes cos and sin of the frequencies, casts them and concatenates an empty
pass-through part, for q and for k in every layer: about twelve kernels each way where four do the same math.
An update is bound by the host's launches, so `apply_rope` stands in for megatron's `apply_rotary_pos_emb` in
its attention module (install()), and hands every case it does not cover back to megatron's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer import attention

from hybridrl.trainers.megatron.spec import ArchSpec

_MEGATRON_APPLY = rope_utils.apply_rotary_pos_emb


class HFRotaryEmbedding(RotaryEmbedding):
    """Megatron's RoPE with HF's inverse frequencies and no CUDA assumption.

    The upstream class moves inv_freq to the current CUDA device on first use and caches its output with
    lru_cache; both break on CPU and across offload/onload. This one follows the device of the input.
    """

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        emb = torch.cat((freqs, freqs), dim=-1)  # HF rotate_half layout (not interleaved)
        return emb[:, None, None, :]

    def get_rotary_seq_len(self, inference_context: Any, transformer: Any, transformer_input: Any,
                           transformer_config: Any, packed_seq_params: Any = None, **kw: Any) -> int:
        # GPTModel asks this just before forward(): a packed row's per-token positions are kept for it
        self._positions = getattr(packed_seq_params, "positions", None)
        return super().get_rotary_seq_len(inference_context, transformer, transformer_input, transformer_config,
                                          packed_seq_params, **kw)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: Any = None) -> torch.Tensor:
        emb = self.get_emb(max_seq_len, offset)
        positions, self._positions = getattr(self, "_positions", None), None
        emb = emb if positions is None else emb[positions]  # [N, 1, 1, dim]: RoPE restarts in each sequence
        emb.rope_tables = {}  # type: ignore[attr-defined]  # apply_rope's cos/sin, made once per forward
        return emb


def hf_inv_freq(spec: ArchSpec) -> torch.Tensor:
    """Inverse RoPE frequencies exactly as transformers computes them for this rope type."""
    theta = float(spec.rope["rope_theta"])
    dim = spec.head_dim
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    kind = spec.rope["rope_type"]
    if kind == "linear":
        inv = inv / float(spec.rope["factor"])
    elif kind == "llama3":
        factor = float(spec.rope["factor"])
        low, high = float(spec.rope["low_freq_factor"]), float(spec.rope["high_freq_factor"])
        old_len = float(spec.rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def _tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin of the frequencies in dtype, made once per forward (HFRotaryEmbedding's tensor
    carries them): rotate_half(t) * sin == roll(t, half) * [-sin_a, sin_b]."""
    tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = freqs.rope_tables  # type: ignore[attr-defined]
    if dtype not in tables:
        half = freqs.shape[-1] // 2
        sin = freqs.sin()
        tables[dtype] = (freqs.cos().to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype))
    return tables[dtype]


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, config: Any = None, cu_seqlens: torch.Tensor | None = None,
               mscale: float = 1.0, cp_group: Any = None, **kw: Any) -> torch.Tensor:
    """t * cos + rotate_half(t) * sin for t [s, b, heads, dim], as megatron's non-interleaved, full-dim RoPE;
    anything else (megatron's 'thd' rows, interleaving, partial rotary, yarn's mscale, context parallelism)
    goes to megatron's own function."""
    plain = (getattr(freqs, "rope_tables", None) is not None and cu_seqlens is None and mscale == 1.0
             and not getattr(config, "rotary_interleaved", False) and freqs.shape[-1] == t.shape[-1]
             and (cp_group is None or cp_group.size() == 1))
    if not plain:
        return _MEGATRON_APPLY(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group,
                               **kw)
    cos, sin = _tables(freqs, t.dtype)
    return torch.addcmul(t * cos, t.roll(t.shape[-1] // 2, dims=-1), sin)


def install() -> None:
    """Point megatron's attention module at apply_rope (idempotent; the function falls back on its own)."""
    attention.apply_rotary_pos_emb = apply_rope
