"""The engine interface that the step loop drives, and what a rollout returns."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# The engines run a checkpoint with a context of at most this many tokens, whatever its positions allow
CONTEXT_CAP = 4096


def context_length(config: dict[str, Any]) -> int:
    """The context the engines run a checkpoint with (its config.json as a dict): its positions, capped."""
    return min(int(config.get("max_position_embeddings", CONTEXT_CAP)), CONTEXT_CAP)


# The rollout paths `python -m hybridrl bench` measures an engine through (tools/engine_bench.py says what each is)
ROLLOUT_PATHS = ("raw", "client", "whole", "stream_all", "old_client")


def stamp_timing(arrived: Any, first: Any, last: Any, tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds from an engine's stamps of one request: its arrival, its first and its last token
    (one clock, any origin), TPOT being (last - first) / (tokens - 1). NaN where a stamp is missing or zero."""
    arrived, first, last = (float(x or 0.0) for x in (arrived, first, last))
    ttft = first - arrived if arrived > 0 and first > 0 else float("nan")
    tpot = (last - first) / (tokens - 1) if first > 0 and last > 0 and tokens > 1 else float("nan")
    return ttft, tpot


class EngineError(RuntimeError):
    """The engine failed to start, died, or answered something unusable (the loop asks alive() which)."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: Sampling
    adapter: str | None = None  # adapter name loaded in the engine, None = base model
    # streamed requests are timed token by token (TTFT, TPOT); the others come back in one response, so
    # that the controller's per-event work cannot cap the throughput it measures (see stream_flags)
    stream: bool = False


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # engine logprob of each sampled token
    ttft_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)  # per-token gaps after the first arrival (see add_tokens)
    latency_s: float = float("nan")
    finish_reason: str | None = None
    error: str | None = None  # set when the request failed; the other fields are then partial
    streamed: bool = False
    events: int = 0  # stream events that carried tokens (0 for a request answered in one response)
    # the engine's own timing of the request (run key engine_timing), from its arrival at the engine
    engine_ttft_s: float = float("nan")
    engine_tpot_s: float = float("nan")
    last_arrival_s: float = field(default=float("nan"), repr=False)

    def add_tokens(self, ids: list[int], logprobs: list[float], now: float, sent_at: float) -> None:
        """Append streamed tokens; the first arrival gives TTFT, each later one inter-token gaps.

        ITL is per token, as SGLang's bench_serving counts chunked streams: an event that brings k tokens
        after a gap g adds k gaps of g/k. Engines stream bursts, so one sample per event would overstate it.
        Tokens that arrive together with the first one add no gap.
        """
        if not ids:
            return
        self.events += 1
        if not self.token_ids:
            self.ttft_s = now - sent_at
        else:
            self.itl_s.extend([(now - self.last_arrival_s) / len(ids)] * len(ids))
        self.last_arrival_s = now
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (latency - TTFT) / (tokens - 1); None below 2 tokens."""
        n = len(self.token_ids)
        if n < 2 or math.isnan(self.latency_s) or math.isnan(self.ttft_s):
            return None
        return (self.latency_s - self.ttft_s) / (n - 1)


def stream_flags(n: int, fraction: float) -> list[bool]:
    """Which of `n` requests are streamed: `fraction` of them, spread evenly and fixed by position, so
    that every engine streams the same requests of a request set (0: none, 1: all)."""
    return [int((i + 1) * fraction) > int(i * fraction) for i in range(n)]


@dataclass(frozen=True)
class SleepVariant:
    """One way an engine can release its GPU memory and take it back, for the benchmark's sleep/wake probe."""

    label: dict[str, Any]  # e.g. {"tags": [...]} or {"level": 1}
    sleep: Callable[[], None]
    wake: Callable[[], None]


@dataclass(frozen=True)
class SleepStages:
    """An engine's sleep as separate calls, so that something can run beside the weights' release
    (onload_beside_release): the calls in order do what sleep() does."""

    release_cache: Callable[[], None]  # frees the KV cache (and what goes with it); copies nothing
    release_weights: Callable[[], None]  # moves the weights out to the host
    read_asleep: Callable[[], None]  # the engine's own readings right after its sleep (NVML on its GPUs)


class Engine(Protocol):
    """One inference engine: everything the step loop and the benchmark call. Server engines speak HTTP to a
    child process on 127.0.0.1."""

    name: str
    # requests go through the HTTP rollout client: only then is there an old shared-pool client to measure
    has_http_client: bool
    # the engine runs in the controller's own process (its GPU memory is charged to this process's pid)
    in_controller: bool
    # told the ports (by kind: engine_http, nccl) of every start, as the server's processes start on them; an
    # engine without ports of its own never calls it
    on_ports: Callable[[dict[str, int]], None] | None
    # every start's parts in seconds, in order (engines.startup.split_start): read from the engine's own log, timed
    # from the controller's side where the log has no line for it
    start_parts: list[dict[str, float | None]]

    def preflight(self) -> str | None:
        """The engine's installed version, asked before the trainer is built (which can take minutes); EngineError
        where the engine is missing from its environment."""

    def start(self, adapter: tuple[str, Path] | None = None) -> float:
        """Start (optionally with an adapter already loaded); return seconds until healthy."""

    def stop(self) -> None:
        """Stop the engine and every process it started. Safe to call twice."""

    def alive(self) -> bool: ...

    def generate(self, requests: list[Request], progress: bool = False, shared_pool: bool = False) -> list[Completion]:
        """Run all requests concurrently and return them in order (those with `stream` set token by token).

        shared_pool: through the earlier rollout client (one connection pool for all requests), which the older
        committed results were recorded with, for the benchmark; only where has_http_client."""

    def generate_raw(self, requests: list[Request]) -> list[Completion]:
        """The same requests by the shortest path the engine has, none streamed: the raw throughput that
        in-loop rollouts are held against. Server engines bypass the rollout client."""

    def load_adapter(self, name: str, path: Path) -> None:
        """Hot-load (or replace in place) a LoRA adapter under `name`."""

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def flush_cache(self) -> None: ...

    def kv_capacity_tokens(self) -> int | None: ...

    def gpus(self) -> list[int] | None:
        """NVML indices of the GPUs the engine runs on (None: every GPU)."""

    def step_metrics(self) -> dict[str, float | None]:
        """Engine-side readings since the last call (NVML right after sleep and wake), then forget them."""

    def sleep_stages(self) -> SleepStages | None:
        """The sleep in its parts, the KV cache's release before the weights', so that something can run beside the
        second (onload_beside_release); None where the engine's sleep moves no weights or cannot be split."""

    def sleep_variants(self) -> list[SleepVariant]:
        """Every way this engine can sleep, for the benchmark to time and check one by one."""

    def probe_info(self, request: Request) -> dict[str, Any]:
        """What the benchmark's probe records about the engine itself: e.g. the raw stream events of `request`,
        the server's own settings; empty where the engine has none to show."""

    def describe(self) -> dict:
        """Flags, versions and environment used to start it, for provenance."""
