"""phase.json: where a run is now, so that a fault run can hit it at a chosen point (tools/fault_run.py).

It holds the step and phase the loop is in and, with overlap, the step whose rollout is running ahead in its
thread (null once that rollout has its answers). Both threads rewrite it on every change, under one lock, so the
file never shows one thread's news without the other's.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from hybridrl import atomic


class PhaseFile:
    """The run's phase.json, rewritten whole on every change (an atomic rename, so a reader never sees half)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._now: dict[str, Any] = {"step": 0, "phase": "start", "ahead": None}

    def enter(self, step: int, phase: str) -> None:
        """The loop starts `phase` of `step`."""
        self._write(step=step, phase=phase)

    def ahead(self, step: int | None) -> None:
        """Step `step`'s rollout started running ahead (None: it has ended)."""
        self._write(ahead=step)

    def _write(self, **change: Any) -> None:
        with self._lock:
            self._now.update(change)
            atomic.write_text(self.path, json.dumps({**self._now, "pid": os.getpid()}))


def read(path: Path) -> dict[str, Any] | None:
    """The run's phase.json, or None before it exists (or while it cannot be read)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
