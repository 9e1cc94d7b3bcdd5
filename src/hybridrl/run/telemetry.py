"""Timers, rollout statistics, an NVML memory sampler tagged by phase, and the atomic per-step record."""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hybridrl import jsonl, nvml
from hybridrl.atomic import write_bytes
from hybridrl.engines.base import Completion
from hybridrl.engines.gpus import nvml_indices
from hybridrl.proc import descendants, stat_fields, thread_cpu_ticks
from hybridrl.run.record import (
    COMPARED_STEP,
    CONTROLLER_CPU_PHASES,
    GPU_LOAD_PHASES,
    HOST_LOAD_PHASES,
    INSTRUMENT_PHASES,
    PHASES,
)


def host_cpu_jiffies(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole host since boot, in clock ticks; None where /proc/stat is absent."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def parent_pid(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The parent of `pid` from /proc/<pid>/stat; None where the process is gone or not visible here."""
    fields = stat_fields(pid, proc)
    return int(fields[1]) if fields is not None and len(fields) > 1 else None


def foreign_pids(pids: set[int], root: int, proc: Path = Path("/proc")) -> set[int]:
    """The pids that are visible here and do not descend from `root` (this run's controller): another job's.
    A pid /proc does not show (another PID namespace) is not counted: it cannot be told apart."""
    out = set()
    for pid in pids:
        cur = parent_pid(pid, proc)
        if pid == root or cur is None:  # the controller itself, or not visible here
            continue
        chain = {pid}
        while cur not in (None, 0, 1, root) and cur not in chain:
            chain.add(cur)
            cur = parent_pid(cur, proc)
        if cur != root:
            out.add(pid)
    return out


ThreadTicks = dict[tuple[int, int], tuple[int, str]]  # (pid, tid) -> (CPU ticks, "process/thread")

# The kernel counts CPU time in clock ticks (10 ms at the usual 100 Hz): over a window of N ticks a reading is off
# by up to one tick a thread, 1/N of a core. Below this many ticks a phase gets no CPU reading: over a 2 ms wait a
# single tick read as 500% of a core.
MIN_CPU_WINDOW_TICKS = 20


def run_thread_ticks() -> ThreadTicks:
    """CPU time of every thread of this run: the controller and every process below it (engine servers, trainer
    workers); empty where /proc cannot be read."""
    try:
        return thread_cpu_ticks([os.getpid(), *descendants(os.getpid())])
    except OSError:
        return {}


def thread_load(before: ThreadTicks, after: ThreadTicks, seconds: float,
                tick_s: float = 1.0 / os.sysconf("SC_CLK_TCK")) -> dict[str, float | str | None]:
    """The run's CPU use between two readings: all its threads together and the busiest single thread, in % of
    one core, and that thread's name (a thread near 100% may limit the rollout or spin while it waits); a thread
    that started meanwhile counts from zero; none for a window shorter than MIN_CPU_WINDOW_TICKS."""
    if not after or seconds < MIN_CPU_WINDOW_TICKS * tick_s:
        return {"run_cpu_pct": None, "busiest_thread_cpu_pct": None, "busiest_thread": None}
    used = {key: ticks - before.get(key, (0, ""))[0] for key, (ticks, _) in after.items()}
    busiest = max(used, key=lambda key: used[key])
    pct = 100.0 * tick_s / seconds
    return {"run_cpu_pct": sum(used.values()) * pct, "busiest_thread_cpu_pct": used[busiest] * pct,
            "busiest_thread": after[busiest][1]}


def busy_pct(before: tuple[int, int] | None, after: tuple[int, int] | None,
             cpus: int = os.cpu_count() or 1) -> float | None:
    """The host's busy share between two host_cpu_jiffies readings, in %; none over fewer than
    MIN_CPU_WINDOW_TICKS ticks a CPU (the ticks of all CPUs together)."""
    if before is None or after is None or after[1] - before[1] < MIN_CPU_WINDOW_TICKS * cpus:
        return None
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


# where the time to read the run's threads around a watched phase is counted (see Timings.phase)
THREAD_READING_PHASE = "prepare"


class Timings:
    def __init__(self, cpu_reader: Callable[[], tuple[int, int] | None] = host_cpu_jiffies,
                 own_cpu: Callable[[], float] = time.process_time,
                 on_phase: Callable[[str], None] | None = None,
                 threads: Callable[[], ThreadTicks] = run_thread_ticks) -> None:
        self.on_phase = on_phase  # told each phase as it starts (the run's phase.json, for fault injection)
        self.s: dict[str, float] = {}
        self.busy: dict[str, float | None] = {}
        self.own: dict[str, float] = {}
        self.threads: dict[str, dict[str, float | str | None]] = {}
        self._cpu = cpu_reader
        self._own_cpu = own_cpu
        self._threads = threads

    @contextlib.contextmanager
    def phase(self, name: str, sampler: MemorySampler | None = None) -> Iterator[None]:
        if name not in CONTROLLER_CPU_PHASES:
            with self._timed(name, sampler):
                yield
            return
        # the run's threads are read just outside the phase, and the milliseconds of walking /proc count in
        # prepare (THREAD_READING_PHASE), so that the rollout's own time and throughput hold none of it
        w0 = time.perf_counter()
        before = self._threads()
        c0 = time.perf_counter()
        try:
            with self._timed(name, sampler):
                yield
        finally:
            c1 = time.perf_counter()
            after = self._threads()
            reading = (c0 - w0) + (time.perf_counter() - c1)
            self.s[THREAD_READING_PHASE] = self.s.get(THREAD_READING_PHASE, 0.0) + reading
            self.threads[name] = thread_load(before, after, c1 - c0)

    @contextlib.contextmanager
    def _timed(self, name: str, sampler: MemorySampler | None) -> Iterator[None]:
        t0 = time.perf_counter()  # first and last: all of the phase's own work counts in it
        if self.on_phase:
            self.on_phase(name)
        if sampler:
            sampler.set_phase(name)
        cpu0 = self._cpu() if name in HOST_LOAD_PHASES else None
        own0 = self._own_cpu()
        try:
            yield
        finally:
            if name in HOST_LOAD_PHASES:
                self.busy[name] = busy_pct(cpu0, self._cpu())
            own = self._own_cpu() - own0
            wall = time.perf_counter() - t0
            if name in CONTROLLER_CPU_PHASES and wall > 0:
                self.own[name] = 100.0 * own / wall
            self.s[name] = self.s.get(name, 0.0) + wall

    def move(self, seconds: float, source: str, to: str) -> None:
        """Count `seconds` of phase `source` as phase `to`: a part that was timed inside it (the adapter save
        inside the trainer's step)."""
        self.s[source] = self.s.get(source, 0.0) - seconds
        self.s[to] = self.s.get(to, 0.0) + seconds

    def compared_step(self) -> float | None:
        """The step less the instrument's own phases (record.INSTRUMENT_PHASES); None before the step is timed."""
        if "step" not in self.s:
            return None
        return self.s["step"] - sum(self.s.get(p, 0.0) for p in INSTRUMENT_PHASES)

    def record(self) -> dict[str, float | None]:
        """timing_s/* of every phase, the step and the compared step (null where this step had no such phase), host
        CPU load."""
        out: dict[str, float | None] = {f"timing_s/{k}": self.s.get(k) for k in (*PHASES, "step")}
        out[COMPARED_STEP] = self.compared_step()
        out.update({f"host/cpu_busy_pct_{k}": self.busy.get(k) for k in HOST_LOAD_PHASES})
        out.update({f"host/controller_cpu_pct_{k}": self.own.get(k) for k in CONTROLLER_CPU_PHASES})
        out.update({f"host/{key}_{k}": self.threads.get(k, {}).get(key) for k in CONTROLLER_CPU_PHASES
                    for key in ("run_cpu_pct", "busiest_thread_cpu_pct", "busiest_thread")})
        return out


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def rollout_stats(completions: list[Completion], gen_s: float) -> dict[str, float | None]:
    """Throughput over every request; TTFT, inter-token and TPOT statistics over the streamed ones only
    (a request answered whole has no token timings), end-to-end latency over all."""
    ok = [c for c in completions if c.error is None]
    streamed = [c for c in ok if c.streamed]
    streamed_tokens = sum(len(c.token_ids) for c in streamed)
    ttft = [c.ttft_s for c in ok if not math.isnan(c.ttft_s)]
    itl_ms = [x * 1000 for c in ok for x in c.itl_s]
    latency = [c.latency_s for c in ok if not math.isnan(c.latency_s)]
    tpot_ms = [t * 1000 for c in ok if (t := c.tpot_s) is not None]
    # the engine's own per-request timing (run key engine_timing): every request, streamed or whole
    engine_ttft = [c.engine_ttft_s for c in ok if not math.isnan(c.engine_ttft_s)]
    engine_tpot_ms = [c.engine_tpot_s * 1000 for c in ok if not math.isnan(c.engine_tpot_s)]
    tokens = sum(len(c.token_ids) for c in ok)
    return {
        "perf/gen_tokens": float(tokens),
        "perf/throughput": tokens / gen_s if gen_s > 0 else None,
        "perf/ttft_s_mean": _mean(ttft), "perf/ttft_s_p50": _pct(ttft, 50), "perf/ttft_s_p99": _pct(ttft, 99),
        "perf/itl_ms_mean": _mean(itl_ms), "perf/itl_ms_p50": _pct(itl_ms, 50),
        "perf/itl_ms_p99": _pct(itl_ms, 99),
        "perf/tpot_ms_mean": _mean(tpot_ms), "perf/tpot_ms_p50": _pct(tpot_ms, 50),
        "perf/tpot_ms_p99": _pct(tpot_ms, 99),
        "perf/latency_s_p50": _pct(latency, 50), "perf/latency_s_p99": _pct(latency, 99),
        "perf/engine_ttft_s_p50": _pct(engine_ttft, 50), "perf/engine_ttft_s_p99": _pct(engine_ttft, 99),
        "perf/engine_tpot_ms_p50": _pct(engine_tpot_ms, 50), "perf/engine_tpot_ms_p99": _pct(engine_tpot_ms, 99),
        "perf/engine_timed_requests": float(len(engine_ttft)),
        "errors/requests_failed": float(len(completions) - len(ok)),
        "perf/streamed_requests": float(len(streamed)),
        # 1 for SGLang's token-by-token stream; how much per-event work the client does per token
        "perf/events_per_token": sum(c.events for c in streamed) / streamed_tokens if streamed_tokens else None,
        "response_length/mean": _mean([len(c.token_ids) for c in ok]),
    }


def limiting(gpus: Iterable[nvml.Conditions]) -> nvml.Conditions | None:
    """The run's GPUs at one read as one GPU that limits a step: the slowest clock, the highest power and
    temperature, and whether any was slowed; None where no GPU answered."""
    gpus = list(gpus)
    if not gpus:
        return None
    return nvml.Conditions(min(g.sm_mhz for g in gpus), max(g.power_w for g in gpus), max(g.temp_c for g in gpus),
                           any(g.slowed for g in gpus))


def gpu_summary(states: list[nvml.Conditions], phase: str) -> dict[str, float | None]:
    """gpu/* of one phase: median SM clock, mean power, highest temperature, share of reads slowed."""
    if not states:
        return {f"gpu/{name}_{phase}": None for name in ("sm_clock_mhz", "power_w", "temp_c", "slowdown_frac")}
    return {f"gpu/sm_clock_mhz_{phase}": float(np.median([s.sm_mhz for s in states])),
            f"gpu/power_w_{phase}": float(np.mean([s.power_w for s in states])),
            f"gpu/temp_c_{phase}": max(s.temp_c for s in states),
            f"gpu/slowdown_frac_{phase}": float(np.mean([s.slowed for s in states]))}


class MemorySampler:
    """Samples NVML used memory per GPU in a thread (default 50 Hz), tagged with the current phase, and every
    `conditions_every`-th time the GPUs' SM clock, power, temperature and slowdown (gpu/* of GPU_LOAD_PHASES).

    NVML, not torch: torch's counters miss cumem (vLLM sleep) and torch_memory_saver (SGLang) memory.
    Without a GPU or NVML it records nothing and reports no mem/* or gpu/* values.
    """

    def __init__(self, gpu_indices: list[int] | None = None, hz: float = 50.0, conditions_every: int = 5) -> None:
        self.period = 1.0 / hz
        self.conditions_every = conditions_every
        self.phase = "idle"
        self.samples: dict[str, list[float]] = defaultdict(list)  # phase -> max-over-GPUs used GB
        self.per_gpu: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.conditions: dict[str, list[nvml.Conditions]] = defaultdict(list)  # phase -> limiting(), one per read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if gpu_indices is None:  # this process's GPUs (CUDA_VISIBLE_DEVICES), else every GPU
            gpu_indices = nvml_indices()
        self._devices = nvml.open_devices(gpu_indices)  # None on a CPU machine
        self.foreign: set[int] = set()  # GPU processes of other jobs seen this step (foreign_pids)
        self._root = os.getpid()
        self._thread = threading.Thread(target=self._loop, daemon=True) if self.active else None

    @property
    def active(self) -> bool:
        return self._devices is not None and bool(self._devices.handles)

    def start(self) -> MemorySampler:
        if self._thread:
            self._thread.start()
        return self

    def memory_gb(self) -> dict[int, tuple[float, float]]:
        """The run's GPUs' (used, total) memory now, by NVML index; empty without NVML."""
        with self._lock:
            return self._devices.memory_gb() if self._devices is not None else {}

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
        if self._devices is not None:  # a few times a step: cheap enough, and a job beside us shows up
            self.foreign |= foreign_pids(self._devices.compute_pids(), self._root)

    def _loop(self) -> None:
        tick = 0
        while not self._stop.is_set():
            used = self._devices.used_gb() if self._devices else {}
            read = tick % self.conditions_every == 0 and self._devices is not None
            state = limiting(self._devices.conditions().values()) if read else None
            tick += 1
            if not used:  # no GPU answered this time
                time.sleep(self.period)
                continue
            with self._lock:
                self.samples[self.phase].append(max(used.values()))
                for i, gb in used.items():
                    self.per_gpu[self.phase][i].append(gb)
                if state is not None:
                    self.conditions[self.phase].append(state)
            time.sleep(self.period)

    def take(self) -> dict[str, float | None]:
        """mem/* for the step so far, then start a new step."""
        with self._lock:
            samples, per_gpu = dict(self.samples), {p: dict(g) for p, g in self.per_gpu.items()}
            states = dict(self.conditions)
            self.samples.clear()
            self.per_gpu.clear()
            self.conditions.clear()
        foreign, self.foreign = self.foreign, set()
        if not self.active:
            return {}
        out: dict[str, float | None] = {"mem/peak_gb": max((max(v) for v in samples.values() if v), default=None),
                                        "host/foreign_gpu_procs": float(len(foreign))}
        for phase, values in samples.items():
            out[f"mem/used_gb_{phase}"] = float(np.mean(values)) if values else None
            out[f"mem/peak_gb_{phase}"] = max(values) if values else None
            for gpu, vals in per_gpu.get(phase, {}).items():
                out[f"mem/gpu{gpu}_used_gb_{phase}"] = float(np.mean(vals))
        for phase in GPU_LOAD_PHASES:
            out.update(gpu_summary(states.get(phase, []), phase))
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread and self._thread.is_alive():
            self._thread.join(timeout=2)
        if self._devices is not None and not (self._thread and self._thread.is_alive()):
            self._devices.close()
            self._devices = None


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line so that a crash leaves either the old file or the old file plus this line.

    The whole file is rewritten to a temp file and renamed: steps.jsonl stays small (one line a step).
    """
    old = path.read_bytes() if path.exists() else b""
    write_bytes(path, old + (json.dumps(record, allow_nan=True) + "\n").encode(), fsync=True)


class RecordError(RuntimeError):
    """A steps.jsonl that hybridrl did not write whole (append_record never leaves a torn line)."""


def read_records(path: Path) -> list[dict[str, Any]]:
    """A run's records; RecordError naming the file and line where one is not a JSON object."""
    if not path.exists():
        return []
    return jsonl.objects(path.read_text(), path, "step record", RecordError,
                         hint="; hybridrl never writes a torn line, so the file was changed or damaged: move it "
                         "aside to record the run anew")
