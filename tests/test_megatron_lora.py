"""The Megatron trainer's LoRA adapter computes in the activations' dtype and keeps fp32 weights, as PEFT does under
autocast: bf16 activations stay bf16 (no fp32 copy of each input), and the gradients reach the fp32 weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/setup-megatron-cpu.sh)")

from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from hybridrl.trainers.megatron.lora import LoraAdapter, _lora_config  # noqa: E402


@pytest.mark.parametrize("kind", ["column", "row"])
def test_adapter_computes_in_the_input_dtype_on_fp32_weights(groups: Any, kind: str) -> None:
    cfg = _lora_config(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                         params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True))
    torch.manual_seed(0)
    lora = LoraAdapter(kind, 32, 24, rank=4, alpha=8.0, config=cfg)
    with torch.no_grad():
        for p in lora.parameters():
            p.normal_(0, 0.2)
    assert {p.dtype for p in lora.parameters()} == {torch.float32}
    x = torch.randn(5, 2, 32)
    want = (x @ lora.A.weight.T @ lora.B.weight.T) * 2.0  # fp32 reference, alpha / rank = 2
    xb = x.bfloat16().requires_grad_()
    y = lora(xb)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert xb.grad is not None and xb.grad.dtype == torch.bfloat16
    for p in lora.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0
    # fp32 input: the fp32 path, exactly the reference
    torch.testing.assert_close(lora(x), want, rtol=1e-5, atol=1e-5)
