"""The rollout client in a process of its own (run key `rollout_process`).

In the controller's process the client shares one interpreter lock with everything else there: in an
overlapped split run, with the trainer's thread that launches the update's kernels. Each time the trainer hands
the lock to a torch call, the client's parsing of a streamed event can take it for up to the interpreter's switch
interval (5 ms). `python -m hybridrl client-gil` measures it: beside the client's thread a loop of torch operators
ran slower on the CPU machine and on an H200 host, and so did the HF update itself with vLLM-style answers; beside
its worker they ran at their own speed.

A spawned worker (no fork of a controller that runs threads and CUDA) takes each batch of requests and the
client's address, and sends back the completions; it starts on the first rollout (the engine's warm-up request,
counted in its start-up) and ends with the engine.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from hybridrl.engines.base import Completion, EngineError, Request


@dataclass(frozen=True)
class Address:
    """All a client needs of its server in the worker: where it answers."""

    base_url: str


@dataclass(frozen=True)
class ClientSpec:
    """A rollout client as the worker rebuilds it: its class (importable, so it pickles by name) and settings."""

    cls: type
    base_url: str
    timeout_s: float
    max_concurrency: int
    shared_pool: bool = False
    keep_connections: bool = False

    @classmethod
    def of(cls, client: object) -> ClientSpec:
        return cls(type(client), client.server.base_url, client.timeout_s, client.max_concurrency,
                   client.shared_pool, client.keep_connections)


_CLIENTS: dict[ClientSpec, object] = {}  # in the worker: one client a spec, so its connections are kept


def _collect(spec: ClientSpec, requests: list[Request]) -> list[Completion]:
    """In the worker: the requests through the spec's client, made on its first batch."""
    client = _CLIENTS.get(spec)
    if client is None:
        client = _CLIENTS[spec] = spec.cls(Address(spec.base_url), spec.timeout_s, spec.max_concurrency,
                                           shared_pool=spec.shared_pool, keep_connections=spec.keep_connections)
    return client.collect(requests)


class ClientProcess:
    """One worker process that runs a rollout client's requests."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    def collect(self, client: object, requests: list[Request]) -> list[Completion]:
        """What `client.collect(requests)` would return, computed in the worker."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        try:
            return self._pool.submit(_collect, ClientSpec.of(client), requests).result()
        except BrokenProcessPool as exc:
            self.close()
            raise EngineError(f"the rollout client's process (rollout_process) died: {exc}; the engine may still "
                              "be up, its answers to this batch are lost") from exc

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
