"""Where a colocated LoRA trainer's frozen base lives between steps (`keep_base_on_gpu: auto`).

LoRA never changes the base, so moving it off the GPU before every rollout and back before every update is
traffic the step pays for nothing (at the 48-layer MoE shape, about a second of each step). It can stay when
each GPU still holds the engine's share beside it: decided once, before the engine's first start (which sizes
its memory from what it finds), from NVML's free memory with the rest of the trainer already offloaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# What an engine holds beyond its memory fraction on each GPU (CUDA graphs, NCCL buffers, the sampler's
# workspace, the CUDA context), and what the trainer's next onload allocates before the engine sleeps
MARGIN_GB = 4.0


def decide(memory_gb: Mapping[int, tuple[float, float]], engine_fraction: float,
           margin_gb: float = MARGIN_GB) -> dict[str, Any]:
    """Keep the base where every GPU's free memory (total - used, with the base on it) holds the engine's share
    (engine_fraction of the GPU) and the margin. `memory_gb`: NVML index -> (used, total). No GPU read: keep
    nothing (the safe side). Returns the decision with its figures, for the run's provenance."""
    need = {i: engine_fraction * total + margin_gb for i, (_, total) in memory_gb.items()}
    free = {i: total - used for i, (used, total) in memory_gb.items()}
    short = sorted(i for i in free if free[i] < need[i])
    kept = bool(free) and not short
    if not free:
        why = "no GPU memory could be read (NVML): the base is offloaded"
    elif short:
        why = (f"GPU {short[0]} has {free[short[0]]:.1f} GB free with the base on it, less than the engine's "
               f"{engine_fraction:g} of it and a {margin_gb:g} GB margin ({need[short[0]]:.1f} GB): the base is "
               "offloaded")
    else:
        why = (f"every GPU has at least {min(free.values()):.1f} GB free with the base on it, enough for the "
               f"engine's {engine_fraction:g} of it and a {margin_gb:g} GB margin: the base stays")
    return {"mode": "auto", "kept": kept, "why": why, "engine_fraction": engine_fraction, "margin_gb": margin_gb,
            "free_gb": {str(i): round(v, 2) for i, v in free.items()},
            "need_gb": {str(i): round(v, 2) for i, v in need.items()}}
