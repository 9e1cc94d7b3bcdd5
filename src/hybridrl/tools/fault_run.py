"""Fault runs: one training run, hit on purpose where real runs get hit, then checked for what must survive.

    python -m hybridrl fault-run --out fault.json --kill-engine-at 2 --term-at 4 -- \\
        python -m hybridrl train --run-config cfg.json ... --out RUN_DIR --done RUN_DIR/done.json

The run's RUN_DIR/phase.json says which step and phase it is in, and which step's rollout runs ahead
(run/phase_file.py). During step `--kill-engine-at`'s rollout (its `gen`, or with overlap its rollout running
ahead while the step before trains) every process group the run started (its engine) is sent SIGKILL: the
loop must start the engine again, count it and roll that step out again. At step `--term-at`'s
`update_actor` the run gets SIGTERM, as SLURM preemption sends: it must stop and then, started again with the
same command, resume from its last completed step. At the end no process the run started may be left, on the
host or on a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from hybridrl import atomic, nvml
from hybridrl.proc import descendants, stat_fields
from hybridrl.run import phase_file
from hybridrl.run.telemetry import read_records

console = Console(stderr=True)
POLL_S = 0.05  # a CPU-sized step's rollout lasts about a second: the hit must land inside it


@dataclass
class FaultReport:
    command: list[str]
    kill_engine_at: int | None
    term_at: int | None
    engine_killed: list[int] = field(default_factory=list)  # pids whose group got SIGKILL
    killed_in: str | None = None  # step and phase when the SIGKILL went out
    termed_in: str | None = None
    exit_codes: list[int] = field(default_factory=list)  # one per start of the run
    steps: list[int] = field(default_factory=list)  # the record's steps, in file order
    engine_restarts: int = 0
    leftover: list[int] = field(default_factory=list)  # pids the run started, alive after it ended
    leftover_gpu: list[int] = field(default_factory=list)  # of those, holding a CUDA context (NVML)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _children(pid: int) -> dict[int, int]:
    """{descendant pid: its process group} of pid, from /proc."""
    found: dict[int, int] = {}
    for child in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            found[child] = os.getpgid(child)
    return found


def _alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"  # a zombie holds nothing; its parent has not reaped it yet


def _rollout_of(where: dict[str, Any], step: int) -> str | None:
    """Where step `step`'s rollout is running now, in words; None when it is not."""
    if where.get("ahead") == step:
        return f"step {step} rollout, running ahead in step {where['step']} {where['phase']}"
    if where.get("step") == step and where.get("phase") == "gen":
        return f"step {step} gen"
    return None


def _kill_engine(proc: subprocess.Popen, report: FaultReport) -> None:
    """SIGKILL every process group the run started (its engine server), not the run's own group: the
    run must notice its engine died. A child in the run's own group is killed alone."""
    own = os.getpgid(proc.pid)
    children = _children(proc.pid)
    groups = {pgid for pgid in children.values() if pgid != own}
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
            report.engine_killed.append(pgid)
        except ProcessLookupError:
            pass
    if not groups:
        for pid, pgid in children.items():
            if pgid == own:
                os.kill(pid, signal.SIGKILL)
                report.engine_killed.append(pid)


def _one_start(cmd: list[str], run_dir: Path, report: FaultReport, seen: set[int]) -> int:
    """Start the run once; hit it where asked; return its exit code."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        while proc.poll() is None:
            seen.update(_children(proc.pid))
            where = phase_file.read(run_dir / "phase.json") or {}
            rollout = _rollout_of(where, report.kill_engine_at) if report.kill_engine_at is not None else None
            if rollout and report.killed_in is None:
                _kill_engine(proc, report)
                report.killed_in = rollout
                hit = report.engine_killed or "no engine"
                console.print(f"[yellow]fault-run: SIGKILL to {hit} in {report.killed_in}")
            training = where.get("step") == report.term_at and where.get("phase") == "update_actor"
            if training and report.termed_in is None:
                report.termed_in = f"step {report.term_at} update_actor"
                console.print(f"[yellow]fault-run: SIGTERM to the run in {report.termed_in}")
                proc.send_signal(signal.SIGTERM)
            time.sleep(POLL_S)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # never leave a run behind
        raise
    return proc.wait()


def fault_run(cmd: list[str], run_dir: Path, kill_engine_at: int | None, term_at: int | None,
              grace_s: float = 15.0) -> FaultReport:
    """Run cmd (a `hybridrl train` writing to run_dir), hit it, start it again after a SIGTERM, and check."""
    report = FaultReport(cmd, kill_engine_at, term_at)
    seen: set[int] = set()
    report.exit_codes.append(_one_start(cmd, run_dir, report, seen))
    if report.termed_in is not None:
        console.print("fault-run: starting the run again, as a requeued job would")
        report.exit_codes.append(_one_start(cmd, run_dir, report, seen))
    deadline = time.monotonic() + grace_s  # an engine's own shutdown may outlast its parent a little
    while time.monotonic() < deadline and any(_alive(p) for p in seen):
        time.sleep(0.2)
    report.leftover = sorted(p for p in seen if _alive(p))
    report.leftover_gpu = sorted(set(report.leftover) & nvml.compute_pids())
    records = read_records(run_dir / "steps.jsonl") if (run_dir / "steps.jsonl").exists() else []
    report.steps = [int(r["step"]) for r in records]
    report.engine_restarts = int(sum(r.get("errors/engine_restarts") or 0 for r in records))
    judge(report)
    return report


def judge(report: FaultReport) -> None:
    """What a fault run must show; each miss is a line in report.problems."""
    p = report.problems
    if report.kill_engine_at is not None:
        if not report.engine_killed:
            p.append(f"the run never reached step {report.kill_engine_at}'s rollout with an engine to kill")
        elif report.engine_restarts < 1:
            p.append("the engine was killed but no step counted a restart (errors/engine_restarts)")
    if report.term_at is not None:
        if report.termed_in is None:
            p.append(f"the run never reached step {report.term_at}'s training to send SIGTERM")
        elif report.exit_codes[0] == 0:
            p.append("the run ignored SIGTERM: its first start finished")
    if report.exit_codes and report.exit_codes[-1] != 0:
        p.append(f"the run's last start exited {report.exit_codes[-1]}")
    if report.steps != list(range(1, len(report.steps) + 1)):
        p.append(f"steps lost or repeated: {report.steps}")
    if report.leftover:
        p.append(f"processes of the run still alive: {report.leftover} (on a GPU: {report.leftover_gpu})")


def write(report: FaultReport, out: Path) -> None:
    data: dict[str, Any] = {**asdict(report), "ok": report.ok}
    atomic.write_text(out, json.dumps(data, indent=2) + "\n")


def run_dir_of(cmd: list[str]) -> Path:
    """The --out of the train command."""
    if "--out" not in cmd or cmd.index("--out") + 1 >= len(cmd):
        raise ValueError("the command after -- must be a `hybridrl train ... --out RUN_DIR`")
    return Path(cmd[cmd.index("--out") + 1])
