"""What a trainer's update held on its GPU by torch's allocator: the peak of live tensors during the update, and what
the allocator's cache keeps after it. A trainer on a GPU of its own (split) never empties that cache, so NVML's
figure for its GPU (46 GB in a placement study's split HF runs on an H200, where the colocated twins' GPU, the
engine asleep beside the trainer, peaked at 33 GB in the update) reads the cache, not what the update needs; these
two say which."""

from __future__ import annotations

import torch

from hybridrl import nvml


def start(device: torch.device) -> None:
    """The peak counts from here (each update's own, not the run's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def taken(device: torch.device) -> dict[str, float]:
    """mem/trainer_peak_gb (live tensors' peak since `start`) and mem/trainer_reserved_gb (the cache now), in GB
    (10^9 bytes, as NVML's figures); nothing off CUDA."""
    if device.type != "cuda":
        return {}
    return {"mem/trainer_peak_gb": torch.cuda.max_memory_allocated(device) / nvml.GB,
            "mem/trainer_reserved_gb": torch.cuda.memory_reserved(device) / nvml.GB}
