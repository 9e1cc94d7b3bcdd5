"""One call under torch.profiler, written as the operators that took its time (trainer-profile's tables, and a
Megatron worker's profiled update, one a rank)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def operator_tables(prof: Any, on_gpu: bool, rows: int = 40) -> str:
    """The profiled operators sorted by their own time on the device (the CPU without a GPU), then the same split by
    their input shapes, which tells a norm's or an adapter's elementwise work from the rest."""
    sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    return (prof.key_averages().table(sort_by=sort, row_limit=rows) + "\n\nthe same, by input shapes:\n"
            + prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=rows))


def profiled(fn: Callable[[], T], on_gpu: bool, rows: int = 40) -> tuple[T, str]:
    """fn's result, and its operators' tables headed by its wall time under the profiler (the device drained)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    t0 = time.perf_counter()
    with profile(activities=activities, record_shapes=True) as prof:
        out = fn()
        if on_gpu:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return out, f"wall {wall:.3f} s under the profiler\n" + operator_tables(prof, on_gpu, rows)
