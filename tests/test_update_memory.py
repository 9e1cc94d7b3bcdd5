"""The trainers' update memory from torch's allocator: each update's own peak and the cache after it, in GB."""

import torch

from hybridrl.trainers import update_memory


def test_an_update_reports_its_own_peak_and_the_cache_in_gb(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(f"reset {device}"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 33_090_000_000)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 46_070_000_000)
    gpu = torch.device("cuda", 0)
    update_memory.start(gpu)
    assert calls == ["reset cuda:0"]  # the peak is the update's, not the run's
    assert update_memory.taken(gpu) == {"mem/trainer_peak_gb": 33.09, "mem/trainer_reserved_gb": 46.07}


def test_off_cuda_there_is_nothing_to_report() -> None:
    cpu = torch.device("cpu")
    update_memory.start(cpu)  # no CUDA call on a CPU-only torch
    assert update_memory.taken(cpu) == {}
