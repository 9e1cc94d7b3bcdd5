"""A start barrier for runs that share one host: none starts its steps while another is still starting.

A run's start (weights load, torch.compile, CUDA graphs, the HF-to-Megatron conversion) keeps many CPU
cores and the disk busy for minutes. On 4 x H200, runs whose steps overlapped another run's start rolled
out at 3-6k tok/s instead of 10-14k, which widened every interval.
Runs started side by side therefore meet here once they are ready, and step from then on together.

The driver names the barrier in HYBRIDRL_START_BARRIER as "DIR:N": N runs meet in DIR, each leaving
`<run_id>.ready` there, or `<run_id>.gone` if it fails before, so that the others need not wait for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from hybridrl.study.config import ConfigError

ENV = "HYBRIDRL_START_BARRIER"
TIMEOUT_ENV = "HYBRIDRL_START_BARRIER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0


class StartBarrier:
    def __init__(self, directory: Path, parties: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if parties < 1:
            raise ConfigError(f"{ENV}: the number of runs must be at least 1, not {parties}")
        self.directory, self.parties, self.timeout_s = directory, parties, timeout_s
        self._arrived: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> StartBarrier | None:
        """The barrier the environment names, or None; a malformed value is a ConfigError naming it."""
        env = os.environ if env is None else env
        spec = env.get(ENV, "").strip()
        if not spec:
            return None
        directory, sep, parties = spec.rpartition(":")
        if not sep or not directory or not parties.isdigit():
            raise ConfigError(f"{ENV}={spec!r}: expected DIR:N, e.g. /tmp/ref/barrier-p1:3")
        timeout = float(env.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        return cls(Path(directory), int(parties), timeout)

    def _count(self) -> int:
        return sum(1 for p in self.directory.iterdir() if p.suffix in (".ready", ".gone"))

    def _mark(self, run_id: str, suffix: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"{run_id}{suffix}").touch()

    def wait(self, run_id: str, say: Callable[[str], None] = print, poll_s: float = 1.0) -> float:
        """Mark this run ready and wait for the others; returns the seconds waited.

        A timeout is not an error: the run goes on, and says that its timings may overlap a start.
        """
        self._mark(run_id, ".ready")
        self._arrived = run_id
        t0 = time.monotonic()
        said = False
        while (n := self._count()) < self.parties:
            if time.monotonic() - t0 > self.timeout_s:
                say(f"start barrier: {n} of {self.parties} runs ready after {self.timeout_s:.0f} s; going on "
                    "without the rest (its steps may overlap their start)")
                break
            if not said:
                say(f"start barrier: {n} of {self.parties} runs ready; waiting for the others")
                said = True
            time.sleep(poll_s)
        return time.monotonic() - t0

    def release(self, run_id: str) -> None:
        """From outside the run (its driver, once the run's process has ended): a run that never arrived and
        never left releases the others."""
        if not any((self.directory / f"{run_id}{suffix}").exists() for suffix in (".ready", ".gone")):
            self._mark(run_id, ".gone")

    def leave(self, run_id: str) -> None:
        """On any exit: a run that never arrived releases the others."""
        if self._arrived is None:
            self._mark(run_id, ".gone")
