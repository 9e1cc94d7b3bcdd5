"""The Megatron workers' process groups torn down at offload and made again at onload (run.release_comms).

At TP > 1 each NCCL communicator keeps its buffers on the GPU for as long as it lives, and a colocated trainer
leaves more than its CUDA context beside the engine (1.19 GB a rank at TP 2 against 0.74 GB at TP 1 on two
H200s). torch 2.11 has no way to suspend a communicator (NCCL 2.29.7's
ncclCommSuspend reaches torch in 2.12), so the groups are destroyed and made again, as slime's reloadable process
groups do. Measured, that gave back a few tens of MB a rank:
with the small buffers the trainer asks for, the rest of the excess lives outside the communicators. Megatron's
layers keep the groups they were built with, so after the new groups exist every reference to an old one, in the
model's modules and the objects they hold, is pointed at its successor.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

# objects whose attributes may hold a process group: torch modules, dataclasses, megatron's and hybridrl's classes
_WALKED_PACKAGES = ("megatron.", "hybridrl.")


def groups_by_name() -> dict[str, dist.ProcessGroup]:
    """Every process group megatron's parallel_state holds now, by global name (list entries as NAME[i]), and the
    world's as WORLD."""
    found: dict[str, dist.ProcessGroup] = {}
    for name, value in vars(parallel_state).items():
        if isinstance(value, dist.ProcessGroup):
            found[name] = value
        elif isinstance(value, (list, tuple)):
            found.update({f"{name}[{i}]": g for i, g in enumerate(value) if isinstance(g, dist.ProcessGroup)})
    if dist.is_initialized():
        found["WORLD"] = dist.group.WORLD
    return found


def rebind(roots: Iterable[Any], successors: dict[int, Any]) -> int:
    """Point every attribute, list entry and dict value reachable from `roots` that holds a key of `successors`
    (an object's id) at that object's successor; returns how many references changed. It walks torch modules,
    dataclasses and megatron's and hybridrl's own objects (not tensors), each once."""
    seen: set[int] = set()
    stack = list(roots)
    changed = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            items: Iterable[tuple[Any, Any]] = list(obj.items())
        elif isinstance(obj, list):
            items = list(enumerate(obj))
        else:
            items = list(getattr(obj, "__dict__", {}).items())
        for key, value in items:
            if id(value) in successors:
                _set(obj, key, successors[id(value)])
                changed += 1
            elif isinstance(value, tuple) and any(id(v) in successors for v in value):
                _set(obj, key, tuple(successors.get(id(v), v) for v in value))
                changed += 1
            elif isinstance(value, (dict, list)) or _walked(value):
                stack.append(value)
    return changed


def _set(obj: Any, key: Any, value: Any) -> None:
    if isinstance(obj, (dict, list)):
        obj[key] = value
    else:
        object.__setattr__(obj, key, value)  # also frozen dataclasses (megatron's ProcessGroupCollection is not)


def _walked(value: Any) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(value, type):
        return False
    if isinstance(value, torch.nn.Module) or dataclasses.is_dataclass(value):
        return True
    return (type(value).__module__ or "").startswith(_WALKED_PACKAGES)


def stale_layers(model: torch.nn.Module) -> int:
    """How many of the model's modules keep a tensor-parallel group (megatron's `tp_group`), or an expert-parallel
    one (`ep_group`, in a MoE layer or its token dispatcher), that is not the one parallel_state holds now."""
    tp = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    ep = parallel_state.get_expert_model_parallel_group(check_initialized=False)
    stale = 0
    for m in model.modules():
        held = [(getattr(m, "tp_group", None), tp), (getattr(m, "ep_group", None), ep),
                (getattr(getattr(m, "token_dispatcher", None), "ep_group", None), ep)]
        stale += any(group not in (None, now) for group, now in held)
    return stale


class ReloadableGroups:
    """release() destroys the world's group and megatron's (their communicators with them); restore() makes them
    again under a fresh prefix of torchrun's store (a second rendezvous on the same keys would read the first's)
    and rebinds what `roots` hold. Every rank calls both at the same point of the same job."""

    def __init__(self, tp: int, backend: str, roots: list[Any], model: torch.nn.Module, ep: int = 1) -> None:
        self.tp, self.ep, self.backend, self.roots, self.model = tp, ep, backend, roots, model
        self.generation = 0
        self.released = False
        self._old: dict[str, dist.ProcessGroup] = {}
        self._store: dist.Store | None = None

    def release(self) -> None:
        if self.released:
            return
        if self.backend == "nccl":
            torch.cuda.synchronize()  # no collective may still be queued on a communicator about to go
        self._old = groups_by_name()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        self.released = True

    def restore(self) -> int:
        """The groups made again; returns how many references to old groups were rebound."""
        if not self.released:
            return 0
        self.generation += 1
        store = dist.PrefixStore(f"hybridrl-comms-{self.generation}", self._base_store())
        dist.init_process_group(self.backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp,
                                                 expert_model_parallel_size=self.ep, create_gloo_process_groups=False)
        new = groups_by_name()
        successors = {id(g): new[name] for name, g in self._old.items() if name in new}
        self._old = {}
        self.released = False
        changed = rebind(self.roots, successors)
        stale = stale_layers(self.model)
        if stale:  # a layer left on a destroyed NCCL group would fail (or hang) in the next collective
            raise RuntimeError(f"release_comms: {stale} layers still hold a released process group after "
                               "the groups were made again; run without release_comms")
        return changed

    def _base_store(self) -> dist.Store:
        """A client of the store torchrun's agent serves (MASTER_ADDR:MASTER_PORT), made once."""
        if self._store is None:
            self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                        int(os.environ["WORLD_SIZE"]), is_master=False,
                                        timeout=timedelta(minutes=10))
        return self._store
