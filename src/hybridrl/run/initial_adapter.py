"""A drawn first adapter (lora.init_b_std > 0), written as PEFT writes one, that trainer and engine both start from.

With B = 0 (PEFT's default) the adapter is the identity until a gradient moves it. A random-init model's rewards
are all the same almost every step, so its GRPO gradient is zero and its adapter can stay the identity for a whole
run: no engine can then show that it applied it, and the adapter gate judges nothing. Drawing B as well makes the
adapter change the model from step 1. A is drawn as PEFT draws it (kaiming uniform, a = sqrt(5)).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from hybridrl.study.run_config import RunConfig
from hybridrl.trainers.adapter_files import WEIGHTS_FILE, peft_config_json, write_adapter_dir
from hybridrl.trainers.megatron.mapping import peft_key, projection_dims
from hybridrl.trainers.megatron.spec import ArchSpec, effective_targets, read_spec


def draw(spec: ArchSpec, run: RunConfig, targets: list[str]) -> dict[str, torch.Tensor]:
    """Every adapter tensor by PEFT name, float32, from run.seed (targets: effective_targets', attention alone on an
    MoE model, so no layer's MLP is left out)."""
    gen = torch.Generator().manual_seed(run.seed * 1_000_003 + 17)
    out: dict[str, torch.Tensor] = {}
    for layer in range(spec.num_layers):
        for proj in targets:
            fin, fout = projection_dims(spec, proj)
            bound = 1.0 / math.sqrt(fin)
            out[peft_key(layer, proj, "A")] = (torch.rand(run.lora.rank, fin, generator=gen) * 2 - 1) * bound
            out[peft_key(layer, proj, "B")] = torch.randn(fout, run.lora.rank, generator=gen) * run.lora.init_b_std
    return out


def write_initial_adapter(run: RunConfig, model_dir: Path, out_dir: Path) -> Path | None:
    """out_dir holding the drawn adapter (written once; a resumed run finds it), or None where init_b_std is 0."""
    if run.lora.init_b_std == 0:
        return None
    if (out_dir / WEIGHTS_FILE).exists():  # written whole or not at all (write_adapter_dir)
        return out_dir
    from peft import LoraConfig

    spec = read_spec(model_dir)
    targets = sorted(effective_targets(spec, run.lora.target_modules))
    config = LoraConfig(r=run.lora.rank, lora_alpha=run.lora.alpha, lora_dropout=0.0, target_modules=targets,
                        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(model_dir))
    write_adapter_dir(out_dir, draw(spec, run, targets), peft_config_json(config))
    return out_dir
