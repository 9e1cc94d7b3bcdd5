"""An engine server as a child process group on 127.0.0.1, and HTTP rollouts against it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from hybridrl.atomic import naming
from hybridrl.engines.base import Completion, EngineError, Request, SleepStages, SleepVariant, context_length
from hybridrl.engines.client_process import ClientProcess
from hybridrl.engines.gpus import nvml_indices, started_readings
from hybridrl.engines.rollout_loop import KeptClients, run_bounded
from hybridrl.engines.startup import header, split_start
from hybridrl.study.run_config import RunConfig

LOG_TAIL_LINES = 40
FATAL_GRACE_S = 30.0  # after a fatal startup line, how long the server gets to exit by itself


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that no process on this host listens on now: the kernel picks each (port 0), and all are
    held until every one is picked, so that none comes back twice. Jobs on one node share its ports; a fixed number
    would collide with the same number in the job beside."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(n):
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


class PortClaims:
    """`n` free ports, claimed on this node until release(). The kernel hands out a port free now; a job beside may
    draw the same one before the engine binds it. So each port is also claimed by name, as an abstract unix socket,
    which every job of the node's network namespace sees and which ends with its process; a port another job has
    claimed is drawn again."""

    def __init__(self, n: int, draws: int = 50) -> None:
        self.ports: list[int] = []
        self._held: list[socket.socket] = []
        for _ in range(draws):
            self.ports += [port for port in free_ports(n - len(self.ports)) if self._claim(port)]
            if len(self.ports) == n:
                return
        self.release()
        raise EngineError(f"found no {n} free port(s) on this node that no other job had claimed in {draws} draws")

    def _claim(self, port: int) -> bool:
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0hybridrl-port-{port}")
        except OSError:  # claimed already, by another job or by this one
            claim.close()
            return False
        self._held.append(claim)
        return True

    def release(self) -> None:
        for claim in self._held:
            claim.close()
        self._held = []


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.exists():
        return "(no log written)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def first_error_line(path: Path, start: int = 0) -> str | None:
    """The first line of an engine log, from byte `start` on, that names an exception: the root cause,
    before the cascade. `start` skips earlier starts in a log that each start appends to."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    for line in text.splitlines():
        # a raised exception starts its line or follows the logger's "[file:line] " prefix
        if re.search(r"(?:^|\] )[\w.]+(?:Error|Exception): ", line):
            return line.strip()
    return None


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the controller dies without cleaning up (SIGKILL, OOM)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """Owns one server's process group: start, health wait, liveness, and a stop that leaves nothing."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path, port: int,
                 fatal_markers: tuple[str, ...] = ()) -> None:
        self.name, self.cmd, self.env, self.log_path, self.port = name, cmd, env, log_path, port
        # log lines after which the server will never become healthy, though it may not exit (a vLLM
        # engine core whose workers hit a CUDA fault hung in its teardown for 10 minutes on 4 x H200)
        self.fatal_markers = fatal_markers
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.log_start = 0
        self.spawned_at: datetime | None = None  # local time, as the engines stamp their log lines

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if port_in_use(self.port):
            raise EngineError(f"{self.name}: port {self.port} on 127.0.0.1 is already in use")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        try:
            self._log.write(header(" ".join(self.cmd), datetime.now()).encode())
            self._log.flush()
        except OSError as exc:  # a full disk: name the log, not 'a file'
            raise naming(exc, self.log_path) from exc
        self.log_start = self._log.tell()  # this start's output begins here (the log is appended to)
        self.spawned_at = datetime.now()
        try:
            # own session = own process group, so stop() can take down every worker it forks
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        except OSError as exc:
            self._log.close()
            raise EngineError(f"{self.name}: cannot execute {self.cmd[0]}: {exc}") from exc

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_since_start(self) -> str:
        """What this start has written to the log so far (the log holds every earlier start's too)."""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_start)
            return f.read().decode(errors="replace")

    def wait_healthy(self, timeout_s: float, health_path: str = "/health") -> float:
        """Poll until the server answers; on death or timeout stop it and raise with the log's tail."""
        t0 = time.monotonic()
        offset, fatal_at = self.log_start, None
        with httpx.Client(timeout=5.0) as client:
            while True:
                if not self.alive():
                    code = self.proc.returncode if self.proc else None
                    self.stop()
                    raise EngineError(f"{self.name} exited with code {code} while starting; last lines of "
                                      f"{self.log_path}:\n{log_tail(self.log_path)}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.base_url + health_path).status_code == 200:
                        return time.monotonic() - t0
                if fatal_at is None:
                    marker, offset = self._fatal_marker_since(offset)
                    fatal_at = (marker, time.monotonic()) if marker else None
                elif time.monotonic() - fatal_at[1] > FATAL_GRACE_S:
                    self.stop()
                    cause = first_error_line(self.log_path, self.log_start)
                    raise EngineError(f"{self.name} failed while starting ({fatal_at[0]!r} in its log) and did "
                                      f"not exit within {FATAL_GRACE_S:.0f} s, so it was stopped"
                                      + (f"; first error: {cause}" if cause else "")
                                      + f"; last lines of {self.log_path}:\n{log_tail(self.log_path)}")
                if time.monotonic() - t0 > timeout_s:
                    self.stop()
                    raise EngineError(f"{self.name} not healthy after {timeout_s:.0f} s; last lines of "
                                      f"{self.log_path}:\n{log_tail(self.log_path)}")
                time.sleep(0.5)

    def _fatal_marker_since(self, offset: int) -> tuple[str | None, int]:
        """The first fatal marker written to the log after byte `offset`, and the offset to read from next."""
        if not self.fatal_markers or not self.log_path.exists():
            return None, offset
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        # a marker split across two reads is found on the next one: reread from the last line start
        cut = chunk.rfind(b"\n") + 1
        text = chunk[:cut].decode(errors="replace")
        return next((m for m in self.fatal_markers if m in text), None), offset + cut

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # the group may outlive its leader (engine workers); make sure none is left
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.proc = None
        if self._log:
            self._log.close()
            self._log = None


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """A server-sent-event stream's lines, split at line feeds only.

    httpx's aiter_lines() splits like str.splitlines(), also at U+0085, U+2028 and U+2029, which JSON
    carries unescaped: a token that decodes to one of them cut its event in two (one request in a few
    hundred failed with "Unterminated string" on the H200 runs, from a random-init model's byte tokens).
    """
    pending = ""
    async for text in response.aiter_text():
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


class RolloutClient:
    """Sends many generate requests concurrently from one asyncio client.

    A request with `stream` set is streamed and timed token by token (TTFT, inter-token gaps); the others
    come back in one response each. Streaming every request made this client the bottleneck on an H200
    (SGLang sends one event per token; one Python client parsed them at about 8k tokens/s), so a run
    streams only `stream_fraction` of its requests, enough for the latency statistics.
    Subclasses give the URL, the request body and how to read token ids and logprobs from a chunk; the
    same `parse` reads a whole non-streamed response (all tokens, none seen before).
    """

    url_path = "/v1/completions"

    def __init__(self, server: ServerProcess, timeout_s: float, max_concurrency: int,
                 shared_pool: bool = False, keep_connections: bool = False) -> None:
        self.server, self.timeout_s, self.max_concurrency = server, timeout_s, max_concurrency
        # the earlier client (one pool for every connection, made anew each rollout), kept so that the benchmarks
        # can measure what the older committed results were recorded through
        self.shared_pool = shared_pool
        self.keep_connections = keep_connections
        self._kept = KeptClients(lambda: self._client(1))  # one connection a slot, kept from rollout to rollout

    def body(self, req: Request) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, chunk: dict[str, Any], seen: int = 0) -> tuple[list[int], list[float], str | None]:
        """-> (new token ids, their logprobs, finish reason or None); `seen` tokens came before."""
        raise NotImplementedError

    def timing(self, answer: dict[str, Any]) -> tuple[float, float]:
        """(TTFT, TPOT) in seconds as the engine timed a whole answer, NaN where it reports none."""
        return float("nan"), float("nan")

    def completion(self, answer: dict[str, Any], latency_s: float) -> Completion:
        """A whole non-streamed answer as a Completion: the client cannot time its tokens, the engine may have."""
        if "error" in answer:
            return Completion(error=f"engine error: {json.dumps(answer['error'])[:500]}")
        ids, lps, finish = self.parse(answer, 0)
        ttft, tpot = self.timing(answer)
        return Completion(token_ids=ids, logprobs=lps, finish_reason=finish, latency_s=latency_s,
                          engine_ttft_s=ttft, engine_tpot_s=tpot)

    async def _streamed(self, client: httpx.AsyncClient, req: Request, out: Completion, t0: float) -> None:
        out.streamed = True
        async with client.stream("POST", self.server.base_url + self.url_path, json=self.body(req)) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:500]
                out.error = f"HTTP {r.status_code}: {text}"
                return
            async for line in sse_lines(r):
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:  # servers report mid-stream failures as an error event
                    out.error = f"engine error: {json.dumps(chunk['error'])[:500]}"
                    return
                ids, lps, finish = self.parse(chunk, len(out.token_ids))
                out.add_tokens(ids, lps, time.perf_counter(), t0)
                if finish:
                    out.finish_reason = finish
                if finish or not ids:  # the engine's timing rides on a stream's last events, if it sends any
                    ttft, tpot = self.timing(chunk)
                    if math.isfinite(ttft):
                        out.engine_ttft_s, out.engine_tpot_s = ttft, tpot
        out.latency_s = time.perf_counter() - t0

    async def _one(self, client: httpx.AsyncClient, req: Request) -> Completion:
        out = Completion()
        t0 = time.perf_counter()
        try:
            if req.stream:
                await self._streamed(client, req, out, t0)
            else:
                r = await client.post(self.server.base_url + self.url_path, json=self.body(req))
                if r.status_code != 200:
                    out.error = f"HTTP {r.status_code}: {r.text[:500]}"
                else:
                    out = self.completion(r.json(), time.perf_counter() - t0)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, EngineError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        return out

    def _client(self, connections: int) -> httpx.AsyncClient:
        # verify=False: plain HTTP on 127.0.0.1, and loading the CA bundle costs ~40 ms per client
        return httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=10.0), verify=False,
                                 limits=httpx.Limits(max_connections=connections))

    async def _all(self, requests: list[Request], tick, kept: list[httpx.AsyncClient] | None) -> list[Completion]:
        """`max_concurrency` workers, each with its own one-connection client (`kept`'s, else made for this
        call), take the requests in order.

        Not one shared pool (`shared_pool`, the old way): httpcore scans every pooled connection for each
        request it places, so with 128 connections that scan alone took about 10 ms of CPU per request.
        """
        results: list[Completion] = [Completion()] * len(requests)
        todo = iter(range(len(requests)))
        slots = max(1, min(self.max_concurrency, len(requests)))

        async def worker(c: httpx.AsyncClient) -> None:
            for i in todo:
                results[i] = await self._one(c, requests[i])
                tick()

        async def own(shared: httpx.AsyncClient | None) -> None:
            async with contextlib.nullcontext(shared) if shared else self._client(1) as c:
                await worker(c)

        if kept is not None:
            await asyncio.gather(*(worker(c) for c in kept[:slots]))
        elif self.shared_pool:
            async with self._client(slots) as shared:
                await asyncio.gather(*(own(shared) for _ in range(slots)))
        else:
            await asyncio.gather(*(own(None) for _ in range(slots)))
        return results

    def collect(self, requests: list[Request], tick: Callable[[], None] = lambda: None) -> list[Completion]:
        """Every request's completion (failures as errors in it), in order; `tick` after each one."""
        if self.shared_pool or not self.keep_connections:
            return run_bounded(self._all(requests, tick, None))
        slots = max(1, min(self.max_concurrency, len(requests)))
        return self._kept.run(lambda kept: self._all(requests, tick, kept), slots)

    def close(self) -> None:
        """Close the kept connections (the engine stops)."""
        self._kept.close()

    def check_alive(self) -> None:
        """EngineError, with the server log's tail, where the server died (its answers may have been cut)."""
        if not self.server.alive():
            raise EngineError(f"{self.server.name} died during the rollout; last lines of "
                              f"{self.server.log_path}:\n{log_tail(self.server.log_path)}")

    def generate(self, requests: list[Request], progress: bool = False) -> list[Completion]:
        from rich.progress import Progress

        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task(f"rollout ({len(requests)} requests)", total=len(requests))
            results = self.collect(requests, lambda: bar.advance(task))
        self.check_alive()
        return results


def raw_stream_lines(url: str, body: dict[str, Any], keep: int = 3, timeout_s: float = 60.0) -> list[str]:
    """The first and last `keep` raw event lines of one streamed request."""
    with httpx.stream("POST", url, json=body, timeout=timeout_s) as r:
        lines = [line[:1500] for line in r.iter_lines() if line.strip()]
    return lines[:keep] + (["..."] if len(lines) > 2 * keep else []) + lines[-keep:]


def post_json(base_url: str, path: str, payload: dict | None = None, timeout_s: float = 120.0,
              method: str = "POST", client: httpx.Client | None = None) -> httpx.Response:
    """One control call with a timeout, through `client` (a kept connection) or a client made for it; a non-2xx
    answer raises EngineError naming the route."""
    try:
        if client is not None:
            r = client.request(method, base_url + path, json=payload, timeout=timeout_s)
        else:  # httpx's own client, which loads the CA bundle each call, as every earlier result paid
            r = httpx.request(method, base_url + path, json=payload, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise EngineError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
    if r.status_code >= 300:
        raise EngineError(f"{method} {path} answered {r.status_code}: {r.text[:500]}")
    return r


# Snakemake caps these at the job's `threads` for the controller; an engine sizes its own pool (vLLM's
# CPU build binds its OpenMP threads to cores and slowed ~6x when it inherited OMP_NUM_THREADS=2).
THREAD_CAPS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def engine_environ() -> dict[str, str]:
    """The controller's environment minus what must not leak into an engine's own environment."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_CAPS}
    env.pop("PYTHONPATH", None)  # the engine has its own environment (overlay)
    return env


def resolve_python(python: str) -> str:
    """A relative interpreter path in a config means the repository's (e.g. .venvs/vllm-cpu/bin/python)."""
    from hybridrl.study.config import REPO

    if "/" in python and not Path(python).is_absolute():
        return str(REPO / python)
    return python


def package_version(python: str, packages: list[str], env: dict[str, str] | None = None) -> str | None:
    """The first of `packages` installed for the engine's own interpreter and environment (overlay)."""
    import subprocess

    code = ("import importlib.metadata as m, sys\n"
            "for p in sys.argv[1:]:\n"
            "    try:\n        print(m.version(p)); break\n"
            "    except m.PackageNotFoundError:\n        pass")
    try:
        out = subprocess.run([python, "-c", code, *packages], capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def max_model_len(model: Path) -> int:
    """The checkpoint's context length, capped (base.context_length)."""
    return context_length(json.loads((model / "config.json").read_text()))


def model_dtype(model: Path) -> str:
    """The checkpoint's own dtype: vLLM's CPU build would otherwise pick bfloat16 for a float32 model."""
    cfg = json.loads((model / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto")


class HTTPEngine:
    """What every server engine shares: its process, its stream client, the warm-up and adapter names.

    Subclasses give `name`, `stream_cls`, `command()`, `environment()` and the engine's own routes.
    """

    name = "engine"
    has_http_client = True
    in_controller = False
    packages: tuple[str, ...] = ()  # distribution names, any one of which is the engine (for preflight, provenance)
    stream_cls: type[RolloutClient] = RolloutClient
    health_path = "/health"
    fatal_markers: tuple[str, ...] = ()  # startup log lines after which the server never gets healthy
    # ports the server's own processes listen on besides its HTTP port, each taken free at every start
    own_ports: tuple[str, ...] = ()
    on_ports: Callable[[dict[str, int]], None] | None = None  # engines.base.Engine.on_ports

    def __init__(self, model: Path, run: RunConfig, env_spec: dict[str, Any], log_dir: Path) -> None:
        self.model, self.run, self.log_dir = model, run, log_dir
        self.python = resolve_python(env_spec.get("python", "python"))
        self.extra_env = dict(env_spec.get("env", {}))
        self.server: ServerProcess | None = None
        self.stream: RolloutClient | None = None
        self._control: httpx.Client | None = None  # the control calls' kept connection (keep_connections)
        self._loaded: set[str] = set()
        self._metrics: dict[str, float | None] = {}
        self._version: str | None = None
        self.ports: dict[str, int] = {}  # the last start's, by kind (provenance.PORT_KINDS)
        self._start_parts: list[dict[str, float | None]] = []
        self._claims: PortClaims | None = None
        # rollout_process: the client runs in a worker process, away from the trainer's interpreter lock
        self._client_process = ClientProcess() if run.rollout_process else None

    def command(self, port: int, adapter: tuple[str, Path] | None) -> list[str]:
        raise NotImplementedError

    def preflight(self) -> str:
        """The engine's installed version, before anything is built or started; EngineError where its interpreter
        or its package is missing (a trainer can take minutes to build before the server would have said so)."""
        import shutil

        if shutil.which(self.python) is None:
            raise EngineError(f"{self.name}: no Python interpreter {self.python!r} for the engine (its env's "
                              "'python' in the study config)")
        version = self.installed_version()
        if version is None:
            pythonpath = self.environment().get("PYTHONPATH")
            where = f" with PYTHONPATH={pythonpath}" if pythonpath else ""
            raise EngineError(f"{self.name} is not installed for {self.python}{where}: none of "
                              f"{', '.join(self.packages)} is importable there; install the engine's environment "
                              "(on the leased GPU machine: its overlay, scripts/gpu/lease.sh prepare)")
        return version

    def installed_version(self) -> str | None:
        """The engine package's version for its own interpreter and environment, asked once (a subprocess)."""
        if self._version is None:
            self._version = package_version(self.python, list(self.packages), self.environment())
        return self._version

    def environment(self) -> dict[str, str]:
        raise NotImplementedError

    def _swap_adapter(self, name: str, path: Path, unload_route: str, load_route: str) -> httpx.Response:
        """Load an adapter under `name`, unloading what that name held first; returns the load's answer."""
        if name in self._loaded:
            self._post(unload_route, {"lora_name": name})
            self._loaded.discard(name)
        answer = self._post(load_route, {"lora_name": name, "lora_path": str(path)})
        self._loaded.add(name)
        return answer

    # -- process -----------------------------------------------------------------------------------
    def start(self, adapter: tuple[str, Path] | None = None) -> float:
        from hybridrl.engines.base import Sampling

        started = time.perf_counter()
        self._release_ports()  # a start that failed kept its claims
        kinds = ("engine_http", *self.own_ports)
        self._claims = PortClaims(len(kinds))
        self.ports = dict(zip(kinds, self._claims.ports, strict=True))
        port = self.ports["engine_http"]
        self.server = ServerProcess(self.name, self.command(port, adapter), self.environment(),
                                    self.log_dir / "engine.log", port, self.fatal_markers)
        self.server.start()
        if self.on_ports is not None:
            self.on_ports(dict(self.ports))
        elapsed = self.server.wait_healthy(self.run.startup_timeout_s, health_path=self.health_path)
        healthy = datetime.now()
        if self.stream is not None:  # the last start's connections went to a server that is gone
            self.stream.close()
        self.stream = self.stream_cls(self.server, self.run.request_timeout_s, self.run.max_concurrency,
                                      shared_pool=self.run.shared_pool, keep_connections=self.run.keep_connections)
        # the first request pays one-off kernel compilation (and rollout_process's worker its start); count it as
        # start-up, not as rollout
        t0 = time.perf_counter()
        try:
            warm = self.generate([Request([1, 2, 3], Sampling(max_new_tokens=2, temperature=0.0))])[0]
        except EngineError:
            self.stop()
            raise
        if warm.error:
            log = self.server.log_path
            cause = first_error_line(log, self.server.log_start)  # this start's, not an earlier one's
            self.stop()
            raise EngineError(f"{self.name}: warm-up request failed: {warm.error}"
                              + (f"\n  first error in {log}: {cause}" if cause else f"\n  see {log}"))
        self._loaded = {adapter[0]} if adapter else set()
        now = time.perf_counter()
        self._start_parts.append(split_start(self.server.log_since_start(), self.name, self.server.spawned_at,
                                             healthy, now - started, now - t0))
        self._metrics.update(started_readings(self.gpus()))
        return elapsed + now - t0

    @property
    def start_parts(self) -> list[dict[str, float | None]]:
        """Every start's parts, in order (engines.base.Engine.start_parts)."""
        return self._start_parts

    def stop(self) -> None:
        if self._client_process is not None:
            self._client_process.close()
        if self.stream is not None:
            self.stream.close()
        if self._control is not None:
            self._control.close()
            self._control = None
        if self.server:
            self.server.stop()
        self.server = None
        self._release_ports()

    def _release_ports(self) -> None:
        if self._claims is not None:
            self._claims.release()
        self._claims = None

    def alive(self) -> bool:
        return bool(self.server and self.server.alive())

    def generate(self, requests: list[Request], progress: bool = False, shared_pool: bool = False) -> list[Completion]:
        if not self.stream:
            raise EngineError(f"{self.name}: generate() before start()")
        client = self.stream
        if shared_pool and not client.shared_pool:
            client = type(client)(client.server, client.timeout_s, client.max_concurrency, shared_pool=True)
        if self._client_process is None:
            return client.generate(requests, progress)
        results = self._client_process.collect(client, requests)  # no progress bar from the worker
        client.check_alive()
        return results

    def generate_raw(self, requests: list[Request]) -> list[Completion]:
        """The requests, none streamed, from a pool of threads that each keep one plain HTTP connection:
        no asyncio, no rollout client; what the engine delivers when nothing else limits it."""
        from hybridrl.engines.raw_http import post_all

        if not self.stream:
            raise EngineError(f"{self.name}: generate_raw() before start()")
        bodies = [self.stream.body(dataclasses.replace(r, stream=False)) for r in requests]
        answers = post_all(self._url(), self.stream.url_path, bodies, self.run.max_concurrency,
                           self.run.request_timeout_s)
        return [Completion(error=a) if isinstance(a, str) else self.stream.completion(a, t) for t, a in answers]

    def step_metrics(self) -> dict[str, float | None]:
        """NVML memory on the engine's GPUs right after the last sleep and wake; then forget them."""
        out, self._metrics = self._metrics, {}
        return out

    def gpus(self) -> list[int] | None:
        """NVML indices of the engine's GPUs (None: every GPU)."""
        return nvml_indices(self.environment())

    def sleep_stages(self) -> SleepStages | None:
        return None

    def sleep_variants(self) -> list[SleepVariant]:
        raise NotImplementedError

    def probe_info(self, request: Request) -> dict[str, Any]:
        """The first and last raw stream events of `request`, as the server sent them."""
        if not self.stream:
            raise EngineError(f"{self.name}: probe_info() before start()")
        return {"stream_sample": raw_stream_lines(self._url() + self.stream.url_path, self.stream.body(request))}

    def _url(self) -> str:
        if not self.server:
            raise EngineError(f"{self.name}: not started")
        return self.server.base_url

    def _post(self, path: str, payload: dict | None = None, timeout_s: float = 120.0,
              method: str = "POST") -> httpx.Response:
        """A control call to this engine's server (post_json), over the kept connection with keep_connections."""
        if self._control is None and self.run.keep_connections:
            # plain HTTP on 127.0.0.1: no CA bundle to load
            self._control = httpx.Client(verify=False)
        return post_json(self._url(), path, payload, timeout_s=timeout_s, method=method, client=self._control)
