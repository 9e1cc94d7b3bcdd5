"""The HF trainer's speed changes keep its math: adapters take the activations' dtype, as the matmul under autocast
does anyway (PEFT's cast of each input to the fp32 adapter weights is switched off, with the same result), and
transformers' RMSNorms run through torch.rms_norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn

from hybridrl.trainers.hf_fast import fuse_lora_outputs, fuse_rms_norms, keep_adapter_inputs


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(16, 16, bias=False)
        self.o_proj = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.relu(self.q_proj(x)))


def _model(dtype: torch.dtype = torch.bfloat16, **lora: object) -> nn.Module:
    torch.manual_seed(0)
    model = get_peft_model(_Block().to(dtype), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                                          init_lora_weights=False, **lora))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # as HFTrainer: fp32 adapters on a bf16 base
    return model


def _run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, set[torch.dtype]]:
    seen: set[torch.dtype] = set()
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.add(args[0].dtype))
             for name, m in model.named_modules() if name.endswith("lora_A.default")]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
    finally:
        for h in hooks:
            h.remove()
    return y, seen


def test_adapters_take_bf16_inputs_and_give_the_same_output() -> None:
    x = torch.randn(3, 16).bfloat16()
    model = _model()
    want, seen_before = _run(model, x)
    assert seen_before == {torch.float32}  # PEFT's default: an fp32 copy of every adapter input
    assert keep_adapter_inputs(model) == 2
    got, seen_after = _run(model, x)
    assert seen_after == {torch.bfloat16}
    assert torch.equal(got, want)  # autocast cast the fp32 copy back to bf16: bf16 -> fp32 -> bf16 is exact




def test_fused_norms_are_transformers_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # not the init's ones, so the weight's place in the math shows
    ids = torch.randint(0, 64, (2, 7))
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    x = torch.randn(2, 7, 32)
    final = model.model.norm
    want_norm, want = final(x), model(ids).logits
    assert fuse_rms_norms(model) == len(norms) == 2 * 4 + 1  # input, post-attention, q, k per layer; final
    torch.testing.assert_close(final(x), want_norm, rtol=1e-6, atol=1e-6)
    calls = []
    monkeypatch.setattr(F, "rms_norm", lambda *a, **k: calls.append(1) or torch.rms_norm(*a, **k))
    torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    assert len(calls) == len(norms)  # every norm ran through torch's rms_norm
    # bf16 under autocast: a bf16 result (not autocast's fp32 one) within a bf16 rounding of transformers'
    xb = x.bfloat16()
    norm_b = final.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = norm_b(xb)
    assert got.dtype == torch.bfloat16
    ref = norm_b.weight.float() * (x.bfloat16().float() * torch.rsqrt(x.bfloat16().float().pow(2).mean(-1, keepdim=True)
                                                                       + norm_b.variance_epsilon))
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2)


def _forward_backward(model: nn.Module, x: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = [x.grad] + [p.grad for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return y.detach(), grads


@pytest.mark.parametrize("dtype,autocast,tol", [(torch.float32, False, 1e-6), (torch.bfloat16, True, 2e-2)])
def test_fused_lora_outputs_are_peft_outputs(dtype: torch.dtype, autocast: bool, tol: float) -> None:
    x = torch.randn(2, 5, 16).to(dtype)
    model = _model(dtype)
    keep_adapter_inputs(model)
    want, want_grads = _forward_backward(model, x, autocast)
    assert fuse_lora_outputs(model) == 2
    calls = []
    real_addmm = torch.addmm
    try:
        torch.addmm = lambda *a, **k: calls.append(1) or real_addmm(*a, **k)
        got, got_grads = _forward_backward(model, x, autocast)
    finally:
        torch.addmm = real_addmm
    assert len(calls) == 2  # both adapters took the fused path
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for g, w in zip(got_grads, want_grads, strict=True):  # the input's and every adapter weight's gradient
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def test_fused_lora_falls_back_where_peft_does_more() -> None:
    x = torch.randn(3, 16)
    model = _model(torch.float32)
    assert fuse_lora_outputs(model) == 2
    base = _Block()
    base.load_state_dict({k.replace("base_model.model.", "").replace(".base_layer", ""): v
                          for k, v in model.state_dict().items() if "lora_" not in k})
    with model.disable_adapter():  # the KL reference: the base model alone
        torch.testing.assert_close(model(x), base(x))
    assert not torch.allclose(model(x), base(x))  # and the adapters are back after it
    assert fuse_lora_outputs(_model(torch.float32, lora_dropout=0.1)) == 0  # dropout keeps PEFT's forward
