"""The host<->device copy bandwidth of the machine a run is on, measured once at its start.

The report's floor table divides the bytes a colocated step moves (trainer onload and offload, engine sleep and wake,
adapter sync) by it; a data-sheet PCIe figure would not do, since a leased VM's link may run slower than its
slot's. One pinned host buffer of a few hundred MB is copied to the device and back a few times and the fastest copy
each way is kept (the best of a few: the first copy pays for mapping, a later one may share the bus). It costs well
under a second and a buffer that is freed straight after; off on CPU, where there is no link to measure.
"""

from __future__ import annotations

import time
from typing import Any

SIZE_BYTES = 256 * 1024 * 1024
REPEATS = 3


def measure(device: Any, size_bytes: int = SIZE_BYTES, repeats: int = REPEATS) -> dict[str, Any] | None:
    """{"h2d_gb_s", "d2h_gb_s", "bytes", "repeats", "device_name"} for a CUDA device (GB = 1e9 bytes); None on CPU
    or where CUDA is not available."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(size_bytes, dtype=torch.uint8, device=dev)
    best = {"h2d": float("inf"), "d2h": float("inf")}
    try:
        for _ in range(repeats):
            for way, (dst, src) in (("h2d", (gpu, host)), ("d2h", (host, gpu))):
                torch.cuda.synchronize(dev)
                start = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize(dev)
                best[way] = min(best[way], time.perf_counter() - start)
    finally:
        del host, gpu
        torch.cuda.empty_cache()
    return {"h2d_gb_s": size_bytes / best["h2d"] / 1e9, "d2h_gb_s": size_bytes / best["d2h"] / 1e9,
            "bytes": size_bytes, "repeats": repeats, "device_name": torch.cuda.get_device_name(dev)}
