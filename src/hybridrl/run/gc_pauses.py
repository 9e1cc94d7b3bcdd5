"""The controller's garbage-collector pauses, step by step and in the rollout.

A collection holds the interpreter lock, so every Python thread of the controller waits for it: the rollout client's
too, which then reads the pause as time to first token. A run repeats the same work each step, so a full collection
(generation 2) can fall on the same step of every run and show as a slow step that no phase explains. These readings
say whether a collection was there.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

ROLLOUT_PHASE = "gen"
KEYS = ("host/gc_pause_s", f"host/gc_pause_s_{ROLLOUT_PHASE}", "host/gc_full_collections")


class GcPauses:
    """Times every collection of this process (gc.callbacks) and counts the full ones, by the phase they fell in."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.phase = ""  # the step's phase now (set_phase), which a collection is counted in
        self._started: float | None = None
        self._pause_s: dict[str, float] = {}
        self._full = 0

    def start(self) -> GcPauses:
        gc.callbacks.append(self.on_collect)
        return self

    def close(self) -> None:
        if self.on_collect in gc.callbacks:
            gc.callbacks.remove(self.on_collect)

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def on_collect(self, event: str, info: dict[str, Any]) -> None:
        """gc's callback: 'start' and 'stop' of one collection, with its generation."""
        now = self.clock()
        if event == "start":
            self._started = now
            return
        if self._started is None:  # installed during a collection: its start was not seen
            return
        self._pause_s[self.phase] = self._pause_s.get(self.phase, 0.0) + (now - self._started)
        self._started = None
        if info.get("generation") == 2:
            self._full += 1

    def take(self) -> dict[str, float | int]:
        """The pauses since the last take (the whole step and its rollout, in seconds) and the full collections
        among them; then start counting again."""
        out = {KEYS[0]: sum(self._pause_s.values()), KEYS[1]: self._pause_s.get(ROLLOUT_PHASE, 0.0),
               KEYS[2]: self._full}
        self._pause_s, self._full = {}, 0
        return out
