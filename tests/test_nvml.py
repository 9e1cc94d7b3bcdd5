"""The one NVML module: figures in GB (10^9 bytes), None without a driver, and nothing else asks NVML."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from hybridrl import nvml
from hybridrl.run.telemetry import MemorySampler

SRC = Path(nvml.__file__).parent


def _fake_pynvml(used: dict[int, int], procs: dict[int, list[tuple[int, int]]]) -> types.ModuleType:
    """A driver with GPUs 0..n-1: `used` bytes per GPU, `procs` (pid, bytes) per GPU."""
    m = types.ModuleType("pynvml")
    m.inits = 0
    m.nvmlInit = lambda: setattr(m, "inits", m.inits + 1)
    m.nvmlShutdown = lambda: setattr(m, "inits", m.inits - 1)
    m.nvmlDeviceGetCount = lambda: len(used)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=used[h], total=80 * 10**9)
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [types.SimpleNamespace(pid=p, usedGpuMemory=b)
                                                         for p, b in procs.get(h, [])]
    m.nvmlDeviceGetName = lambda h: b"H200"
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h}0000000-aaaa-bbbb-cccc-dddddddddddd"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{h + 1:02X}:00.0".encode())
    m.nvmlSystemGetDriverVersion = lambda: "570.1"
    m.nvmlSystemGetCudaDriverVersion = lambda: 12080
    return m


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    fake = _fake_pynvml({0: 3 * 10**9, 1: 5 * 10**9}, {0: [(7, 2**30)], 1: [(7, 10**9), (8, 10**9)]})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_memory_is_in_gb_of_a_billion_bytes(driver: types.ModuleType) -> None:
    assert nvml.used_gb() == 5.0
    assert nvml.used_gb([0]) == 3.0
    assert nvml.process_used_gb(7) == pytest.approx(2**30 / 1e9 + 1.0)
    assert nvml.process_used_gb(7, [1]) == 1.0
    assert nvml.device_count() == 2
    assert nvml.processes_used_gb([7, 8]) == pytest.approx(2**30 / 1e9 + 2.0)  # both, over both GPUs
    assert nvml.processes_used_gb([8], [0]) == 0.0 and nvml.processes_used_gb([]) is None
    assert nvml.compute_pids() == {7, 8}  # every GPU's processes, as nvidia-smi lists them
    assert driver.inits == 0  # every session is closed again


def test_used_memory_less_some_processes_is_per_gpu_then_the_largest(driver: types.ModuleType) -> None:
    # GPU 0: 3 GB used, pid 7 holds 2^30 bytes; GPU 1: 5 GB used, pids 7 and 8 hold 1 GB each
    assert nvml.used_less_gb({7}) == pytest.approx(4.0)  # GPU 1's 5 - 1, above GPU 0's 3 - 1.07
    assert nvml.used_less_gb({7, 8}) == pytest.approx(3.0)  # GPU 0's 3 - 1.07 is below GPU 1's 5 - 2 = 3
    assert nvml.used_less_gb({8}, [0]) == 3.0  # pid 8 holds nothing on GPU 0
    assert nvml.used_less_gb(set()) == nvml.used_gb() == 5.0
    assert driver.inits == 0


def test_gpu_info_for_provenance(driver: types.ModuleType) -> None:
    info = nvml.gpu_info()
    assert info["driver"] == "570.1" and info["cuda_driver"] == "12.8"
    assert [d["name"] for d in info["devices"]] == ["H200", "H200"] and info["devices"][0]["memory_gb"] == 80.0


def test_identities_name_each_gpu_by_index_uuid_and_model(driver: types.ModuleType) -> None:
    assert nvml.identities() == [{"index": i, "uuid": f"GPU-{i}0000000-aaaa-bbbb-cccc-dddddddddddd", "name": "H200",
                                  "pci_bus_id": f"00000000:0{i + 1}:00.0"} for i in (0, 1)]
    assert driver.inits == 0
    del driver.nvmlDeviceGetPciInfo  # an older driver: the GPU is still named, by its UUID
    assert [set(g) for g in nvml.identities()] == [{"index", "uuid", "name"}] * 2


def test_without_a_driver_every_answer_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = types.ModuleType("pynvml")

    def fail() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    broken.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert nvml.used_gb() is None and nvml.process_used_gb() is None and nvml.gpu_info() is None
    assert nvml.used_less_gb({1}) is None
    assert nvml.identities() is None
    assert nvml.device_count() == 0 and nvml.compute_pids() == set()
    assert not MemorySampler().active


def test_the_sampler_reads_the_same_module(driver: types.ModuleType) -> None:
    sampler = MemorySampler(gpu_indices=[1])
    assert sampler.active
    sampler.close()
    assert driver.inits == 0


def test_no_other_module_asks_nvml() -> None:
    askers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "pynvml" in p.read_text())
    assert askers == ["nvml.py"]
    # nor through the driver's command-line tool
    assert not [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if '"nvidia-smi"' in p.read_text()]


def test_a_trainer_of_several_ranks_is_read_in_one_query_a_gpu(driver: types.ModuleType) -> None:
    queried = []
    query = driver.nvmlDeviceGetComputeRunningProcesses
    driver.nvmlDeviceGetComputeRunningProcesses = lambda h: queried.append(h) or query(h)
    assert nvml.processes_used_gb([7, 8]) == pytest.approx(2**30 / 1e9 + 2.0)
    assert sorted(queried) == [0, 1]  # not once a rank: each query takes tens of milliseconds
    assert driver.inits == 0
