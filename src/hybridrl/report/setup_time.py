"""Set-up against measured time, run by run: what each run paid before its first step (its engine's start, split
into the parts its log shows) beside the time of the steps it was run for. Set-up is most of what a GPU study
costs; this table says how much of each run's GPU time measured anything."""

from __future__ import annotations

import pandas as pd

from hybridrl.report import stats
from hybridrl.report.cells import Cell, Table, fmt
from hybridrl.report.comparisons import START_PART_NAMES
from hybridrl.run.record import START_PARTS

START = "timing_s/engine_start"


def _seconds(run: pd.DataFrame, column: str) -> float:
    """A run's one reading of a start column (recorded on its first step), NaN where it has none."""
    if column not in run.columns:
        return float("nan")
    values = pd.to_numeric(run[column], errors="coerce").dropna()
    return float(values.iloc[0]) if len(values) else float("nan")


def _cell(seconds: float) -> Cell:
    return Cell(fmt(seconds), "num") if pd.notna(seconds) else Cell("–", "na")


def setup_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """One row a run, in the order the runs were recorded: its engine's start and that start's parts, its warm-up
    steps, its measured (steady-state) steps, and the start's share of the three together. None where no run
    recorded its engine's start. Measured steps are those the comparisons use (stats.steady_state)."""
    if START not in df.columns or pd.to_numeric(df[START], errors="coerce").isna().all():
        return None
    parts = [p for p in START_PARTS if f"{START}_{p}" in df.columns
             and pd.to_numeric(df[f"{START}_{p}"], errors="coerce").notna().any()]
    table = Table(["run", "engine start (s)", *(f"… {START_PART_NAMES[p]}" for p in parts),
                   "warm-up steps (s)", "measured steps (s)", "start's share"])
    for rid in stats.run_order(df):
        run = df[df["run_id"] == rid]
        warm, measured = (float(pd.to_numeric(part["timing_s/step"], errors="coerce").sum())
                          for part in (stats.warmup(run), stats.steady_state(run)))
        start = _seconds(run, START)
        share = start / (start + warm + measured) if pd.notna(start) else float("nan")
        table.rows.append([Cell(labels[rid]), _cell(start), *(_cell(_seconds(run, f"{START}_{p}")) for p in parts),
                           _cell(warm), _cell(measured),
                           Cell(f"{share:.0%}", "num") if pd.notna(share) else Cell("–", "na")])
    return table

