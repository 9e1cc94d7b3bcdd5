"""A colocated trainer's optimizer state between steps: to pinned CPU memory while the engine holds the GPU,
and back. Both trainers move it the same way; the copies are asynchronous, so the caller synchronizes once."""

from __future__ import annotations

import torch


def optimizer_state_to_cpu(optimizer: torch.optim.Optimizer) -> None:
    """Each CUDA tensor of the state into a new pinned CPU tensor (pinned: the copy back can be asynchronous)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                state[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(value,
                                                                                              non_blocking=True)


def optimizer_state_to(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Each tensor of the state back onto `device`, but AdamW's `step`, which it keeps on the CPU."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
