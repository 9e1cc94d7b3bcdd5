"""Set-up against measured time, run by run: what each run paid before its first step (its trainer's build, the
instrument's measurements of the host, its engine's start split into the parts its log shows) beside the time of
the steps it was run for. Set-up is most of what a GPU study costs; this table says how much of each run's GPU time
measured anything."""

from __future__ import annotations

import pandas as pd

from hybridrl.report import stats
from hybridrl.report.cells import Cell, Table, fmt
from hybridrl.report.comparisons import START_PART_NAMES
from hybridrl.run.record import START_PARTS

START = "timing_s/engine_start"
# before the engine's start, where the runs recorded them (runs before these were recorded have the start alone)
BEFORE_START = {"timing_s/trainer_build": "trainer build (s)", "timing_s/host_measure": "host measured (s)"}


def _seconds(run: pd.DataFrame, column: str) -> float:
    """A run's one reading of a start column (recorded on its first step), NaN where it has none."""
    if column not in run.columns:
        return float("nan")
    values = pd.to_numeric(run[column], errors="coerce").dropna()
    return float(values.iloc[0]) if len(values) else float("nan")


def _cell(seconds: float) -> Cell:
    return Cell(fmt(seconds), "num") if pd.notna(seconds) else Cell("–", "na")


def _recorded(df: pd.DataFrame, column: str) -> bool:
    return column in df.columns and pd.to_numeric(df[column], errors="coerce").notna().any()


def setup_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """One row a run, in the order the runs were recorded: its trainer's build and the host's measurements before
    its engine's start (where recorded), that start and its parts, its warm-up steps, its measured (steady-state)
    steps, and set-up's share (the build, the measurements and the start) of them all. None where no run recorded
    its engine's start. Measured steps are those the comparisons use (stats.steady_state)."""
    if not _recorded(df, START):
        return None
    before = [c for c in BEFORE_START if _recorded(df, c)]
    parts = [p for p in START_PARTS if _recorded(df, f"{START}_{p}")]
    table = Table(["run", *(BEFORE_START[c] for c in before), "engine start (s)",
                   *(f"… {START_PART_NAMES[p]}" for p in parts), "warm-up steps (s)", "measured steps (s)",
                   "set-up's share"])
    for rid in stats.run_order(df):
        run = df[df["run_id"] == rid]
        warm, measured = (float(pd.to_numeric(part["timing_s/step"], errors="coerce").sum())
                          for part in (stats.warmup(run), stats.steady_state(run)))
        start, pre = _seconds(run, START), [_seconds(run, c) for c in before]
        set_up = start + sum(s for s in pre if pd.notna(s))
        share = set_up / (set_up + warm + measured) if pd.notna(start) else float("nan")
        table.rows.append([Cell(labels[rid]), *(_cell(s) for s in pre), _cell(start),
                           *(_cell(_seconds(run, f"{START}_{p}")) for p in parts), _cell(warm), _cell(measured),
                           Cell(f"{share:.0%}", "num") if pd.notna(share) else Cell("–", "na")])
    return table

