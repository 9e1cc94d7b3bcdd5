"""Overlapped split: the engine rolls out the next step while the trainer trains this one (overlap: 1).

The rollout runs in a background thread against the adapter the engine holds when it starts (one step older
than the trainer's); the loop waits for it to finish before it loads the new adapter, so adapters change only
between batches. verl's one-step-off-policy recipe, slime's train_async and prime-rl's asynchronous default
run split placements this way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from hybridrl.engines.base import Completion, Engine, Request


@dataclass
class InFlight:
    """One step's rollout, started ahead of its step."""

    step: int
    requests: list[Request]
    answers: list[str]
    adapter_step: int  # the step whose adapter the engine held when this rollout started (0: the base model)
    future: Future = field(repr=False)
    started: float = 0.0  # perf_counter
    ended: float | None = None

    @property
    def gen_s(self) -> float:
        """The engine's own time on this rollout, from its start to its last answer."""
        return (self.ended or time.perf_counter()) - self.started

    def result(self) -> list[Completion]:
        """The completions; an engine that died meanwhile raises its EngineError here."""
        return self.future.result()


class AheadRollouts:
    """Starts a step's rollout in a background thread; one at a time (the engine's batch is the step's)."""

    def __init__(self, on_change: Callable[[int | None], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self.pending: InFlight | None = None
        self._on_change = on_change  # told the step of a rollout as it starts ahead, and None when it ends

    def _tell(self, step: int | None) -> None:
        if self._on_change is not None:
            self._on_change(step)

    def start(self, engine: Engine, step: int, requests: list[Request], answers: list[str],
              adapter_step: int) -> InFlight:
        flight = InFlight(step, requests, answers, adapter_step, Future(), time.perf_counter())

        def run() -> list[Completion]:
            try:
                return engine.generate(requests)
            finally:
                flight.ended = time.perf_counter()
                self._tell(None)

        self._tell(step)
        flight.future = self._pool.submit(run)
        self.pending = flight
        return flight

    def take(self, step: int) -> InFlight | None:
        """The rollout started ahead for `step`, if any (it may still be running)."""
        flight, self.pending = self.pending, None
        if flight is not None and flight.step != step:
            raise RuntimeError(f"a rollout for step {flight.step} is in flight at step {step}")
        return flight

    def settle(self) -> None:
        """Wait until the rollout in flight has its answers (or its error, raised later by `result`)."""
        if self.pending is not None:
            self.pending.future.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def overlap_s(a: tuple[float, float] | None, b: tuple[float, float] | None) -> float:
    """Seconds two (start, end) intervals share."""
    if a is None or b is None:
        return 0.0
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
