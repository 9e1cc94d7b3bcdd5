"""Packed sequences: a micro-batch's samples back to back in one row, so no layer computes padding.

Attention keeps the sequences apart through their boundaries (cu_seqlens) and RoPE restarts in each (positions).
Logprobs come back in the padded layout the loss reads ([B, T-1], grpo.Batch), so only the forward changes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridrl.trainers.base import Sample


@dataclass
class Packed:
    """ids and positions [1, N] of the samples back to back; cu_seqlens [B+1] (int32) their boundaries; flat,
    rows and cols map target position `flat` of the packed row to (row, col) of the padded [B, width] layout."""

    ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    flat: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    width: int

    @property
    def targets(self) -> torch.Tensor:
        """ids[:, 1:]: position t of the row predicts token t+1 (across a boundary the target is masked out)."""
        return self.ids[:, 1:]

    def to(self, device: torch.device | str) -> Packed:
        return Packed(self.ids.to(device), self.positions.to(device), self.cu_seqlens.to(device), self.max_len,
                      self.flat.to(device), self.rows.to(device), self.cols.to(device), self.width)

    def unpack(self, logp: torch.Tensor) -> torch.Tensor:
        """[1, N-1] per-target values of the packed row -> [B, width], zeros where a row is padding."""
        b = self.cu_seqlens.numel() - 1
        out = logp.new_zeros((b, self.width))
        return out.index_put((self.rows, self.cols), logp[0, self.flat])


def pack(samples: list[Sample]) -> Packed:
    """The samples' prompt + completion ids back to back, in the order given."""
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    lengths = [len(x) for x in seqs]
    ids = torch.tensor([t for x in seqs for t in x], dtype=torch.long).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    # sample j's targets 0..len-2 sit at packed positions start_j .. start_j + len - 2
    flat = torch.cat([torch.arange(int(cu[j]), int(cu[j]) + n - 1) for j, n in enumerate(lengths)])
    rows = torch.cat([torch.full((n - 1,), j) for j, n in enumerate(lengths)])
    cols = torch.cat([torch.arange(n - 1) for n in lengths])
    return Packed(ids, positions, cu, max(lengths), flat, rows, cols, max(lengths) - 1)


def _kernel() -> tuple[object, dict[str, object], bool] | None:
    """torch's flash varlen attention, its causal argument (changed between torch 2.10 and 2.11) and whether it
    takes `scale`; None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "scale" in params


_VARLEN = _kernel()


def kernel_runs(q: torch.Tensor) -> bool:
    """Whether varlen_causal_attention takes torch's flash kernel for q (CUDA, 16-bit); else a loop of SDPA."""
    return _VARLEN is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence; q [N, H, D], k and v [N, Hkv, D] -> [N, H, D].

    On a CUDA GPU in bf16/fp16, one flash varlen kernel; elsewhere (CPU, fp32 parity runs) SDPA sequence by
    sequence, which computes the same thing with no padding either."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each KV head serves heads/groups query heads
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if kernel_runs(q):
        fn, causal, takes_scale = _VARLEN  # type: ignore[misc]
        if scale is not None and takes_scale:
            causal = {**causal, "scale": scale}
        elif scale is not None:  # a kernel without `scale` uses 1/sqrt(D): fold the difference into q
            q = q * (scale * q.shape[-1] ** 0.5)
        return fn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **causal)  # type: ignore[operator]
    bounds = cu_seqlens.tolist()
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (t[lo:hi].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, L, D]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[0].transpose(0, 1))
    return torch.cat(outs, dim=0)
