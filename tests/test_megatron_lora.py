"""The Megatron trainer's LoRA sites compute in the activations' dtype and keep fp32 weights, as PEFT does under
autocast: bf16 activations stay bf16 (no fp32 copy of each input), and the gradients reach the fp32 weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/setup-megatron-cpu.sh)")

from hybridrl.trainers.megatron.lora import LoraAdapter, LoraSite  # noqa: E402


@pytest.mark.parametrize("kind", ["column", "row"])
def test_site_computes_in_the_input_dtype_on_fp32_weights(groups: Any, kind: str) -> None:
    torch.manual_seed(0)
    lora = LoraAdapter(kind, 32, 24, rank=4, alpha=8.0, tp=1)
    with torch.no_grad():
        for p in lora.parameters():
            p.normal_(0, 0.2)
    site = LoraSite(kind, {"o_proj": lora}, {"o_proj": 24}, rank=4)
    assert {p.dtype for p in lora.parameters()} == {torch.float32}
    x, base = torch.randn(5, 2, 32), torch.randn(5, 2, 24)
    want = base + (x @ lora.A.weight.T @ lora.B.weight.T) * 2.0  # fp32 reference, alpha / rank = 2
    xb = x.bfloat16().requires_grad_()
    y = site.add_to(xb, base.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == base.shape
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=3e-2)
    y.float().sum().backward()
    assert xb.grad is not None and xb.grad.dtype == torch.bfloat16
    for p in lora.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0
    # fp32 input: the fp32 path, exactly the reference
    torch.testing.assert_close(site.add_to(x, base), want, rtol=1e-5, atol=1e-5)


def test_bf16_model_keeps_every_base_weight_bf16(groups: Any, tmp_path: Any) -> None:
    """Norms included: megatron's torch-norm fallback makes them fp32, which sends torch.rms_norm off its fused
    kernel beside bf16 activations; only the adapters stay fp32."""
    from hybridrl.tools.megatron_parity import tiny_checkpoint
    from hybridrl.trainers.megatron.lora import apply_lora
    from hybridrl.trainers.megatron.model import build_model
    from hybridrl.trainers.megatron.spec import read_spec

    spec = read_spec(tiny_checkpoint("qwen3", tmp_path / "model"))
    model = build_model(spec, 1, torch.bfloat16)
    apply_lora(model, spec, rank=4, alpha=8.0, targets=["q_proj", "o_proj"])
    dtypes = {(".lora." in n, p.dtype) for n, p in model.named_parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}, dtypes
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 2 * spec.num_layers * 2 + 1  # input, pre-MLP, q and k per layer, the final one
