"""The rollout client's event loop: one for each rollout, ended within a bound when it is interrupted, or one kept
with its connections from one rollout to the next (run key keep_connections).

A rollout that makes its own loop builds a one-connection httpx client for each concurrency slot, so each step
builds 64-128 clients and opens as many TCP connections before its requests leave, and a streamed request's first
token waits behind that set-up of the requests after it. KeptClients keeps one loop and its clients: the next
rollout starts on open connections, and httpx replaces a connection its server closed (an engine restarted). Only
one thread runs the kept loop at a time; a caller that finds it busy (a check beside an overlapped rollout) gets a
loop and clients of its own for that call.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

# how long the requests still in flight get to end once a rollout is interrupted (SIGTERM raises SystemExit in it)
CANCEL_GRACE_S = 5.0


async def cancel_others(timeout_s: float = CANCEL_GRACE_S) -> int:
    """Cancel every other task of the running loop and wait up to timeout_s for them to end; how many did not."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    if not others:
        return 0
    _, left = await asyncio.wait(others, timeout=timeout_s)
    return len(left)


def wind_down(loop: asyncio.AbstractEventLoop, grace_s: float = CANCEL_GRACE_S,
              clients: Sequence[httpx.AsyncClient] = ()) -> None:
    """End a rollout's loop within grace_s a stage: its other tasks cancelled (those that do not end are named and
    left behind), `clients` closed, its async generators shut (a stream's reader), then the loop closed."""
    left = loop.run_until_complete(cancel_others(grace_s))
    if left:
        print(f"rollout interrupted: {left} request task(s) did not stop within {grace_s:.0f} s; left behind",
              file=sys.stderr, flush=True)

    async def close_clients() -> None:
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)

    stages = [close_clients()] if clients else []
    for stage in [*stages, loop.shutdown_asyncgens()]:
        loop.run_until_complete(asyncio.wait([loop.create_task(stage)], timeout=grace_s))
    loop.close()


def run_bounded(main: Coroutine[Any, Any, T], grace_s: float = CANCEL_GRACE_S) -> T:
    """asyncio.run, but an interrupted run gives its pending tasks `grace_s` to take their cancellation, then
    closes the loop anyway. asyncio.run waits for them without bound: a train process that SLURM's scancel
    interrupted mid-rollout spun in that wait at 76% of a core for 15 minutes after its job had ended (on the CI's
    SLURM test cluster), its vLLM server already dead."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        wind_down(loop, grace_s)


class KeptClients:
    """One event loop and the clients made on it, for rollouts run one after another."""

    def __init__(self, make: Callable[[], httpx.AsyncClient]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: list[httpx.AsyncClient] = []

    def run(self, main: Callable[[list[httpx.AsyncClient] | None], Coroutine[Any, Any, T]], slots: int) -> T:
        """main(clients) on the kept loop with `slots` kept clients; where another thread holds the loop,
        run_bounded(main(None)), whose coroutine makes clients of its own. An interrupted or failed run ends the
        loop and its clients as run_bounded does (wind_down); the next run makes new ones."""
        if not self._lock.acquire(blocking=False):
            return run_bounded(main(None))
        try:
            if self._loop is None or self._loop.is_closed():
                self._loop, self._clients = asyncio.new_event_loop(), []
            asyncio.set_event_loop(self._loop)
            try:
                while len(self._clients) < slots:  # made while their loop is the current one
                    self._clients.append(self._make())
                return self._loop.run_until_complete(main(self._clients[:slots]))
            except BaseException:
                self._close()
                raise
            finally:
                asyncio.set_event_loop(None)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Close the clients and the loop; the next run makes new ones."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        loop, clients = self._loop, self._clients
        self._loop, self._clients = None, []
        if loop is not None and not loop.is_closed():
            wind_down(loop, clients=clients)
