"""What the rollout client costs a Python thread beside it: the trainer's, in an overlapped split run.

A trainer's thread spends its update calling torch operators, each of which lets go of the interpreter lock while
its kernel runs or launches and must take it back afterwards. A rollout client in the same process (a thread)
parses each streamed event with the lock held, so every hand-back can wait for it. This benchmark times a loop of
small torch operators (on the CPU a stand-in for the update's launches; `--device cuda`: real kernel launches), or
one real trainer update (`--trainer`), alone, beside the controller's real rollout client in a thread, and beside
the same client in a worker process (`rollout_process`), while the client reads batches from the fake engine of
`client-ceiling`, paced to a rate an H200 delivers.

    python -m hybridrl client-gil --format sglang vllm --stream-fraction 0 0.125 --out bench.json
    python -m hybridrl client-gil --trainer hf --device cuda --workdir W --stream-fraction 0.125 --event-interval 0.01
"""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hybridrl.engines.client_ceiling import FakeEngine, client_class, fake_requests
from hybridrl.engines.client_process import ClientProcess


def launch_loop(ops: int, device: str = "cpu") -> float:
    """Seconds for `ops` rounds of three small torch operators, one thread: on a CPU a stand-in for a trainer's
    launches, on a GPU (`cuda`) the launches themselves, waited for at the end."""
    import torch

    x, w = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(ops):
        x = torch.tanh(x @ w) * 0.5
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


class _Client:
    """Batches of the same requests, one after the other, until stopped; in a thread or through a worker."""

    def __init__(self, client: Any, requests: list, worker: ClientProcess | None) -> None:
        self.client, self.requests, self.worker = client, requests, worker
        self.started = self.finished = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.started += 1
            if self.worker is None:
                self.client.collect(self.requests)
            else:
                self.worker.collect(self.client, self.requests)
            self.finished += 1

    def __enter__(self) -> _Client:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _beside(client: Any, requests: list, through: ClientProcess | None | bool, work: Callable[[], float],
            settle_s: float) -> tuple[float, bool]:
    """(the work's seconds, whether one batch was in flight from its start to its end); `through` False: no
    client at all (None: the client in a thread, a ClientProcess: in that worker)."""
    if through is False:
        return work(), True
    with _Client(client, requests, through or None) as running:
        time.sleep(settle_s)  # the batch under way
        before = (running.started, running.finished)
        seconds = work()
        covered = before == (running.started, running.finished) and before[0] > before[1]
    return seconds, covered


def rounds_beside(work: Callable[[], float], fmt: str, stream_fraction: float, requests: int = 128,
                  tokens: int = 256, event_interval_s: float = 0.006, repeats: int = 5,
                  settle_s: float = 0.3) -> dict[str, Any]:
    """Rounds of the three modes in turn (alone, beside the client's thread, beside its worker), so that a host's
    drift touches all three alike: the work's median seconds per mode and the median and range of each mode's
    ratio to the same round's work alone. `{mode}_covered`: the rounds in which one batch was in flight for the
    whole work (with nothing streamed, its whole answers come at the batch's end: the client waits meanwhile)."""
    reqs = fake_requests(requests, tokens, stream_fraction)
    times: dict[str, list[float]] = {"alone": [], "thread": [], "process": []}
    covered = {"thread": 0, "process": 0}
    worker = ClientProcess()
    try:
        with FakeEngine(fmt, event_interval_s=event_interval_s, procs=2) as server:
            client = client_class(fmt)(server, timeout_s=120.0, max_concurrency=requests)
            worker.collect(client, reqs[:1])  # the worker's start and imports stay out of the timing
            for _ in range(repeats):
                for mode, through in (("alone", False), ("thread", None), ("process", worker)):
                    seconds, spanned = _beside(client, reqs, through, work, settle_s)
                    times[mode].append(seconds)
                    if mode in covered:
                        covered[mode] += spanned
    finally:
        worker.close()
    row: dict[str, Any] = {"format": fmt, "stream_fraction": stream_fraction,
                           "streamed_requests": sum(r.stream for r in reqs), "requests": requests, "tokens": tokens,
                           "event_interval_s": event_interval_s, "repeats": repeats}
    row.update({f"{mode}_s": statistics.median(t) for mode, t in times.items()})
    for mode in ("thread", "process"):
        ratios = [t / a for t, a in zip(times[mode], times["alone"], strict=True)]
        row.update({f"{mode}_x": statistics.median(ratios), f"{mode}_x_min": min(ratios),
                    f"{mode}_x_max": max(ratios), f"{mode}_covered": covered[mode]})
    return row


def measure(fmt: str, stream_fraction: float, requests: int = 128, tokens: int = 256, event_interval_s: float = 0.006,
            ops: int = 15000, repeats: int = 5, settle_s: float = 0.3, device: str = "cpu") -> dict[str, Any]:
    """rounds_beside with the loop of operators as the work."""
    import torch

    torch.set_num_threads(1)  # one core for the loop: its time is the interpreter lock's, not the BLAS pool's
    row = rounds_beside(lambda: launch_loop(ops, device), fmt, stream_fraction, requests, tokens, event_interval_s,
                        repeats, settle_s)
    return {**row, "work": "loop", "ops": ops, "device": device}


def check_update_options(trainer: str | None, shape_name: str, workdir: Path | None) -> None:
    """ValueError where the update variant's options do not go together: a trainer needs a known shape and a
    workdir (checked before anything is built)."""
    if trainer is None:
        return
    from hybridrl.tools.trainer_bench import shape_of

    shape_of(shape_name)
    if workdir is None:
        raise ValueError("--trainer needs --workdir (the random-init model and the adapters go there)")


@contextmanager
def update_work(shape_name: str, trainer: str, device: str, workdir: Path,
                micro_batch: int = 32) -> Iterator[Callable[[], float]]:
    """One trainer on trainer-bench's fixed batch of the shape, warmed up; yields the work: one timed update
    (the step with its adapter export, as the run's update_actor; the optimizer state's write waited for after)."""
    from hybridrl.tools import trainer_bench as tb

    shape = tb.shape_of(shape_name)
    model = tb.shape_model(workdir, shape_name, shape, device)
    batch = tb.fixed_batch(shape.config["vocab_size"], shape.samples, shape.prompt, shape.completion)
    built = tb.build_trainer(trainer, model, tb.bench_run(shape, trainer, device, micro_batch, None), workdir,
                             peft_lora=False, megatron_permute=False)
    steps = itertools.count(1)

    def update() -> float:
        step = next(steps)
        t0 = time.perf_counter()
        built.step(step, batch, workdir / trainer / f"adapter-{step}")
        seconds = time.perf_counter() - t0
        built.flush()
        return seconds

    try:
        update()  # warm-up: kernels, allocator, first export
        yield update
    finally:
        built.close()


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as the Markdown table the READMEs quote (a test holds them to the committed JSON)."""
    work = rows[0].get("work", "loop") if rows else "loop"
    lines = [f"| answers | streamed | {work} alone | beside the client's thread: median ratio [range] | "
             "beside its process |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        beside = [f"{r[f'{m}_s']:.3f} s: {r[f'{m}_x']:.2f}x [{r[f'{m}_x_min']:.2f}, {r[f'{m}_x_max']:.2f}]"
                  for m in ("thread", "process")]
        lines.append(f"| {r['format']} | {r['streamed_requests']}/{r['requests']} | {r['alone_s']:.3f} s | "
                     f"{beside[0]} | {beside[1]} |")
    return "\n".join(lines) + "\n"


def main(formats: list[str], fractions: list[float], requests: int, tokens: int, event_interval_s: float, ops: int,
         repeats: int, out: Path | None, device: str = "cpu", trainer: str | None = None, shape: str = "qwen3-0.6b",
         workdir: Path | None = None, micro_batch: int = 32) -> list[dict[str, Any]]:
    """Every (format, stream share) setting with the loop of operators as the work, or with `trainer`: one update
    of that trainer on the shape's fixed batch (one trainer built for every setting)."""
    from rich.console import Console
    from rich.progress import track

    check_update_options(trainer, shape, workdir)
    grid = [(fmt, f) for fmt in formats for f in fractions]
    load_before = os.getloadavg()
    if trainer is None:
        rows = [measure(fmt, f, requests, tokens, event_interval_s, ops, repeats, device=device)
                for fmt, f in track(grid, description="client beside a launch loop", transient=True)]
    else:
        with update_work(shape, trainer, device, workdir, micro_batch) as update:
            rows = [{**rounds_beside(update, fmt, f, requests, tokens, event_interval_s, repeats),
                     "work": f"{trainer} update", "shape": shape, "micro_batch": micro_batch, "device": device}
                    for fmt, f in track(grid, description=f"client beside the {trainer} update", transient=True)]
    Console(soft_wrap=True).print(markdown_table(rows), markup=False)
    if out is not None:
        from hybridrl.run.provenance import write as write_json

        write_json(out, {"cpus": os.cpu_count(), "host": platform.node(), "processor": platform.processor(),
                         "python": platform.python_version(), "switch_interval_s": sys.getswitchinterval(),
                         "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": os.getloadavg(),
                         "settings": rows})
    return rows
