"""The committed study reports read as today's report code renders them (`python -m hybridrl reports`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.report import refresh
from hybridrl.report.aggregate import read_table
from hybridrl.report.plots import drawable, make_all

REPO = Path(__file__).resolve().parents[1]
STUDIES = sorted(d for d in (REPO / "results" / "reference").iterdir() if (d / "report.md").is_file())
SMALL = REPO / "results" / "reference" / "2026-11-24-h200-trainerloop"  # 5 steps: quick to render


def _reports(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl", "reports", *args], capture_output=True, text=True,
                          cwd=REPO)


@pytest.mark.parametrize("study", STUDIES, ids=[d.name for d in STUDIES])
def test_every_committed_report_reads_as_todays_code_renders_it(study: Path) -> None:
    assert not refresh.is_stale(study), f"stale: python -m hybridrl reports --fix {study.relative_to(REPO)}"


def test_a_report_edited_by_hand_or_missing_a_plot_is_stale_and_fix_renders_it_again(tmp_path: Path) -> None:
    study = tmp_path / SMALL.name
    shutil.copytree(SMALL, study)
    committed = (study / "report.md").read_text()
    assert not refresh.is_stale(study)
    (study / "plots" / "throughput.png").unlink()  # a plot the table has data for, not drawn
    assert refresh.is_stale(study)
    shutil.copy(study / "plots" / "latency.png", study / "plots" / "placements.png")  # and one it has none for
    (study / "report.md").write_text(committed.replace("| ", "| 9", 1))  # one figure changed by hand
    out = _reports(str(study))
    assert out.returncode == 1
    assert f"{study}/report.md: today's report code renders it differently" in out.stdout
    assert f"1 of 1 reports are stale; write them again with python -m hybridrl reports --fix {study}" in out.stderr
    out = _reports("--fix", str(study))
    assert out.returncode == 0, out.stderr
    assert (study / "report.md").read_text() == committed
    assert (study / "plots" / "throughput.png").is_file() and not (study / "plots" / "placements.png").exists()
    out = _reports(str(study))
    assert out.returncode == 0 and "all 1 reports read as today's code renders them" in out.stdout


@pytest.mark.parametrize("name", ["2026-11-25-h200-placement1v", "2026-11-23-cpu-smoke"])
def test_the_plots_a_table_has_data_for_are_the_plots_drawn(name: str, tmp_path: Path) -> None:
    """The check asks each plot whether it has data without drawing it; drawing must agree."""
    df = read_table(REPO / "results" / "reference" / name / "steps.csv")
    assert sorted(make_all(df, tmp_path)) == sorted(drawable(df))
    assert sorted(p.stem for p in tmp_path.glob("*.png")) == sorted(drawable(df))
    assert not drawable(df.iloc[0:0])  # an empty table: nothing to draw


def test_the_check_refuses_a_missing_folder_or_a_report_without_its_table(tmp_path: Path) -> None:
    out = _reports(str(tmp_path / "nowhere"))
    assert out.returncode == 1 and out.stderr.strip() == f"hybridrl reports: {tmp_path / 'nowhere'}: no such folder"
    (tmp_path / "report.md").write_text("# hybridrl study\n")
    out = _reports(str(tmp_path))
    assert out.stderr.strip() == f"hybridrl reports: {tmp_path}: report.md without the steps.csv it is rendered from"
    bench = tmp_path / "bench"
    bench.mkdir()  # a benchmark folder: no report, passed over, but not the only folder asked about
    out = _reports(str(bench))
    assert out.returncode == 1 and "no study report (steps.csv and report.md) in" in out.stderr
