"""Two changes to the HF + PEFT model that keep its math and drop launches and copies the profile showed
(trainer-profile, H200, 2026-11-24): adapter inputs stay in the activations' dtype, and transformers' RMSNorms
run through torch's fused kernel."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


def keep_adapter_inputs(model: nn.Module) -> int:
    """Stop PEFT casting each adapter's input to the adapter's fp32 weight dtype; returns the layers changed.

    Under autocast the matmul casts that fp32 copy straight back to bf16, so the two full-size copies per adapter
    and pass change nothing but the time: they were HF's largest GPU cost. PEFT's own switch
    (peft.helpers.disable_input_dtype_casting), set once instead of around every forward."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.cast_input_dtype_enabled = False
    return len(layers)


def _fused_rms_norm(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # autocast would run rms_norm in fp32 (its fp32 list) and hand an fp32 copy to the next matmul
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


def fuse_rms_norms(model: nn.Module) -> int:
    """Run every transformers RMSNorm (Llama/Qwen layout: `weight`, `variance_epsilon`) through torch.rms_norm;
    returns how many. transformers' forward takes five kernels and two casts a norm, both ways; torch's is one
    kernel on CUDA. The result differs by rounding only: torch multiplies by the weight before its one rounding to
    bf16, transformers after rounding the normalised input (in fp32 they agree to fp32 precision)."""
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")
             and isinstance(getattr(m, "weight", None), nn.Parameter) and hasattr(m, "variance_epsilon")]
    for m in norms:
        m.forward = types.MethodType(_fused_rms_norm, m)
    return len(norms)
