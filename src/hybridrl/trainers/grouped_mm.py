"""torch's grouped matmul (one GEMM over many experts' tokens): which function, and whether it runs here.

Shared by the Megatron trainer's GroupedExperts and the HF trainer's choice of transformers'
experts_implementation; no megatron import, so the HF trainer can use it alone."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


def grouped_mm_fn() -> Any:
    """torch's public grouped matmul (torch >= 2.10), else the private one (2.8, 2.9), else None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def kernel_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether grouped_mm runs forward and backward here, tried once on a tiny aligned problem.

    Its support moves between torch releases (no CPU kernel before 2.9, bf16 only on some CUDA builds),
    so asking the kernel is more reliable than a version table. CUDA: the current device."""
    fn = grouped_mm_fn()
    if fn is None:
        return False
    try:
        # grad on even when the first forward runs under no_grad or inference_mode (a no-grad logprob pass)
        with torch.inference_mode(False), torch.enable_grad():
            return _try_kernel(fn, torch.device(device_type), dtype)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _try_kernel(fn: Any, dev: torch.device, dtype: torch.dtype) -> bool:
    # fixed values, not torch.randn: probing must not move the seeded RNG the training draws from
    x = torch.linspace(-1, 1, 8 * 16, device=dev).reshape(8, 16).to(dtype).requires_grad_(True)
    w = torch.linspace(-1, 1, 2 * 16 * 16, device=dev).reshape(2, 16, 16).to(dtype).requires_grad_(True)
    offs = torch.tensor([3, 8], device=dev, dtype=torch.int32)
    y = fn(x, w, offs=offs)
    y.backward(torch.ones_like(y))
    ref = torch.cat([x[:3] @ w[0], x[3:] @ w[1]])
    return bool(torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2))
