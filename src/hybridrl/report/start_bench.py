"""An engine's start through hybridrl against its own command line (bench/start-*.json, written by `hybridrl
start-bench`): each path's first start apart, the later starts' medians, their ratio, and the start target
(targets.yaml, start/over_cli)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from hybridrl.report import stats, targets
from hybridrl.report.cells import Cell, Table, fmt
from hybridrl.report.peer import BenchRecordError, measurement_files

PATHS = ("hybridrl", "cli")


def _starts(path: Path) -> tuple[str, dict[str, list[float]]]:
    try:
        data = json.loads(path.read_text())
        starts = {p: [float(s["start_s"]) for s in data["starts"] if s["path"] == p] for p in PATHS}
        name = f"{data['engine']} ({data['run_id']}); command line: {data.get('cli_engine', data['engine'])}"
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise BenchRecordError(f"{path}: not a readable start-bench record ({exc})") from None
    if not all(starts.values()):
        raise BenchRecordError(f"{path}: a path without a start (both hybridrl and cli are needed)")
    return name, starts


def table(bench_dir: Path, wanted: list[targets.Target] | None = None) -> Table | None:
    """One row a start-bench record; None without one. The ratio is of the later starts' medians; with a single
    later start a side it has no interval, and the target is judged "not settled" then."""
    paths = measurement_files(bench_dir, "start-")
    if not paths:
        return None
    bound = targets.of_metric(targets.START_OVER_CLI, wanted)
    out = Table(["engine", "hybridrl, first (s)", "command line, first (s)", "hybridrl, later (s)",
                 "command line, later (s)", "hybridrl / command line, later", "target", "bound", "verdict"])
    for path in paths:
        name, starts = _starts(path)
        later = {p: v[1:] for p, v in starts.items()}
        if all(later.values()):
            est = stats.hierarchical_ratio([later["hybridrl"]], [later["cli"]])
            ratio = f"{est.value:.2f}x" + (f" [{est.lo:.2f}, {est.hi:.2f}]" if math.isfinite(est.lo) else
                                           f" ({min(map(len, later.values()))} start a side, no interval)")
        else:
            est, ratio = None, "–"
        medians = [fmt(statistics.median(later[p])) if later[p] else "–" for p in PATHS]
        for target in bound or [None]:
            verdict = targets.judge(target, est, over_runs=False) if target and est else ""  # starts: replicates
            out.rows.append([Cell(name), *(Cell(fmt(starts[p][0]), "num") for p in PATHS),
                             *(Cell(m, "num") for m in medians), Cell(ratio, "num"), *targets.cells(target, verdict)])
    return out
