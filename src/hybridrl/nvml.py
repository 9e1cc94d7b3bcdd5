"""The one place that asks NVML (the GPU driver) about devices and memory. Every figure is in GB, 10^9 bytes.

NVML, not torch: torch's counters miss cumem (vLLM sleep mode) and torch_memory_saver (SGLang)
allocations, and an engine's memory lives in another process anyway. Without a driver or pynvml every
function answers None (a CPU machine), never raises.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

GB = 1e9  # bytes: every mem/*_gb key
# NVML's clock-event reasons that hold the SM clock below what the load asks for: the software power cap, a
# hardware slowdown, software or hardware thermal slowdown, the power brake (idle and application-clock settings
# are not slowdowns)
SLOWDOWN_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


@dataclass(frozen=True)
class Conditions:
    """One GPU's running state at one instant: what sets the speed of everything measured on it."""

    sm_mhz: float
    power_w: float
    temp_c: float
    slowed: bool  # a SLOWDOWN_REASONS bit was set


class Devices:
    """An open NVML session on some GPUs; kept open by the memory sampler, which reads it many times a second."""

    def __init__(self, nvml: Any, handles: list[tuple[int, Any]]) -> None:
        self._nvml = nvml
        self.handles = handles  # (NVML index, handle)

    def used_gb(self) -> dict[int, float]:
        """NVML index -> used memory of that whole GPU; a GPU that fails to answer is left out."""
        out = {}
        for i, handle in self.handles:
            with contextlib.suppress(Exception):
                out[i] = self._nvml.nvmlDeviceGetMemoryInfo(handle).used / GB
        return out

    def memory_gb(self) -> dict[int, tuple[float, float]]:
        """NVML index -> (used, total) memory of that whole GPU; a GPU that fails to answer is left out."""
        out = {}
        for i, handle in self.handles:
            with contextlib.suppress(Exception):
                info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                out[i] = (info.used / GB, info.total / GB)
        return out

    def conditions(self) -> dict[int, Conditions]:
        """NVML index -> SM clock, power draw, temperature and slowdown; a GPU that fails to answer is left out."""
        nvml, out = self._nvml, {}
        for i, handle in self.handles:
            with contextlib.suppress(Exception):
                reasons = nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
                out[i] = Conditions(float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
                                    nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                                    float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
                                    bool(reasons & SLOWDOWN_REASONS))
        return out

    def _processes(self) -> list[Any]:
        """NVML's compute processes on these GPUs (one entry per process and GPU); a GPU that fails is left out."""
        out: list[Any] = []
        for _, handle in self.handles:
            with contextlib.suppress(Exception):
                out.extend(self._nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        return out

    def used_less_gb(self, pids: set[int]) -> dict[int, float]:
        """NVML index -> used memory of that GPU less what NVML charges there to `pids`; a GPU that fails to
        answer is left out."""
        out = {}
        for i, handle in self.handles:
            with contextlib.suppress(Exception):
                theirs = sum(p.usedGpuMemory for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                             if p.pid in pids and p.usedGpuMemory is not None)
                out[i] = (self._nvml.nvmlDeviceGetMemoryInfo(handle).used - theirs) / GB
        return out

    def processes_gb(self, pids: set[int]) -> float:
        """Memory NVML charges to `pids`, summed over these GPUs and processes."""
        return sum((p.usedGpuMemory / GB for p in self._processes() if p.pid in pids and p.usedGpuMemory is not None),
                   0.0)

    def compute_pids(self) -> set[int]:
        """Every process with a CUDA context on these GPUs, whoever started it."""
        return {int(p.pid) for p in self._processes()}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()  # NVML counts its inits: this ends only our own


def open_devices(indices: list[int] | None = None) -> Devices | None:
    """A session on the GPUs with these NVML indices (None: every GPU); None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver: NVML raises its own error types
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        picked = [i for i in (indices if indices is not None else range(count)) if i < count]
        return Devices(pynvml, [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in picked])
    except Exception:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
        return None


@contextlib.contextmanager
def devices(indices: list[int] | None = None) -> Iterator[Devices | None]:
    """open_devices() for one block."""
    session = open_devices(indices)
    try:
        yield session
    finally:
        if session is not None:
            session.close()


def device_count() -> int:
    """How many GPUs the driver sees (all of them, whatever CUDA_VISIBLE_DEVICES says); 0 without NVML."""
    with devices() as session:
        return len(session.handles) if session else 0


def compute_pids() -> set[int]:
    """Every process with a CUDA context on any GPU (what `nvidia-smi` lists); empty without NVML."""
    with devices() as session:
        return session.compute_pids() if session else set()


def used_gb(indices: list[int] | None = None) -> float | None:
    """Max over the given GPUs of their used memory; None without NVML."""
    with devices(indices) as session:
        values = session.used_gb().values() if session else ()
        return max(values) if values else None


def used_less_gb(pids: set[int], indices: list[int] | None = None) -> float | None:
    """Max over the given GPUs of their used memory less what NVML charges there to `pids` (in colocate: what the
    engine holds with the trainer's processes left out); None without NVML."""
    with devices(indices) as session:
        values = session.used_less_gb(pids).values() if session else ()
        return max(values) if values else None


def process_used_gb(pid: int | None = None, indices: list[int] | None = None) -> float | None:
    """Memory (summed over the given GPUs) that NVML charges to one process, this one by default.

    In colocate this is what the trainer (and its CUDA context) leaves on the GPU once offloaded.
    """
    return processes_used_gb([os.getpid() if pid is None else pid], indices)


def processes_used_gb(pids: list[int], indices: list[int] | None = None) -> float | None:
    """Memory (summed over the given GPUs and processes) that NVML charges to `pids`, from one query a GPU: each
    query takes tens of milliseconds, so a trainer of several ranks is read in one pass, not once a rank. None
    without NVML or without pids."""
    if not pids:
        return None
    with devices(indices) as session:
        return session.processes_gb(set(pids)) if session else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _limits(nvml: Any, handle: Any) -> dict[str, float]:
    """The GPU's highest SM clock and the power limit the driver enforces; what it can answer of them."""
    out = {}
    with contextlib.suppress(Exception):
        out["max_sm_clock_mhz"] = float(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
    with contextlib.suppress(Exception):
        out["power_limit_w"] = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
    return out


def identities() -> list[dict[str, Any]] | None:
    """Every GPU the driver sees, by NVML index, UUID, name and PCI bus id: which physical GPUs a job was given; None
    without NVML. A GPU that fails to answer is left out."""
    with devices() as session:
        if session is None:
            return None
        nvml, out = session._nvml, []
        for i, handle in session.handles:
            with contextlib.suppress(Exception):
                gpu = {"index": i, "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
                       "name": _text(nvml.nvmlDeviceGetName(handle))}
                with contextlib.suppress(Exception):  # nice to have: the UUID already names the GPU
                    gpu["pci_bus_id"] = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
                out.append(gpu)
        return out


def visible_devices(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The CUDA_VISIBLE_DEVICES entries, or None where it is unset (every GPU is visible)."""
    value = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def visible_gpus(env: Mapping[str, str] | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """The GPUs CUDA_VISIBLE_DEVICES exposes, in its order, as identities() gives them; and why that is none or fewer
    than it names (None where every entry was found)."""
    listed = identities()
    if listed is None:
        return [], "no NVML here (no NVIDIA driver, or no Python binding for it)"
    entries = visible_devices(env)
    if entries is None:
        return listed, None if listed else "NVML lists no GPU"
    if not entries:
        return [], "CUDA_VISIBLE_DEVICES is empty: no GPU is visible"
    # a number is an NVML index (as engines.gpus.nvml_indices reads it); anything else a GPU UUID or, as CUDA
    # takes it, its start
    found = {e: next((g for g in listed if (e == str(g["index"]) if e.isdigit() else g["uuid"].startswith(e))), None)
             for e in entries}
    missing = [e for e, g in found.items() if g is None]
    reason = (f"CUDA_VISIBLE_DEVICES names {', '.join(missing)}, which NVML does not list (a MIG instance, or no "
              "such GPU)") if missing else None
    return [g for g in found.values() if g is not None], reason


def gpu_info() -> dict[str, Any] | None:
    """GPU models and driver, for provenance; None where NVML or a GPU is absent."""
    with devices() as session:
        if session is None:
            return None
        nvml = session._nvml
        try:
            listed = [{"index": i, "name": _text(nvml.nvmlDeviceGetName(h)),
                       "memory_gb": round(nvml.nvmlDeviceGetMemoryInfo(h).total / GB, 2), **_limits(nvml, h)}
                      for i, h in session.handles]
            cuda = nvml.nvmlSystemGetCudaDriverVersion()
            return {"driver": _text(nvml.nvmlSystemGetDriverVersion()),
                    "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}",
                    "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "devices": listed}
        except Exception:
            return None
