"""report.md and report.html from the tidy step table, through the jinja2 templates in workflow/report: the
context the templates show, gathered from the comparison and run-by-run sections."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from hybridrl.engines.client_ceiling import HEADROOM
from hybridrl.report import (
    comparisons,
    floors,
    headline,
    peer,
    placements,
    run_tables,
    setup_time,
    start_bench,
    stats,
    targets,
    trainer_bench,
    wording,
)
from hybridrl.report.aggregate import atomic_path
from hybridrl.report.plots import PLOTS, config_labels, run_labels
from hybridrl.run.checks import GAP_LIMITS

TEMPLATES = Path(__file__).resolve().parents[3] / "workflow" / "report"


def _plots(written: dict[str, Path], base: Path) -> list[dict[str, str]]:
    def rel(path: Path) -> str:
        return Path(os.path.relpath(Path(path).resolve(), base)).as_posix()

    titles = {name: plot.title for name, plot in PLOTS.items()} | {"peer": peer.PLOT_TITLE}
    return [{"name": name, "title": titles[name], "src": rel(path)} for name, path in written.items()]


def context(df: pd.DataFrame, title: str, plots: dict[str, Path], runs_dir: Path) -> dict[str, Any]:
    """Everything the templates show; plot paths are filled in per output file."""
    labels, by_config = run_labels(df), config_labels(df)
    ratios = comparisons.ratio_table(df, by_config)
    pairs, groups = headline.headlines(df), placements.groups(df)
    heads = comparisons.headline_tables(df, pairs)
    moves = comparisons.transitions(df, by_config)
    places = comparisons.placement_tables(df, groups)
    bench = runs_dir.parent / "bench"  # the study's measurements beside its runs
    peers = peer.records(bench)
    peer_pairs = peer.pairs(df, peers, by_config, runs_dir)
    peer_ratios = peer.ratio_table(peer_pairs)
    paths = comparisons.client_paths_table(df, by_config)
    # only intervals that exist can exclude 1 by chance: an n/a interval counts for nothing
    n_comparisons = (sum(h["n_comparisons"] for h in heads) + (moves["n_comparisons"] if moves else 0)
                     + (ratios[1].intervals if ratios else 0) + (paths.intervals if paths else 0)
                     + sum(p["n_comparisons"] for p in places) + (peer_ratios.intervals if peer_ratios else 0))
    return {
        "summary": comparisons.summary(df, title),
        "verdict": [*comparisons.verdict_lines(df, by_config, pairs, groups),
                    *(comparisons.VerdictLine(pair, sentence)
                      for pair, sentence in peer.verdict_lines(peer_pairs))],
        "nothing_compared": comparisons.nothing_compared(df),
        "runs": [{"label": labels[r], "run_id": r} for r in stats.run_order(df)],
        "headlines": heads,
        "comparisons_note": wording.comparisons_note(n_comparisons),
        "transitions": moves,
        "placements": places,
        "comparison": comparisons.comparison_table(df, by_config),
        "baseline": ratios[0] if ratios else None,
        "ratios": ratios[1] if ratios else None,
        "warmup": run_tables.warmup_table(df, labels),
        "recording": run_tables.recording(df, labels),
        "setup": setup_time.setup_table(df, labels),
        "start_bench": start_bench.table(bench),
        "trainer_bench": trainer_bench.table(bench),
        "peer": peer.phase_table(df, peers, by_config, runs_dir),
        "peer_ratios": peer_ratios,
        "correctness": run_tables.correctness_table(df, labels),
        "accuracy": run_tables.accuracy_table(df, labels),
        "accuracy_replicates": run_tables.accuracy_replicates_table(df, by_config),
        "learning_trends": run_tables.learning_trend_table(df, labels),
        "client": run_tables.client_table(df, labels),
        "client_paths": paths,
        "machine": run_tables.machine_table(df, labels),
        "targets": targets.table(df, by_config),
        "floors": floors.floor_table(df, runs_dir, by_config),
        "memory_trend": run_tables.memory_trend_table(df, labels),
        "gap": run_tables.gap_table(df, labels),
        "gap_warn": ", ".join(f"{w:g} {fam}" for fam, (w, _) in GAP_LIMITS.items()),
        "gap_fail": ", ".join(sorted({f"{f:g}" for _, f in GAP_LIMITS.values()})),
        "client_headroom": f"{HEADROOM:.0%}",
        "detail": run_tables.detail_table(df, by_config),
        "provenance": run_tables.provenance_rows(df, labels, runs_dir),
        "plots": plots,
    }


def _env() -> jinja2.Environment:
    if not TEMPLATES.is_dir():
        raise FileNotFoundError(f"report templates not found in {TEMPLATES}")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2",), default_for_string=False),
        undefined=jinja2.StrictUndefined,  # a typo in a template fails loudly instead of printing nothing
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["md"] = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
    return env


def render(df: pd.DataFrame, out_md: Path, out_html: Path, plots: dict[str, Path], title: str,
           runs_dir: Path) -> None:
    """Write report.md and report.html (atomically), each linking the plots relative to itself."""
    ctx = context(df, title, plots, runs_dir)
    for out, name in ((Path(out_md), "report.md.j2"), (Path(out_html), "report.html.j2")):
        text = fill(ctx, name, plots, out)
        with atomic_path(out) as tmp:
            tmp.write_text(text)


def markdown(df: pd.DataFrame, plots: dict[str, Path], title: str, runs_dir: Path, out_md: Path) -> str:
    """The text render() would write to out_md, written nowhere."""
    return fill(context(df, title, plots, runs_dir), "report.md.j2", plots, Path(out_md))


def fill(ctx: dict[str, Any], template: str, plots: dict[str, Path], out: Path) -> str:
    """A report template filled from the context, its plots linked relative to the file it becomes."""
    return _env().get_template(template).render(**{**ctx, "plots": _plots(plots, out.resolve().parent)})
