"""Adapters and their AdamW state to and from a standard PEFT directory, across TP shards.

Gathering: A is concatenated on dim 0 for column-parallel sites (q, k, v, gate, up) and on dim 1 for
row-parallel ones (o, down); B always on dim 0. Adapters are kept per HF projection, so nothing fused has to
be split on the way out. optimizer.pt holds AdamW moments under the same PEFT names, so a run can resume at
another TP size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import load_file

from hybridrl.trainers.adapter_files import OPTIMIZER_FILE, HostStaging, peft_config_json, to_host
from hybridrl.trainers.megatron.lora import LoraAdapter
from hybridrl.trainers.megatron.mapping import lora_a_split_dim, peft_key, shard

OPTIMIZER_FORMAT = "hybridrl-megatron-lora-adamw/1"
Adapters = dict[tuple[int, str], LoraAdapter]


def _entries(adapters: Adapters) -> list[tuple[str, torch.nn.Parameter, int]]:
    """(PEFT name, local parameter, TP split dim) in a fixed order."""
    out = []
    for (layer, proj), ad in sorted(adapters.items()):
        out.append((peft_key(layer, proj, "A"), ad.A.weight, lora_a_split_dim(proj)))
        out.append((peft_key(layer, proj, "B"), ad.B.weight, 0))
    return out


def named_params(adapters: Adapters) -> list[tuple[str, torch.nn.Parameter]]:
    """(PEFT name, this rank's parameter) of every adapter tensor."""
    return [(name, p) for name, p, _ in _entries(adapters)]


def gather_full(adapters: Adapters, local: dict[str, torch.Tensor] | None = None,
                own_storage: bool = True, staging: HostStaging | None = None,
                slot: str = "weights") -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors by PEFT name, on the CPU of every rank; one collective and one copy to the host
    a rank for all of them (a 48-layer model has hundreds of adapter tensors: a copy each waited for the GPU as
    often).

    `local` gives per-name local tensors to gather instead of the weights (gradients, optimizer moments).
    own_storage=False lets them be views of the one host copy where there is one shard (TP 1), which torch.save
    writes as one record instead of one a tensor (adapter_files.to_host); safetensors needs each tensor to own its
    storage. staging, slot: the host buffer the copy goes to at TP 1 (adapter_files.HostStaging).
    """
    entries = _entries(adapters)
    tensors = [(local[name] if local is not None else p).detach().float() for name, p, _ in entries]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return to_host({name: t for (name, _, _), t in zip(entries, tensors, strict=True)}, own_storage, staging, slot)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    parts = [torch.empty_like(flat) for _ in range(tp)]
    dist.all_gather(parts, flat, group=parallel_state.get_tensor_model_parallel_group())
    parts = [p.cpu() for p in parts]
    out, offset = {}, 0
    for (name, _, dim), t in zip(entries, tensors, strict=True):
        n = t.numel()
        out[name] = torch.cat([p[offset: offset + n].view(t.shape) for p in parts], dim=dim)
        offset += n
    return out


def adapter_config(rank: int, alpha: float, targets: list[str], base_model: str) -> dict[str, Any]:
    """adapter_config.json contents, written through PEFT's own LoraConfig so every loader accepts it."""
    from peft import LoraConfig

    return peft_config_json(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=sorted(targets),
                                       bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model))


def optimizer_state(adapters: Adapters, optimizer: torch.optim.Optimizer,
                    staging: HostStaging | None = None) -> dict[str, Any]:
    """AdamW moments gathered to full tensors under PEFT names (collective: every rank must call); at TP 1 views of
    staging's exp_avg and exp_avg_sq buffers if given."""
    entries = _entries(adapters)
    step = 0
    avg, sq = {}, {}
    for name, p, _ in entries:
        st = optimizer.state.get(p, {})
        if "exp_avg" in st:
            step = int(st["step"])
            avg[name], sq[name] = st["exp_avg"], st["exp_avg_sq"]
        else:
            avg[name] = sq[name] = torch.zeros_like(p)
    return {"format": OPTIMIZER_FORMAT, "step": step,
            "exp_avg": gather_full(adapters, avg, own_storage=False, staging=staging, slot="exp_avg"),
            "exp_avg_sq": gather_full(adapters, sq, own_storage=False, staging=staging, slot="exp_avg_sq")}


def load_adapter_dir(adapters: Adapters, optimizer: torch.optim.Optimizer | None, adapter_dir: Path) -> None:
    """Load PEFT weights (and optimizer.pt if present) into this rank's shards."""
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / "adapter_model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{adapter_dir}: no adapter_model.safetensors to resume from")
    state = load_file(str(path))
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    entries = _entries(adapters)
    missing = [name for name, _, _ in entries if name not in state]
    if missing:
        raise ValueError(f"{adapter_dir}: adapter lacks {len(missing)} tensors this model needs, e.g. {missing[0]} "
                         "(different target_modules or model?)")
    opt = None
    opt_path = adapter_dir / OPTIMIZER_FILE
    if optimizer is not None and opt_path.exists():
        opt = torch.load(opt_path, map_location="cpu", weights_only=True)
        if opt.get("format") != OPTIMIZER_FORMAT:
            raise ValueError(f"{opt_path}: not a Megatron-trainer optimizer state ({opt.get('format')!r})")
    with torch.no_grad():
        for name, p, dim in entries:
            local = shard(state[name], dim, tp, rank)
            if local.shape != p.shape:
                raise ValueError(f"{adapter_dir}: {name} has shape {tuple(state[name].shape)}, which does not fit "
                                 f"this model's LoRA (local shard {tuple(p.shape)}); is lora.rank the same?")
            p.copy_(local.to(p.dtype))
            if opt is not None and optimizer is not None and opt["step"] > 0:
                optimizer.state[p] = {
                    "step": torch.tensor(float(opt["step"])),
                    "exp_avg": shard(opt["exp_avg"][name], dim, tp, rank).to(p.device, p.dtype),
                    "exp_avg_sq": shard(opt["exp_avg_sq"][name], dim, tp, rank).to(p.device, p.dtype),
                }
