"""Which GPUs an engine runs on, and how much memory NVML says is in use there.

NVML, not torch: torch's counters miss cumem (vLLM sleep mode) and torch_memory_saver (SGLang)
allocations, and the engine's memory lives in another process anyway.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from hybridrl.run_config import RunConfig


def visible_devices(env: dict[str, str] | None = None) -> list[str] | None:
    """The CUDA_VISIBLE_DEVICES entries, or None where it is unset (every GPU is visible)."""
    value = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def split_engine_devices(run: RunConfig, env: dict[str, str] | None = None) -> dict[str, str]:
    """In split placement the engine takes the LAST `tp` visible GPUs and the trainer keeps cuda:0.

    The trainer builds on cuda:0 of the controller's devices, so giving the engine the tail of the
    list keeps the two apart without the trainer knowing. Returns the env entries to set (none
    outside split, or where the engine's env already names its devices).
    """
    if run.placement != "split" or run.device != "cuda":
        return {}
    devices = visible_devices(env)
    if devices is None:
        devices = [str(i) for i in range(_device_count())]
    tp = run.tp
    if len(devices) < tp + 1:
        return {}  # one GPU only: share it rather than fail; the report shows the memory
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[-tp:])}


def _device_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver or library: no GPUs to split
        return 0


def nvml_indices(env: dict[str, str] | None = None) -> list[int] | None:
    """NVML indices of the visible GPUs (numeric CUDA_VISIBLE_DEVICES only; None = all)."""
    devices = visible_devices(env)
    if devices is None:
        return None
    try:
        return [int(d) for d in devices]
    except ValueError:  # GPU UUIDs or MIG ids: cannot map cheaply, sample every GPU
        return None


@contextlib.contextmanager
def _nvml_handles(indices: list[int] | None) -> Iterator[tuple[Any, list[Any]] | None]:
    """(pynvml, handles of the given GPUs) for one NVML session; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        yield None
        return
    try:
        count = pynvml.nvmlDeviceGetCount()
        picked = [i for i in (indices if indices is not None else range(count)) if i < count]
        yield pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i) for i in picked]
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def used_gb(indices: list[int] | None = None) -> float | None:
    """Max over the given GPUs of NVML used memory in GB; None without NVML."""
    with _nvml_handles(indices) as session:
        if session is None:
            return None
        pynvml, handles = session
        values = []
        for handle in handles:
            with contextlib.suppress(Exception):
                values.append(pynvml.nvmlDeviceGetMemoryInfo(handle).used / 1e9)
        return max(values) if values else None


def process_used_gb(pid: int | None = None, indices: list[int] | None = None) -> float | None:
    """GPU memory (GB, summed over the given GPUs) that NVML charges to one process, this one by default.

    In colocate this is what the trainer (and its CUDA context) leaves on the GPU once offloaded.
    """
    pid = os.getpid() if pid is None else pid
    with _nvml_handles(indices) as session:
        if session is None:
            return None
        pynvml, handles = session
        total = 0.0
        for handle in handles:
            with contextlib.suppress(Exception):
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid == pid and proc.usedGpuMemory is not None:
                        total += proc.usedGpuMemory / 1e9
        return total
