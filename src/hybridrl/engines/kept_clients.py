"""The rollout client's connections, kept from one rollout to the next.

A rollout used to open an event loop of its own and a one-connection httpx client for each concurrency slot, so
each step built 64-128 clients and opened as many TCP connections before its requests left, and a streamed
request's first token waited behind that set-up of the requests after it. Here one event loop and its clients
outlive the rollout: the next one starts on open connections. httpx drops a connection its server closed (an engine
restarted) and opens another.

Only one thread runs the loop at a time; a caller that finds it busy (a check beside an overlapped rollout) gets a
loop and clients of its own for that call, as before.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


class KeptClients:
    """One event loop and the clients made on it, for rollouts run one after another."""

    def __init__(self, make: Callable[[], httpx.AsyncClient]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: list[httpx.AsyncClient] = []

    def run(self, main: Callable[[list[httpx.AsyncClient] | None], Coroutine[Any, Any, T]], slots: int,
            fresh: Callable[[Coroutine[Any, Any, T]], T]) -> T:
        """main(clients) on the kept loop with `slots` kept clients; where another thread holds the loop,
        fresh(main(None)), whose coroutine makes clients of its own. An interrupted or failed run closes the
        loop and its clients (the next run makes new ones), its requests still in flight given the rollout's grace
        to end (cancel_others)."""
        if not self._lock.acquire(blocking=False):
            return fresh(main(None))
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
        if loop is None or loop.is_closed():
            return
        from hybridrl.engines.server import cancel_others  # the rollout's own cancellation rules

        async def shut() -> None:
            await cancel_others()  # an interrupted rollout's requests, with the rollout's grace
            await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
            await loop.shutdown_asyncgens()

        try:
            loop.run_until_complete(shut())
        finally:
            loop.close()
