"""Aggregate the runs' per-step records into one table, and render the study report from it.

The heavy imports (pandas, matplotlib, jinja2) happen inside the entry points, so that importing
hybridrl.report costs nothing for the training job.
"""

from __future__ import annotations

from pathlib import Path


def aggregate_main(run_dirs: list[Path], out_csv: Path, out_parquet: Path) -> None:
    """Gather results/runs/<run_id>/steps.jsonl of every run into one CSV and one parquet table."""
    from hybridrl.report.aggregate import gather, write_table

    write_table(gather([Path(d) for d in run_dirs]), Path(out_csv), Path(out_parquet))


def report_main(table: Path, out_md: Path, out_html: Path, plots_dir: Path, title: str,
                runs_dir: Path | None = None) -> None:
    """Plots plus report.md and report.html from the aggregated table.

    Provenance is read from runs_dir/<run_id>/provenance.json; runs_dir defaults to the table's
    sibling `runs/` (results/steps.parquet -> results/runs/).
    """
    from hybridrl.report import peer
    from hybridrl.report.aggregate import read_table
    from hybridrl.report.plots import config_labels, make_all
    from hybridrl.report.render import render

    table = Path(table)
    df = read_table(table)
    plots = make_all(df, Path(plots_dir))
    runs = Path(runs_dir) if runs_dir is not None else table.parent / "runs"
    drawn = peer.plot(df, peer.records(runs.parent / "bench"), config_labels(df), Path(plots_dir) / "peer.png",
                      runs)
    render(df, Path(out_md), Path(out_html), plots | ({"peer": drawn} if drawn else {}), title, runs)


__all__ = ["aggregate_main", "report_main"]
