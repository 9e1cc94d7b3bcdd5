"""A PEFT adapter directory as both trainers write it: adapter_model.safetensors and adapter_config.json,
renamed into place whole, then the trainer's optimizer.pt beside them.

The engines load the first two as PEFT's save_pretrained writes them; writing them here skips what
save_pretrained adds at every step (a model card rendered from a template) and copies the tensors to the host
once per dtype instead of once per tensor (each copy waits for the GPU). optimizer.pt is for resume alone and is
twice the adapter's size: StateWriter writes it on a thread while the loop moves on to the engine.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from hybridrl.atomic import atomic_dir, atomic_path

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


class HostStaging:
    """Host buffers that a trainer's copies to the host reuse from one export to the next, pinned where there is a
    GPU: into fresh pageable memory a 27 MB copy took 18 ms on an H200 host (the 48-layer adapter; page faults and
    the driver's bounce buffer), pinned it runs at the bus's speed. Whoever reads a buffer's views after the next
    copy must be done with them first (the trainers wait for the optimizer state's writer)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def buffer(self, slot: str, source: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host tensor of numel elements for `slot` (one per use: weights, exp_avg, ...) and the device the
        copy comes from, reused. One copy may hold groups from several devices of one dtype (an optimizer's
        state: its step counts on the CPU, its moments on the GPU): each gets its own buffer."""
        key = (slot, source, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())
            self._buffers[key] = buf
        return buf[:numel]


def to_host(tensors: dict[str, torch.Tensor], own_storage: bool = True, staging: HostStaging | None = None,
            slot: str = "") -> dict[str, torch.Tensor]:
    """The tensors on the CPU, detached, in one copy per device and dtype. own_storage: each result gets its own
    (safetensors refuses tensors that share one); else they are views of the one copy, which torch.save writes
    as one record instead of one a tensor. staging: copy into its buffer for `slot` instead of new memory (views
    of it, without own_storage, last until the next copy into that slot)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for name, t in tensors.items():
        groups.setdefault((t.device, t.dtype), []).append(name)
    with record_function("export.to_host"):  # a labelled range in trainer-profile --export
        for (device, _), names in groups.items():
            flat = torch.cat([tensors[n].detach().reshape(-1) for n in names])
            if staging is not None:
                flat = staging.buffer(slot, device, flat.numel(), flat.dtype).copy_(flat)
            else:
                flat = flat.cpu()
            offset = 0
            for n in names:
                size = tensors[n].numel()
                view = flat[offset: offset + size].view(tensors[n].shape)
                out[n] = view.clone() if own_storage else view
                offset += size
    return {name: out[name] for name in tensors}


def optimizer_to_host(state: dict[str, Any], staging: HostStaging | None = None) -> dict[str, Any]:
    """An optimizer's state_dict() with every tensor of its per-parameter state copied to the host at once, as
    views of that copy (one record in the file; in staging's "optimizer" buffer if given)."""
    flat = {f"{i}/{k}": v for i, st in state["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)}
    host = to_host(flat, own_storage=False, staging=staging, slot="optimizer")
    return {**state, "state": {i: {k: host.get(f"{i}/{k}", v) for k, v in st.items()}
                               for i, st in state["state"].items()}}


def write_adapter_dir(out_dir: Path, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """weights (host tensors under PEFT's names) and config into out_dir, atomically: a sibling temp dir, then
    renamed over out_dir. The optimizer's state follows through StateWriter."""
    from safetensors.torch import save_file

    with record_function("export.write"), atomic_dir(Path(out_dir)) as tmp:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))


class StateWriter:
    """Writes a step's optimizer state (host tensors) into its adapter dir on a thread of its own, atomically.

    No engine reads optimizer.pt, so the update ends once the engine's files are written; pickling and writing the
    moments overlap what follows (the trainer's offload, the engine's wake and adapter load). The loop waits for
    it before it records the step, so a recorded step can always be resumed.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optimizer-state")
        self._pending: tuple[Path, Future[None]] | None = None

    def submit(self, out_dir: Path, optimizer: dict[str, Any]) -> None:
        """Start writing out_dir/optimizer.pt; the previous write is waited for first, so none overtakes another."""
        self.wait()
        path = Path(out_dir) / OPTIMIZER_FILE
        self._pending = (path, self._pool.submit(_save, optimizer, path))

    def wait(self) -> float:
        """Block until the last submitted state is on disk; returns the seconds waited. A failed write raises
        OSError naming the file (the adapter beside it is kept)."""
        if self._pending is None:
            return 0.0
        (path, future), self._pending = self._pending, None
        t0 = time.perf_counter()
        try:
            future.result()
        except Exception as exc:
            raise OSError(f"could not write the optimizer state {path}: {type(exc).__name__}: {exc}") from exc
        return time.perf_counter() - t0

    def close(self) -> None:
        """Let a write in progress finish (its error, if any, is dropped: close runs on the way out of a failure)."""
        self._pending = None
        self._pool.shutdown(wait=True)


def _save(obj: dict[str, Any], path: Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
