"""The HF trainer's adapters take the activations' dtype, as the matmul under autocast does anyway: PEFT's cast of
each input to the fp32 adapter weights (two full-size copies per adapter and pass) is switched off, with the same
result."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from hybridrl.trainers.hf import keep_adapter_inputs


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(16, 16, bias=False)
        self.o_proj = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.relu(self.q_proj(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = get_peft_model(_Block().bfloat16(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                                           init_lora_weights=False))
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


