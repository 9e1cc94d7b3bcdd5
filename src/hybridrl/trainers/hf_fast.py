"""Changes to the HF + PEFT model that keep its math and drop launches and copies the profiles showed
(trainer-profile on an H200): adapter inputs stay in the activations' dtype, each adapter's output is added
inside its last matmul, and transformers' RMSNorms run through torch's fused kernel."""

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


def _lora_forward_fused(self: nn.Module, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    # the states PEFT's forward handles and this does not: adapters off (the KL reference), merged, several
    active = self.active_adapters
    if args or kwargs or self.disable_adapters or self.merged or len(active) != 1 or active[0] not in self.lora_A:
        return type(self).forward(self, x, *args, **kwargs)
    name = active[0]
    base = self.base_layer
    result = F.linear(x, base.weight, base.bias)
    down = F.linear(x, self.lora_A[name].weight) * self.scaling[name]  # scaled at rank width, not the output's
    out = torch.addmm(result.reshape(-1, result.shape[-1]), down.reshape(-1, down.shape[-1]),
                      self.lora_B[name].weight.t())
    return out.view(result.shape)


def fuse_lora_outputs(model: nn.Module) -> int:
    """Add each plain LoRA linear's output inside its B matmul (addmm) and scale the rank-wide activation;
    returns the layers changed. PEFT computes `result + B(A(x)) * scaling`: a multiply and an add over the full
    output, both ways, for every adapted linear. The sum is the same up to rounding (one bf16 rounding fewer).
    The three weights are used directly rather than through their modules' calls: the dense update is bound by the
    host's launches, and addmm's autocast path costs more host time than mm (a CPU microbenchmark: with module
    calls the fused layer took 4% more host time than PEFT's, without them the same). Layers with dropout, a bias on
    B, a variant (DoRA) or a base other than a plain nn.Linear keep PEFT's forward."""
    from peft.tuners.lora import Linear as LoraLinear

    changed = 0
    for m in model.modules():
        if type(m) is not LoraLinear or m.lora_variant or type(m.base_layer) is not nn.Linear:
            continue
        if any(not isinstance(d, nn.Identity) for d in m.lora_dropout.values()):
            continue
        if any(b.bias is not None for b in m.lora_B.values()):
            continue
        m.forward = types.MethodType(_lora_forward_fused, m)
        changed += 1
    return changed


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
