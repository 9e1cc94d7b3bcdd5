"""Where a study stands: one row per declared run, read from its folder under results/runs/ and its log.

Only files are read (steps.jsonl, done.json, the log's tail), nothing is imported that a training job needs, so
that a poll costs a fraction of a second while the study runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridrl import jsonl
from hybridrl.study.config import Study

# the record's gates and the short names a row shows them under; the tier gate is judged by its own values
GATE_NAMES = {
    "check/logprob_gap_tier": "logprob gap",
    "check/base_canary_ok": "canary",
    "check/adapter_applied": "adapter",
    "check/kv_capacity_ok": "kv capacity",
    "check/logprob_agreement_ok": "logprobs agree",
    "check/client_headroom_ok": "client headroom",
    "check/asleep_memory_ok": "asleep memory",
    "check/awake_memory_ok": "awake memory",
}

# how a run that stopped on an error ends its log: the CLI's one line (hybridrl: ...: what) or a traceback's last
# line (KeyError: 'answer'); hybridrl's warnings are one line too, but not the end of a run
_ERROR_LINE = re.compile(r"^(hybridrl: (?!warning:)|[A-Za-z_][\w.]*(Error|Exception|Interrupt|Failed)(: |$))")
_TAIL_BYTES = 8192


@dataclass(frozen=True)
class RunStatus:
    run_id: str
    steps_done: int
    steps_planned: int
    state: str  # done, running, not started or failed
    step_s: float | None  # the last recorded step's timing_s/step
    gates: dict[str, str]  # short gate name -> ok, warn, FAIL or – (not judged), of the last recorded step
    log: str
    error: str | None  # the log's last line where the run failed


def _gate(key: str, value: object) -> str:
    if key == "check/logprob_gap_tier":
        return {"pass": "ok", "warn": "warn", "fail": "FAIL"}.get(str(value), "–")
    return "–" if value is None else "ok" if value else "FAIL"


def _last_line(log: Path) -> str | None:
    """The last non-blank line of a log (its tail only: a long run's log grows to megabytes)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - _TAIL_BYTES))
            tail = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1] if lines else None


def run_status(run_id: str, planned: int, run_dir: Path, log: Path) -> RunStatus:
    steps_file = run_dir / "steps.jsonl"
    text = steps_file.read_text(encoding="utf-8", errors="replace") if steps_file.exists() else ""
    # a line being appended while we read is passed over (with a warning), not a reason to fail the whole table
    records = jsonl.objects(text, steps_file, "step record", skip_bad=True)
    last = records[-1] if records else {}
    last_line = _last_line(log)
    failed = last_line is not None and _ERROR_LINE.match(last_line) is not None
    if (run_dir / "done.json").exists():
        state = "done"
    elif failed:
        state = "failed"
    elif records or last_line is not None:
        state = "running"
    else:
        state = "not started"
    step_s = last.get("timing_s/step")
    return RunStatus(run_id, len(records), planned, state,
                     float(step_s) if isinstance(step_s, int | float) else None,
                     {name: _gate(key, last.get(key)) for key, name in GATE_NAMES.items()} if last else {},
                     str(log), last_line if state == "failed" else None)


def study_status(study: Study, results: Path, logs: Path) -> list[RunStatus]:
    """Every run the study declares, in the order it runs them."""
    return [run_status(rid, run.steps, results / "runs" / rid, logs / "train" / f"{rid}.log")
            for rid, run in study.runs.items()]


def as_json(rows: list[RunStatus]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)


def _gates_text(gates: dict[str, str]) -> str:
    """The gates that did not pass by name, or 'all ok'; – where no step is recorded."""
    if not gates:
        return "–"
    judged = {n: v for n, v in gates.items() if v != "–"}
    bad = [f"{n} {v}" for n, v in judged.items() if v != "ok"]
    if bad:
        return ", ".join(bad)
    return f"all {len(judged)} ok" if len(judged) == len(gates) else f"{len(judged)} ok, {len(gates) - len(judged)} –"


HEADER = ("run", "steps", "state", "last step (s)", "gates", "log")


def _cells(r: RunStatus) -> tuple[str, ...]:
    return (r.run_id, f"{r.steps_done}/{r.steps_planned}", r.state,
            "–" if r.step_s is None else f"{r.step_s:.2f}", _gates_text(r.gates), r.log)


def as_text(rows: list[RunStatus]) -> str:
    """Plain aligned columns, for pipes and files; a failed run's error line follows its row."""
    table = [HEADER, *(_cells(r) for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    lines = []
    for row, r in zip(table, [None, *rows], strict=True):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if r is not None and r.error:
            lines.append(f"  error: {r.error}")
    return "\n".join(lines)


def print_rich(rows: list[RunStatus]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    styles = {"done": "green", "running": "yellow", "failed": "bold red", "not started": "dim"}
    table = Table()
    for name in HEADER:  # ids and paths wrap on a narrow terminal rather than lose their ends
        table.add_column(name, overflow="fold", no_wrap=name in ("steps", "state"))
    for r in rows:
        cells = [escape(c) for c in _cells(r)]
        cells[2] = f"[{styles[r.state]}]{r.state}[/]"
        if "FAIL" in cells[4]:
            cells[4] = f"[red]{cells[4]}[/]"
        table.add_row(*cells)
    console = Console()
    console.print(table)
    for r in rows:
        if r.error:
            console.print(f"[red]{r.run_id}[/]: {escape(r.error)}", highlight=False)
