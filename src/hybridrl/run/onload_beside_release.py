"""The trainer's onload beside the engine's release of its weights (run key onload_beside_release).

A colocated engine that releases its weights copies them device to host at every sleep, and a trainer whose frozen
base is offloaded copies it host to device right after: the same host link, used one way and then the other, though
PCIe carries both directions at once. SGLang releases in two calls (its KV cache, then its weights), so once the KV
cache is freed the trainer can come back while the weights leave, where each GPU has room for both.

Whether it has room is measured, never assumed: an onload done alone tells what the trainer takes on each GPU
(NVML's used memory after it, less before), and a later step runs the two together only where every GPU's free
memory, after the KV cache's release, holds that and a margin.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# what an onload allocates beyond what it leaves held: the caching allocator's rounding and the copies in flight
MARGIN_GB = 2.0
# the step record's keys: whether this step ran the two together (null where the run does not ask), the most the
# last onload done alone took on a GPU, and each side's own seconds inside the release_onload phase
DONE = "placement/onload_beside_release"
NEED = "placement/onload_need_gb"
RELEASE_S = "placement/release_weights_s"
ONLOAD_S = "placement/beside_onload_s"
KEYS = (DONE, NEED, RELEASE_S, ONLOAD_S)


class OnloadBeside:
    """Decides, step by step, whether the trainer's onload runs beside the release of the engine's weights."""

    def __init__(self, margin_gb: float = MARGIN_GB) -> None:
        self.margin_gb = margin_gb
        self.need_gb: dict[int, float] | None = None  # by NVML index: what the last onload done alone took there

    def decide(self, memory_gb: Mapping[int, tuple[float, float]]) -> bool:
        """True where every GPU of `memory_gb` (index -> (used, total)) has free memory for the most the last onload
        took on any GPU (the trainer's ranks are alike, and a rank still freeing memory as it was read would show
        less) and the margin. False before any onload was measured, with no reading (no NVML), and where a GPU
        measured then is missing now: the safe side."""
        if not self.need_gb or not memory_gb or any(i not in memory_gb for i in self.need_gb):
            return False
        need = max(self.need_gb.values()) + self.margin_gb
        return all(total - used >= need for used, total in memory_gb.values())

    def measured(self, before: Mapping[int, tuple[float, float]], after: Mapping[int, tuple[float, float]]) -> None:
        """An onload done alone, from NVML before and after it: what it took on each GPU."""
        if before and after:
            self.need_gb = {i: max(after[i][0] - before[i][0], 0.0) for i in before if i in after}

    def record(self, done: bool, seconds: tuple[float, float] | None = None) -> dict[str, Any]:
        """This step's keys: whether the two ran together, the need it was judged by, and each side's seconds."""
        release_s, onload_s = seconds if seconds is not None else (None, None)
        return {DONE: done, NEED: round(max(self.need_gb.values()), 3) if self.need_gb else None,
                RELEASE_S: release_s, ONLOAD_S: onload_s}


def run_beside(release: Callable[[], None], onload: Callable[[], None]) -> tuple[float, float]:
    """`release` on a thread of its own and `onload` on this one, at once; each one's seconds. Both are waited for
    before anything is raised: the release's error first (the onload's, if it failed too, as its cause), since a
    dead engine is what the loop can recover from."""

    def timed(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridrl-release") as pool:
        released = pool.submit(timed, release)
        try:
            onload_s = timed(onload)
        except BaseException as exc:
            error = released.exception()  # waits for it
            if error is not None:
                raise error from exc
            raise
        return released.result(), onload_s
