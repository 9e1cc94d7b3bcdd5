"""A PEFT adapter directory as both trainers write it: adapter_model.safetensors, adapter_config.json and the
trainer's optimizer.pt, renamed into place whole.

The engines load the first two as PEFT's save_pretrained writes them; writing them here skips what
save_pretrained adds at every step (a model card rendered from a template) and copies the tensors to the host
once per dtype instead of once per tensor (each copy waits for the GPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hybridrl.atomic import atomic_dir

OPTIMIZER_FILE = "optimizer.pt"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def peft_config_json(config: Any) -> dict[str, Any]:
    """A PEFT LoraConfig as adapter_config.json holds it: sets as sorted lists, enums as their values."""
    d = config.to_dict()
    for k, v in d.items():
        if isinstance(v, set):
            d[k] = sorted(v)
        elif hasattr(v, "value"):
            d[k] = v.value
    return d


def to_host(tensors: dict[str, torch.Tensor], own_storage: bool = True) -> dict[str, torch.Tensor]:
    """The tensors on the CPU, detached, in one copy per device and dtype. own_storage: each result gets its own
    (safetensors refuses tensors that share one); else they are views of the one copy, which torch.save writes
    as one record instead of one a tensor."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for name, t in tensors.items():
        groups.setdefault((t.device, t.dtype), []).append(name)
    for names in groups.values():
        flat = torch.cat([tensors[n].detach().reshape(-1) for n in names]).cpu()
        offset = 0
        for n in names:
            size = tensors[n].numel()
            view = flat[offset: offset + size].view(tensors[n].shape)
            out[n] = view.clone() if own_storage else view
            offset += size
    return {name: out[name] for name in tensors}


def optimizer_to_host(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state_dict() with every tensor of its per-parameter state copied to the host at once, as
    views of that copy (one record in the file)."""
    flat = {f"{i}/{k}": v for i, st in state["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)}
    host = to_host(flat, own_storage=False)
    return {**state, "state": {i: {k: host.get(f"{i}/{k}", v) for k, v in st.items()}
                               for i, st in state["state"].items()}}


def write_adapter_dir(out_dir: Path, weights: dict[str, torch.Tensor], config: dict[str, Any],
                      optimizer: dict[str, Any] | None) -> None:
    """weights (host tensors under PEFT's names), config and the optimizer's state into out_dir, atomically: a
    sibling temp dir, then renamed over out_dir."""
    from safetensors.torch import save_file

    with atomic_dir(Path(out_dir)) as tmp:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
        if optimizer is not None:
            torch.save(optimizer, tmp / OPTIMIZER_FILE)
