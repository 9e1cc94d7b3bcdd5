"""The report's table cells and number formats, shared by every section."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from hybridrl.report import stats


@dataclass
class Cell:
    text: str
    cls: str = ""  # css class in html: ok / fail / na / num / key


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Cell]] = field(default_factory=list)
    # comparisons shown with a finite 95% interval: what the report's "by chance" count is made of
    intervals: int = 0


def markdown(table: Table) -> str:
    """The table as a Markdown table, as a study README quotes it (a figure marker's text); a cell's | escaped."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in table.headers) + " |",
             "|" + "|".join(" --- " for _ in table.headers) + "|"]
    lines += ["| " + " | ".join(cell(c.text) for c in row) + " |" for row in table.rows]
    return "\n".join(lines)


def fmt(x: Any) -> str:
    """Numbers to a readable precision: 12,345 / 123.4 / 12.34 / 0.123."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return "–"
    if not math.isfinite(x):
        return "–"
    ax = abs(x)
    if ax == 0:
        return "0"
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    return f"{x:#.3g}"


def fmt_field(value: Any) -> str:
    """A config field as written in the config: 1 not 1.0, – for unset."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)) or value is pd.NA:
        return "–"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def fmt_est(est: stats.Estimate) -> str:
    """'median [lo, hi]', or [n/a] where too few values made an interval."""
    if est.n == 0:
        return "–"
    if not math.isfinite(est.lo):
        return f"{fmt(est.value)} [n/a]"
    return f"{fmt(est.value)} [{fmt(est.lo)}, {fmt(est.hi)}]"


def fmt_n(est: stats.Estimate) -> str:
    """What an interval rests on: runs and steps."""
    return f"{est.n_runs} run{'s' if est.n_runs != 1 else ''} × {est.n} steps" if est.n else "–"


def has_data(df: pd.DataFrame, col: str) -> bool:
    """Whether the column is there with at least one number in it."""
    return col in df.columns and pd.to_numeric(df[col], errors="coerce").notna().any()


def run_rows(df: pd.DataFrame, run_id: str) -> pd.DataFrame:
    """One run's steps (a missing run id selects nothing)."""
    return df[(df["run_id"] == run_id).fillna(False).to_numpy(dtype=bool)]


def bool_cell(col: pd.Series, steps: pd.Series) -> Cell:
    """'k/n ok' over the steps where the check ran, naming the steps where it failed."""
    known = col.astype("boolean").dropna()
    if known.empty:
        return Cell("not checked", "na")
    bad = [int(s) for s in steps[known.index[~known.to_numpy(dtype=bool)]]]
    text = f"{len(known) - len(bad)}/{len(known)} ok"
    if not bad:
        return Cell(text, "ok")
    shown = ", ".join(map(str, bad[:5])) + (", …" if len(bad) > 5 else "")
    return Cell(f"{text} (failed at step {shown})", "fail")
