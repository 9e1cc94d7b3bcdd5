"""Which GPUs an engine runs on (CUDA_VISIBLE_DEVICES), their NVML indices, and the NVML readings every engine
records right after it sleeps and wakes."""

from __future__ import annotations

from hybridrl import nvml
from hybridrl.nvml import visible_devices
from hybridrl.study.run_config import RunConfig


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
        devices = [str(i) for i in range(nvml.device_count())]
    tp = run.tp
    if len(devices) < tp + 1:
        return {}  # one GPU only: share it rather than fail; the report shows the memory
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[-tp:])}


def nvml_indices(env: dict[str, str] | None = None) -> list[int] | None:
    """NVML indices of the visible GPUs (numeric CUDA_VISIBLE_DEVICES only; None = all)."""
    devices = visible_devices(env)
    if devices is None:
        return None
    try:
        return [int(d) for d in devices]
    except ValueError:  # GPU UUIDs or MIG ids: cannot map cheaply, sample every GPU
        return None


def asleep_readings(gpus: list[int] | None) -> dict[str, float | None]:
    """Right after the engine slept: what is still in use on its GPUs."""
    return {"mem/engine_asleep_gb": nvml.used_gb(gpus)}


def started_readings(gpus: list[int] | None) -> dict[str, float | None]:
    """Right after the engine started (its first sleep and wake to come): the memory its wakes should get back."""
    return {"mem/engine_started_gb": nvml.used_gb(gpus)}


def awake_readings(gpus: list[int] | None) -> dict[str, float | None]:
    """Right after the engine woke; colocate wakes just after the trainer offloaded, so the controller's own
    share is what the trainer left on the GPU."""
    return {"mem/engine_awake_gb": nvml.used_gb(gpus), "mem/controller_gb": nvml.process_used_gb(indices=gpus)}
