"""How many tokens/s the controller's rollout client can absorb: its ceiling, measured without a GPU.

A local fake engine (its own processes, asyncio, answers prepared once) replays SGLang- or vLLM-style
answers: streamed as events of `tokens_per_event` tokens, or whole. The controller's real rollout client
(`engines/sglang.py`, `engines/vllm.py`) reads them, parsing every event, so the figure is the client's
limit on this host: a rollout measured near it says more about the client than about the engine.

    python -m hybridrl client-ceiling --format sglang --requests 128 --tokens 256 --stream-fraction 1
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from hybridrl.engines.base import Completion, Request, Sampling, stream_flags

FORMATS = ("sglang", "vllm")
TOKEN, LOGPROB = 42, -0.5  # every fake token; the client parses them all the same
HEADROOM = 0.8  # a rollout above this share of the ceiling may be limited by the client


# the timing each fake answer reports as the engine's own (engine_timing): arrival, first token, then per token
ARRIVED_S, TTFT_S, TPOT_S = 1000.0, 0.25, 0.01


def _sglang_event(ids: int, total: int, last: bool) -> dict[str, Any]:
    finish = {"type": "length", "length": total} if last else None
    meta: dict[str, Any] = {"completion_tokens": total, "finish_reason": finish,
                            "output_token_logprobs": [[LOGPROB, TOKEN, None]] * ids}
    if last:  # --enable-metrics' stamps as SGLang 0.5.16 sent them on the H200: no scheduler prefill stamp
        meta.update(request_received_ts=ARRIVED_S, request_finished_ts=ARRIVED_S + TTFT_S + (total - 1) * TPOT_S,
                    decode_throughput=1 / TPOT_S)
    return {"text": "", "output_ids": [TOKEN] * ids, "meta_info": meta}


VLLM_METRICS = {"queue_time_ms": 50.0, "time_to_first_token_ms": TTFT_S * 1000 - 50.0, "mean_itl_ms": TPOT_S * 1000}


def _vllm_event(ids: int, total: int, last: bool) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": "", "finish_reason": "length" if last else None,
                         "logprobs": {"tokens": [f"token_id:{TOKEN}"] * ids, "token_logprobs": [LOGPROB] * ids}}]}


def _vllm_usage(total: int) -> dict[str, Any]:
    """The event that ends a stream asked for its usage (stream_options.include_usage), with the metrics."""
    return {"choices": [], "usage": {"completion_tokens": total}, "metrics": VLLM_METRICS}


EVENTS = {"sglang": _sglang_event, "vllm": _vllm_event}


def _sse(event: dict[str, Any] | str) -> bytes:
    data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
    return b"%x\r\n%b\r\n" % (len(data), data)


@cache
def stream_chunks(fmt: str, tokens: int, tokens_per_event: int, usage: bool = False) -> tuple[bytes, ...]:
    """One streamed answer as HTTP chunks, one server-sent event each (incremental, as the engines send); with
    `usage`, vLLM's closing usage event too."""
    chunks, sent = [], 0
    while sent < tokens:
        k = min(tokens_per_event, tokens - sent)
        sent += k
        chunks.append(_sse(EVENTS[fmt](k, sent, sent == tokens)))
    if usage and fmt == "vllm":
        chunks.append(_sse(_vllm_usage(tokens)))
    return (*chunks, _sse("[DONE]"), b"0\r\n\r\n")


@cache
def whole_answer(fmt: str, tokens: int) -> bytes:
    answer = EVENTS[fmt](tokens, tokens, True)
    if fmt == "vllm":  # a whole completion carries its metrics itself
        answer["metrics"] = VLLM_METRICS
    return json.dumps(answer).encode()


def _max_tokens(body: dict[str, Any]) -> int:
    return int(body.get("max_tokens") or (body.get("sampling_params") or {}).get("max_new_tokens") or 1)


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fmt: str, tokens_per_event: int,
                  event_interval_s: float) -> None:
    """Serve one keep-alive connection: GET answers `ok`, POST a completion, streamed or whole."""
    try:
        while request_line := await reader.readline():
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                key, _, value = line.decode("latin-1").partition(":")
                headers[key.strip().lower()] = value.strip()
            raw = await reader.readexactly(int(headers.get("content-length", 0)))
            if request_line.startswith(b"GET"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                continue
            body = json.loads(raw)
            if body.get("stream"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                for chunk in stream_chunks(fmt, _max_tokens(body), tokens_per_event, usage):
                    writer.write(chunk)
                    await writer.drain()  # lets the other connections' events interleave with this one's
                    if event_interval_s:
                        await asyncio.sleep(event_interval_s)
            else:
                if event_interval_s:  # a whole answer takes as long as its stream would have
                    await asyncio.sleep(event_interval_s * -(-_max_tokens(body) // tokens_per_event))
                payload = whole_answer(fmt, _max_tokens(body))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                             % (len(payload), payload))
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def serve(fd: int, fmt: str, tokens_per_event: int, event_interval_s: float) -> None:
    """The fake engine's process: answers on the inherited listening socket `fd` until it is stopped."""
    sock = socket.socket(fileno=fd)

    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: _answer(r, w, fmt, tokens_per_event, event_interval_s), sock=sock, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


@dataclass
class FakeEngine:
    """The fake engine's processes on one listening socket of 127.0.0.1 (the kernel spreads connections)."""

    fmt: str
    tokens_per_event: int = 1
    event_interval_s: float = 0.0
    procs: int = 1
    name: str = "fake-engine"
    log_path: Path = Path("/dev/null")

    def __enter__(self) -> FakeEngine:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown answer format {self.fmt!r} ({', '.join(FORMATS)})")
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(1024)
        self.port = self._sock.getsockname()[1]
        self._spawn()
        return self

    def _spawn(self) -> None:
        # plain child processes that inherit the socket: no fork of a controller that may run threads
        cmd = [sys.executable, "-c", "import sys; from hybridrl.engines.client_ceiling import serve; "
               "serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))",
               str(self._sock.fileno()), self.fmt, str(self.tokens_per_event), str(self.event_interval_s)]
        self._procs = [subprocess.Popen(cmd, pass_fds=(self._sock.fileno(),), stdin=subprocess.DEVNULL)
                       for _ in range(self.procs)]

    def restart(self) -> None:
        """New processes on the same address: the connections the old ones held are closed, as when an engine
        restarts on its port."""
        self._stop_procs()
        self._spawn()

    def __exit__(self, *exc: object) -> None:
        self._stop_procs()
        self._sock.close()

    def _stop_procs(self) -> None:
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return all(p.poll() is None for p in self._procs)


def client_class(fmt: str) -> type:
    """The rollout client the controller uses for that engine's answers."""
    if fmt == "sglang":
        from hybridrl.engines.sglang import _SGLangClient

        return _SGLangClient
    from hybridrl.engines.vllm import _VLLMClient

    return _VLLMClient


def fake_requests(n: int, tokens: int, stream_fraction: float) -> list[Request]:
    sampling = Sampling(max_new_tokens=tokens, ignore_eos=True)
    return [Request([1, 2, 3], sampling, stream=s) for s in stream_flags(n, stream_fraction)]


def _check(completions: list[Completion], tokens: int) -> None:
    """Every answer parsed whole: a ceiling of dropped events would be no ceiling."""
    for i, c in enumerate(completions):
        if c.error or len(c.token_ids) != tokens or len(c.logprobs) != tokens:
            raise RuntimeError(f"fake request {i}: {c.error or f'{len(c.token_ids)} of {tokens} tokens parsed'}")


def measure(fmt: str, requests: int = 128, tokens: int = 256, concurrency: int = 128, stream_fraction: float = 1.0,
            tokens_per_event: int = 1, event_interval_s: float = 0.0, seconds: float = 3.0, procs: int = 1,
            max_batches: int = 50, shared_pool: bool = False, keep_connections: bool = False) -> dict[str, Any]:
    """Batches of the same request set against the fake engine until `seconds` pass; the best batch's figures.
    `shared_pool`: the earlier client (one connection pool for all requests), which older results went through."""
    reqs = fake_requests(requests, tokens, stream_fraction)
    batches = []
    with FakeEngine(fmt, tokens_per_event, event_interval_s, procs) as server:
        client = client_class(fmt)(server, timeout_s=120.0, max_concurrency=concurrency, shared_pool=shared_pool,
                                   keep_connections=keep_connections)
        t_end = time.perf_counter() + seconds
        while not batches or (time.perf_counter() < t_end and len(batches) < max_batches):
            cpu0, t0 = time.process_time(), time.perf_counter()
            completions = client.generate(reqs)
            wall = time.perf_counter() - t0
            _check(completions, tokens)
            events = sum(c.events for c in completions)
            batches.append({"wall_s": wall, "tok_s": requests * tokens / wall, "events_s": events / wall,
                            "controller_cpu_pct": 100.0 * (time.process_time() - cpu0) / wall})
        client.close()
    best = max(batches, key=lambda b: b["tok_s"])
    kind = ("old (one shared pool)" if shared_pool else
            "new (a connection per slot, kept)" if keep_connections else "new (a connection per slot)")
    return {"format": fmt, "client": kind,
            "requests": requests, "tokens": tokens, "concurrency": concurrency,
            "stream_fraction": stream_fraction, "streamed_requests": sum(r.stream for r in reqs),
            "tokens_per_event": tokens_per_event, "event_interval_s": event_interval_s, "server_procs": procs,
            "batches": len(batches), "ceiling_tok_s": best["tok_s"], "events_s": best["events_s"],
            "controller_cpu_pct": best["controller_cpu_pct"],
            "median_tok_s": sorted(b["tok_s"] for b in batches)[len(batches) // 2]}


def run_ceiling(engine: str, requests: int, tokens: int, concurrency: int, stream_fraction: float,
                seconds: float, shared_pool: bool = False, keep_connections: bool = False) -> float | None:
    """A run's own ceiling, before its engine starts: its request shape and stream share, one token per event
    (SGLang's granularity, the client's worst case). None for in-process vLLM, which has no HTTP client."""
    fmt = {"sglang": "sglang", "vllm": "vllm"}.get(engine)
    if fmt is None or seconds <= 0:
        return None
    return measure(fmt, requests, tokens, concurrency, stream_fraction, seconds=seconds,
                   shared_pool=shared_pool, keep_connections=keep_connections)["ceiling_tok_s"]


def client_headroom_ok(throughput: float | None, ceiling: float | None) -> bool | None:
    """False where a rollout ran within HEADROOM of the client's ceiling: the client may have limited it."""
    if throughput is None or not ceiling:
        return None
    return throughput < HEADROOM * ceiling


def settings(fractions: list[float], tokens_per_event: list[int], old_client: bool) -> list[tuple[float, int, bool]]:
    """(stream fraction, tokens per event, shared pool) triples: granularity means nothing where nothing is
    streamed, and the old client streamed every request."""
    grid = [(f, k, False) for f in fractions for k in (tokens_per_event if f > 0 else tokens_per_event[:1])]
    return [(1.0, k, True) for k in tokens_per_event] * old_client + grid


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The benchmark's rows as the Markdown table the READMEs quote (a test holds them to the committed JSON)."""
    lines = ["| answers | client | streamed | tokens/event | ceiling tok/s | events/s | controller CPU |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        per_event = str(r["tokens_per_event"]) if r["streamed_requests"] else "-"
        lines.append(f"| {r['format']} | {r['client']} | {r['streamed_requests']}/{r['requests']} | {per_event} | "
                     f"{r['ceiling_tok_s']:,.0f} | {r['events_s']:,.0f} | {r['controller_cpu_pct']:.0f}% |")
    return "\n".join(lines) + "\n"


def main(formats: list[str], requests: int, tokens: int, concurrency: int, fractions: list[float],
         tokens_per_event: list[int], seconds: float, procs: int, out: Path | None,
         old_client: bool = True) -> list[dict[str, Any]]:
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    grid = [(fmt, *setting) for fmt in formats for setting in settings(fractions, tokens_per_event, old_client)]
    load_before = os.getloadavg()  # a busy host lowers the ceiling: the figures say how busy this one was
    rows = [measure(fmt, requests, tokens, concurrency, f, k, seconds=seconds, procs=procs, shared_pool=old)
            for fmt, f, k, old in track(grid, description="client ceiling", transient=True)]
    table = Table(title=f"rollout client ceiling: {requests} requests x {tokens} tokens, {concurrency} concurrent, "
                        f"{os.cpu_count()} CPUs")
    header, _, *body = markdown_table(rows).splitlines()
    for col in header.strip("| ").split(" | "):
        table.add_column(col, justify="right")
    for line in body:
        table.add_row(*line.strip("| ").split(" | "))
    Console().print(table)
    if out is not None:
        from hybridrl.run.provenance import write as write_json

        write_json(out, {"cpus": os.cpu_count(), "host": platform.node(), "processor": platform.processor(),
                         "python": platform.python_version(), "loadavg_1_5_15_before": load_before,
                         "loadavg_1_5_15_after": os.getloadavg(), "seconds_per_setting": seconds,
                         "settings": rows})
    return rows
