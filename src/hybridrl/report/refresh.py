"""Committed study reports against today's report code: which ones it would write differently, and writing them
again, so that a reference result under results/reference/ reads as the code that ships reads its data.

A study folder holds steps.csv, report.md and plots/ (and runs/ for provenance). The check renders report.md
from steps.csv and asks which plots the table has data for, without drawing them (drawing is slow, and a PNG's
bytes vary with matplotlib); refreshing draws the plots again too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from rich.progress import track

from hybridrl.report import peer, report_main
from hybridrl.report.aggregate import read_table
from hybridrl.report.plots import PLOTS, drawable
from hybridrl.report.render import markdown

DEFAULT_TITLE = "hybridrl study"


def study_dirs(paths: list[Path]) -> list[Path]:
    """The folders among `paths` that hold a rendered study (steps.csv and report.md); benchmark folders without a
    report are passed over. A missing folder, or a report without the table it is rendered from, is an error, so
    that a typo does not pass as "nothing stale"."""
    dirs = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise FileNotFoundError(f"{p}: no such folder")
        if (p / "report.md").is_file() and not (p / "steps.csv").is_file():
            raise FileNotFoundError(f"{p}: report.md without the steps.csv it is rendered from")
        if (p / "report.md").is_file():
            dirs.append(p)
    if not dirs:
        raise FileNotFoundError(f"no study report (steps.csv and report.md) in {', '.join(map(str, paths))}")
    return dirs


def title(study: Path) -> str:
    """The title report.md was rendered with (its first line, '# <title>')."""
    first = (study / "report.md").read_text().split("\n", 1)[0]
    return first[2:] if first.startswith("# ") else DEFAULT_TITLE


def is_stale(study: Path) -> bool:
    """Whether today's code would write the folder's report differently: report.md's text, or which plots it
    draws (plots/<name>.png present for exactly the plots the table has data for)."""
    df = read_table(study / "steps.csv")
    names = [*drawable(df), *(["peer"] if peer.records(study / "bench") else [])]
    plots = {name: study / "plots" / f"{name}.png" for name in names}
    drawn = {name for name in [*PLOTS, "peer"] if (study / "plots" / f"{name}.png").is_file()}
    if drawn != set(plots):
        return True
    text = markdown(df, plots, title(study), study / "runs", study / "report.md")
    return text != (study / "report.md").read_text()


def stale(dirs: list[Path], progress: bool = True) -> list[Path]:
    """The folders whose report.md today's code would render differently."""
    return [d for d in track(dirs, description="checking reports", disable=not progress) if is_stale(d)]


def refresh(dirs: list[Path], progress: bool = True) -> None:
    """Render each folder's report.md and plots again (report.html goes to a scratch folder: not committed)."""
    with tempfile.TemporaryDirectory() as tmp:
        for d in track(dirs, description="rendering reports", disable=not progress):
            report_main(d / "steps.csv", d / "report.md", Path(tmp) / "report.html", d / "plots", title(d),
                        d / "runs")
