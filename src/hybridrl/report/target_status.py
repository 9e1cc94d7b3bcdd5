"""Every committed study against the speed targets (workflow/report/targets.yaml): one row for each target and each
configuration, benchmark or setting of a study it applies to, with its median [95% CI] and verdict. `hybridrl
targets` prints it, and the `targets_status` figure puts it in docs/results.md."""

from __future__ import annotations

from pathlib import Path

from hybridrl.report import peer, start_bench, targets, trainer_bench
from hybridrl.report.aggregate import read_table
from hybridrl.report.cells import Cell, Table
from hybridrl.report.plots import config_labels

HEADERS = ["study", "target", "what", "median [95% CI]", "bound", "verdict"]
# the benchmark tables' columns that name what a row is and give its figure
_BENCH_COLUMNS = {"ratios": (("configuration", "against"), "hybridrl / TRL, step"),
                  "starts": (("engine",), "hybridrl / command line, later"),
                  "updates": (("setting",), "update, median [95% CI] (s)")}


def _study_rows(study: Path, wanted: list[targets.Target]) -> list[list[str]]:
    bench, steps = study / "bench", study / "steps.csv"
    df = read_table(steps) if steps.is_file() else None
    labels = config_labels(df) if df is not None else {}
    table = targets.table(df, labels, wanted) if df is not None else None
    out = [[study.name, *(c.text for c in row)] for row in (table.rows if table else [])]
    # the targets on benchmark records: hybridrl against TRL, an engine's start against its command line, the
    # trainer's update
    tables = {"ratios": peer.ratio_table(peer.pairs(df, peer.records(bench), labels, study / "runs"), wanted)
              if df is not None else None,
              "starts": start_bench.table(bench, wanted), "updates": trainer_bench.table(bench, wanted)}
    for key, bench_table in tables.items():
        if bench_table is None:
            continue
        what, value = _BENCH_COLUMNS[key]
        col = {h: i for i, h in enumerate(bench_table.headers)}
        out += [[study.name, row[col["target"]].text, " against ".join(row[col[w]].text for w in what),
                 row[col[value]].text, row[col["bound"]].text, row[col["verdict"]].text]
                for row in bench_table.rows if row[col["target"]].text != "–"]
    return out


def rows(reference: Path, wanted: list[targets.Target] | None = None) -> list[list[str]]:
    """The rows of every study under `reference` with runs (steps.csv) or benchmarks alone (bench/), by name;
    BenchRecordError names a record that cannot be read."""
    wanted = targets.load() if wanted is None else wanted
    studies = sorted(p for p in Path(reference).iterdir() if (p / "steps.csv").is_file() or (p / "bench").is_dir())
    return [row for study in studies for row in _study_rows(study, wanted)]


def table(reference: Path, wanted: list[targets.Target] | None = None) -> Table:
    """rows() as a table, the verdict marked as the report marks it."""
    marks = {"met": "ok", "missed": "fail"}
    return Table(HEADERS, [[*(Cell(t) for t in row[:-1]), Cell(row[-1], marks.get(row[-1], "na"))]
                           for row in rows(reference, wanted)])
