"""The report's sections run by run: when each was recorded and beside what, its warm-up, its gates, its rollout
client and machine, its logprob gap and memory over steps, its learning, every metric in detail, and where it
came from (provenance)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from hybridrl.engines.client_ceiling import HEADROOM
from hybridrl.report import conditions, learning, machine, stats, trend
from hybridrl.report.aggregate import commit_label, ran_ahead, read_provenance
from hybridrl.report.cells import Cell, Table, bool_cell, fmt, fmt_est, fmt_field, has_data, run_rows
from hybridrl.run.record import (
    CHECKS,
    ENGINE_ASLEEP_OWN,
    HOST,
    LEARNING,
    MEMORY,
    MISMATCH,
    ROLLOUT,
    TIMING,
    TRAINING,
)

WARMUP_METRICS = ["timing_s/step", "timing_s/gen", "timing_s/restart", "timing_s/update_weights",
                  "perf/throughput", "perf/ttft_s_p50"]

DETAIL_METRICS = [c for c in (*TIMING, *ROLLOUT, *TRAINING, *MEMORY, *LEARNING, *HOST, *CHECKS, *MISMATCH)
                  if not c.startswith("check/") or (c.startswith(("check/rollout_logprob", "check/logprob_gap_"))
                                                     and c != "check/logprob_gap_max")]  # a setting, not a reading

# the trainer-vs-engine gaps, which a rollout from an older adapter (overlap) shows by design: never judged there
GAP_READINGS = ("check/rollout_logprob_abs_diff", "check/logprob_gap_sample_max", "check/logprob_gap_token_max")
STALE = "not judged (stale)"

BOOL_CHECKS = [
    ("check/base_canary_ok", "Base canary unchanged"),
    ("check/adapter_applied", "Adapter applied"),
    ("check/kv_capacity_ok", "KV capacity recovered"),
    ("check/logprob_agreement_ok", "Logprobs agree"),
]


# Who ran each run (provenance's scheduler block): columns shown where any run of the study recorded one
SCHEDULER_COLUMNS = ["executor", "SLURM job", "node", "GPUs (UUID)"]


def _scheduler_cells(run: pd.Series) -> list[Cell]:
    """A run's executor, SLURM job, node and GPUs; – for a run that recorded none, 'none' for a run given no GPU."""
    if pd.isna(run["executor"]):
        return [Cell("–", "na") for _ in SCHEDULER_COLUMNS]
    # a UUID's first 8 hex digits tell the GPUs of one machine apart
    uuids = "" if pd.isna(run["gpu_uuids"]) else ", ".join(u[:12] for u in str(run["gpu_uuids"]).split(","))
    return [Cell(fmt_field(run["executor"])), Cell(fmt_field(run["slurm_job_id"])), Cell(fmt_field(run["node"])),
            Cell(uuids or "none")]


def recording(df: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any] | None:
    """The runs in the order they were recorded: when, on which GPU, machine and commit, and what shared the host
    meanwhile: other runs of the study (their windows overlapped, engine start-up included) and GPU processes of
    other jobs (host/foreign_gpu_procs, where recorded)."""
    wins = conditions.windows(df)
    if not wins:
        return None
    near = conditions.beside(wins)
    first = df.drop_duplicates("run_id").set_index("run_id")
    seen = pd.to_numeric(df["host/foreign_gpu_procs"], errors="coerce")
    outside = seen.gt(0).groupby(df["run_id"]).sum()
    named = bool(first["executor"].notna().any())  # older studies keep the table they were rendered with
    table = Table(["#", "run", "recorded", "minutes", "GPU", "machine (boot id)", "code",
                   *(SCHEDULER_COLUMNS if named else []), "beside it"])
    for i, w in enumerate(wins, 1):
        others = [labels[o] for o in near[w.run_id]]
        if outside.get(w.run_id, 0):
            others.append(f"another job's GPU process in {int(outside[w.run_id])} step(s)")
        table.rows.append([Cell(str(i), "num"), Cell(labels[w.run_id]), Cell(conditions.span(w.start, w.stop)),
                           Cell(f"{(w.stop - w.start) / 60:.1f}", "num"), Cell(fmt_field(first.at[w.run_id, "gpu"])),
                           Cell(fmt_field(first.at[w.run_id, "machine"])),
                           Cell(fmt_field(first.at[w.run_id, "git_commit"])),
                           *(_scheduler_cells(first.loc[w.run_id]) if named else []),
                           Cell(", ".join(others) or "none", "fail" if others else "ok")])
    shared = sum(bool(v) for v in near.values())
    note = ("No run shared the host with another run of this study: each one's window (its engine's start to its "
            "last step) overlaps no other's." if not shared else
            f"{shared} of {len(wins)} runs shared the host with another run of this study for part of their window; "
            "their timings may hold the other's load (see the timeline plot).")
    if outside.sum():
        note += f" {int((outside > 0).sum())} run(s) saw another job's process on their GPUs."
    elif seen.notna().any():
        note += " No run saw another job's process on its GPUs."
    if named:
        note += (" Executor, SLURM job (array job_task for an array task), node and GPUs (each UUID's start) say "
                 "who ran each run on what; – where a run did not record them.")
    return {"table": table, "note": note}


def warmup_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    """Every run's warm-up steps, each apart (step 1 rolls out the base model, step 2 the first adapter), and an
    overlapped run's last step, which nothing rolled out ahead of."""
    metrics = [m for m in WARMUP_METRICS if has_data(df, m)]
    table = Table(["run", "step"] + metrics)
    order = {rid: i for i, rid in enumerate(stats.run_order(df))}
    drained = stats.drain(df)
    apart = df[(df["step"] <= stats.warmup_steps(df)) | drained]
    apart = apart.assign(_order=apart["run_id"].map(order)).sort_values(["_order", "step"])
    for i, row in apart.iterrows():
        step = f"{int(row['step'])}" + (" (last: nothing ahead)" if drained[i] else "")
        table.rows.append([Cell(labels[row["run_id"]]), Cell(step, "num"),
                           *(Cell(fmt(row[m]), "num") for m in metrics)])
    return table


def _adapter_cell(run: pd.DataFrame) -> Cell:
    """The adapter gate over the steps it could judge: an identity adapter (no gradient yet) changes nothing. Steps
    recorded as not applied whose adapter was the identity say that they were read again."""
    identity, relabelled = stats.identity_adapter(run), stats.relabelled_identity(run)
    cell = bool_cell(stats.adapter_gate(run), run["step"])
    if identity.any():
        cell.text += f"; {int(identity.sum())} with the identity adapter, not judged"
    if relabelled.any():
        cell.text += (f" ({int(relabelled.sum())} recorded as not applied, before identity adapters were told apart: "
                      "read again as not judged)")
    return cell


def stale_steps(run: pd.DataFrame) -> pd.Series:
    """Steps whose rollout ran ahead on an older adapter (overlap); tables recorded before staleness have none."""
    if "rollout/staleness" not in run.columns or "trainer" not in run.columns:
        return pd.Series(False, index=run.index)
    return ran_ahead(run)


def gap_max_cell(values: pd.Series, stale: pd.Series) -> Cell:
    """The largest gap of the judged steps, and apart from it, marked unjudged, the stale steps' largest."""
    judged, ahead = values[~stale], values[stale]
    text = fmt(judged.max()) if judged.notna().any() else "–"
    if ahead.notna().any():
        text += f"; {fmt(ahead.max())} {STALE}"
    return Cell(text, "num")


def correctness_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    table = Table(["run"] + [h for _, h in BOOL_CHECKS] +
                  ["|Δ logprob| median [95% CI]", "|Δ logprob| max", "worst sample's |Δ logprob|", "failed requests",
                   "engine restarts"])
    for run_id in stats.run_order(df):
        run = run_rows(df, run_id)
        stale = stale_steps(run)
        diff = pd.to_numeric(run["check/rollout_logprob_abs_diff"], errors="coerce")
        # the worst single sample (older runs lack it): far above the mean it points at whole requests, not stray tokens
        worst = pd.to_numeric(run["check/logprob_gap_sample_max"], errors="coerce")
        failed = pd.to_numeric(run["errors/requests_failed"], errors="coerce")
        restarts = pd.to_numeric(run["errors/engine_restarts"], errors="coerce")
        table.rows.append([
            Cell(labels[run_id]),
            *(_adapter_cell(run) if c == "check/adapter_applied" else bool_cell(run[c], run["step"])
              for c, _ in BOOL_CHECKS),
            Cell(fmt_est(stats.bootstrap_median(diff[~stale])), "num"),
            gap_max_cell(diff, stale),
            gap_max_cell(worst, stale),
            Cell(fmt(failed.sum()) if failed.notna().any() else "–", "fail" if failed.sum() > 0 else "num"),
            Cell(fmt(restarts.sum()) if restarts.notna().any() else "–", "num"),
        ])
    return table


def client_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    """Per run: the rollout client's measured ceiling and how close each step's rollout came to it."""
    table = Table(["run", "client ceiling (tok/s)", "rollout tok/s, max", "max / ceiling",
                   f"steps clear of the ceiling (below {HEADROOM:.0%})", "controller CPU in rollout (%)",
                   "streamed requests", "stream events per token"])
    for run_id in stats.run_order(df):
        run = run_rows(df, run_id)

        def col(name: str, run: pd.DataFrame = run) -> pd.Series:
            return pd.to_numeric(run[name], errors="coerce") if name in run.columns else pd.Series(dtype=float)

        ceiling, tok_s = col("perf/client_ceiling_tok_s"), col("perf/throughput")
        if ceiling.notna().any():
            share = (tok_s / ceiling).max()
            flagged = bool_cell(run["check/client_headroom_ok"], run["step"])
            cells = [Cell(fmt(ceiling.median()), "num"), Cell(fmt(tok_s.max()), "num"),
                     Cell(f"{share:.0%}", "fail" if share >= HEADROOM else "num"), flagged]
        else:  # in-process vLLM has no HTTP client; runs before the ceiling was measured say so
            cells = [Cell("not measured", "na"), Cell(fmt(tok_s.max()), "num"), Cell("–", "na"), Cell("–", "na")]
        cpu = col("host/controller_cpu_pct_gen")
        streamed, per_token = col("perf/streamed_requests"), col("perf/events_per_token")
        cells += [Cell(fmt(cpu.median()) if cpu.notna().any() else "not recorded", "num"),
                  Cell(fmt(streamed.median()) if streamed.notna().any() else "all (before 2026-11-23)", "num"),
                  Cell(fmt(per_token.median()) if per_token.notna().any() else "–", "num")]
        table.rows.append([Cell(labels[run_id]), *cells])
    return table


def machine_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """Per run, over its steady steps: the GPUs' clock, power, temperature and slowdowns, the run's CPU and its
    busiest thread in rollout, and the controller's collector pauses where recorded; None where no run recorded
    them (older records)."""
    runs = machine.per_run(df)
    if not runs:
        return None
    shown = machine.columns(df)
    table = Table(["run", *(h for _, h, _ in shown), "busiest thread"])
    for run in runs:
        cells = [Cell(labels[run.run_id])]
        for column, _, _ in shown:
            value = run.values[column]
            if value is None:
                cells.append(Cell("–", "na"))
            elif column.startswith("gpu/slowdown_frac"):
                cells.append(Cell(f"{value:.0%}", "fail" if value > 0 else "num"))
            elif column.startswith("gpu/temp_c") or column == "host/gc_full_collections":
                cells.append(Cell(f"{value:.0f}", "num"))
            else:
                cells.append(Cell(fmt(value), "num"))
        table.rows.append([*cells, Cell(run.busiest or "–")])
    return table


# The mismatch between engine and trainer beyond the mean gap, over the later steps (task/rl.py computes them)
MISMATCH_COLUMNS = [("mismatch/kl_k3", "k3 KL, later steps"), ("mismatch/ess", "ESS share, later steps"),
                    ("mismatch/is_weight_mean", "IS weight mean, later steps")]


def gap_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """Per run: the trainer-vs-engine logprob gap at step 1 (identical weights: the numeric noise floor), its
    tiers over the run, its drift over the steps after the first, and the other mismatch metrics where recorded.
    A stale step's gap (a rollout from an older adapter) is shown apart and not judged: no median, drift or tier."""
    mismatch = [(m, head) for m, head in MISMATCH_COLUMNS if has_data(df, m)]
    table = Table(["run", "step 1: identical weights", "later steps: median [95% CI]", "max", "tiers",
                   "drift over steps (a step, 95% CI)", *(head for _, head in mismatch)])
    for run_id in stats.run_order(df):
        run = run_rows(df, run_id).sort_values("step")
        gap = pd.to_numeric(run["check/rollout_logprob_abs_diff"], errors="coerce")
        if not gap.notna().any():
            continue
        first = gap[run["step"] == 1]
        stale = stale_steps(run)
        later = (run["step"] > 1) & ~stale  # the median and the drift are the judged steps'
        tiers = run["check/logprob_gap_tier"].dropna() if "check/logprob_gap_tier" in run.columns else []
        counts = ", ".join(f"{n} {t}" for t in ("pass", "warn", "fail") if (n := int((tiers == t).sum())))
        tiered = counts or "not tiered (recorded before the tiers)"
        if stale.any():
            tiered += f", {int(stale.sum())} {STALE}"
        drift = trend.bootstrap_slope(run.loc[later, "step"], gap[later])
        # the other mismatch metrics over every later step: on a stale rollout they are what importance sampling meets
        after_first = run.loc[run["step"] > 1]
        table.rows.append([Cell(labels[run_id]), Cell(fmt(first.iloc[0]) if first.notna().any() else "–", "num"),
                           Cell(fmt_est(stats.bootstrap_median(gap[later])), "num"), gap_max_cell(gap, stale),
                           Cell(tiered, "fail" if "fail" in counts else "na" if not counts else "num"),
                           Cell(trend.trend_words(drift, ""), "num"),
                           *(Cell(fmt_est(stats.bootstrap_median(pd.to_numeric(after_first[m], errors="coerce")
                                                                 .dropna())), "num") for m, _ in mismatch)])
    return table if table.rows else None


def memory_trend_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """Per run whose engine slept: its GPU memory after each sleep and wake, what warm-up added, and the trend
    over the steps after warm-up (a one-off rise while caches and allocator pools fill is not a leak)."""
    # runs that read their engine's memory right after it started: its wakes are held to that (awake memory gate)
    woken = "check/awake_memory_ok" in df.columns and df["check/awake_memory_ok"].notna().any()
    # runs that read the engine's own memory asleep (the trainer's processes left out): the asleep gate judges that
    own = ENGINE_ASLEEP_OWN in df.columns and pd.to_numeric(df[ENGINE_ASLEEP_OWN], errors="coerce").notna().any()
    table = Table(["run", "sleeps", "asleep GB: first / after warm-up / last",
                   *(["the engine's own asleep GB (trainer left out): first / last"] if own else []),
                   "asleep: trend after warm-up (GB a step, 95% CI)",
                   "awake GB: at start / first wake / last" if woken else "awake GB, first / last",
                   "asleep memory gate", *(["awake memory gate (start − wake ≤ bound)"] if woken else [])])
    for run_id in stats.run_order(df):
        run = run_rows(df, run_id).sort_values("step")
        if "mem/engine_asleep_gb" not in run.columns:
            continue
        asleep = pd.to_numeric(run["mem/engine_asleep_gb"], errors="coerce")
        if not asleep.notna().any():
            continue
        later = stats.after_warmup(run)
        after = asleep[later.index]
        taken, first_after = asleep.dropna(), after.dropna()
        readings = [taken.iloc[0], first_after.iloc[0] if len(first_after) else None, taken.iloc[-1]]
        woke = _first_last(run, "mem/engine_awake_gb")
        if woken:
            started = pd.to_numeric(run.get("mem/engine_started_gb", pd.Series(dtype=float)), errors="coerce")
            woke = f"{fmt(started.dropna().iloc[0]) if started.notna().any() else '–'} / {woke}"
        est = trend.bootstrap_slope(later["step"], after)
        gate = (bool_cell(run["check/asleep_memory_ok"], run["step"]) if "check/asleep_memory_ok" in run.columns
                else Cell("not checked", "na"))
        table.rows.append([Cell(labels[run_id]), Cell(str(int(asleep.notna().sum())), "num"),
                           Cell(" / ".join("–" if r is None else fmt(r) for r in readings), "num"),
                           *([Cell(_first_last(run, ENGINE_ASLEEP_OWN), "num")] if own else []),
                           Cell(trend.trend_words(est, "GB"), "num"), Cell(woke, "num"), gate,
                           *([_awake_gate(run)] if woken else [])])
    return table if table.rows else None


def _first_last(run: pd.DataFrame, column: str) -> str:
    """A run's first and last reading of a column, 'first / last'; '–' where it has none."""
    values = pd.to_numeric(run.get(column, pd.Series(dtype=float)), errors="coerce").dropna()
    return f"{fmt(values.iloc[0])} / {fmt(values.iloc[-1])}" if len(values) else "–"


def _awake_gate(run: pd.DataFrame) -> Cell:
    """The awake memory gate's steps, with the largest shortfall where one failed."""
    if "check/awake_memory_ok" not in run.columns:
        return Cell("not checked", "na")
    cell = bool_cell(run["check/awake_memory_ok"], run["step"])
    short = pd.to_numeric(run.get("check/awake_shortfall_gb", pd.Series(dtype=float)), errors="coerce").max()
    return Cell(f"{cell.text}; {fmt(short)} GB short at most", cell.cls) if cell.cls == "fail" else cell


def _text_table(header: list[str], rows: list[list[str]], kind: Callable[[str], str]) -> Table | None:
    """A table of report.learning's text rows; kind(cell) gives each figure cell its class; None without rows."""
    if not rows:
        return None
    table = Table(header)
    table.rows = [[Cell(r[0]), *(Cell(c, kind(c)) for c in r[1:])] for r in rows]
    return table


def accuracy_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """Time to accuracy X per run (report.learning); None when no run has an eval."""
    return _text_table(*learning.time_to_accuracy(df, labels),
                       lambda c: "na" if c in ("not reached", "–") else "num")


def accuracy_replicates_table(df: pd.DataFrame, by_config: dict[str, str]) -> Table | None:
    """Time to accuracy X per configuration over its replicates (report.learning); None without replicates."""
    return _text_table(*learning.time_to_accuracy_over_replicates(df, by_config),
                       lambda c: "na" if c.startswith("0 of") else "num")


def learning_trend_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """Per run: how sampled and eval accuracy, policy entropy and response length moved (report.learning.trends)."""
    return _text_table(*learning.trends(df, labels), lambda c: "na" if c == "–" else "")


def detail_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    """Every numeric metric (rows) of every configuration (columns), with n where it differs."""
    metrics = [m for m in DETAIL_METRICS if has_data(df, m)]
    long = stats.summarise(df, metrics)
    cfgs = stats.configs(df)
    table = Table(["metric", *(labels[c[-1]] for c in cfgs)])
    steady = stats.steady_state(df)
    n_steps = steady.groupby("config_id")["step"].count()
    n_stale = stale_steps(steady).groupby(steady["config_id"]).sum()
    for metric, rows in long.groupby("metric", sort=False):
        by_run = rows.set_index("config_id")
        cells = [Cell(str(metric), "key")]
        for config in cfgs:
            row = by_run.loc[config[-1]]
            est = stats.Estimate(row["median"], row["ci_lo"], row["ci_hi"], int(row["n"]), int(row["n_runs"]))
            note = f" (n={est.n})" if 0 < est.n != n_steps.get(config[-1], 0) else ""
            if metric in GAP_READINGS and (k := int(n_stale.get(config[-1], 0))):
                n = int(n_steps.get(config[-1], 0))
                note += f", {STALE}" if k == n else f"; {k} of its {n} steps {STALE}"
            cells.append(Cell(fmt_est(est) + note, "num"))
        table.rows.append(cells)
    return table


def _short(value: Any, n: int = 12) -> str:
    return "–" if value in (None, "") else str(value)[:n]


def _provenance_row(label: str, prov: dict[str, Any] | None) -> dict[str, Any]:
    if prov is None:
        return {"run": label, "missing": True, "cells": [], "engine": ""}
    pkgs = {k: v for k, v in (prov.get("packages") or {}).items() if v}
    gpu = prov.get("gpu") or {}
    devices = gpu.get("devices") or []
    gpu_text = "none" if not devices else f"{len(devices)}× {devices[0].get('name', '?')}"
    container = prov.get("container") or {}
    host = prov.get("host") or {}
    cells = [
        ("git", commit_label(prov.get("git") or {}) or "–"), ("python", prov.get("python") or "–"),
        ("packages", ", ".join(f"{k} {v}" for k, v in sorted(pkgs.items())) or "–"),
        ("host", f"{host.get('hostname', '–')} ({host.get('cpu_model', '–')})"),
        ("GPU", gpu_text), ("driver", gpu.get("driver") or "–"),
        ("image", _short(container.get("image_digest"), 19)),
    ]
    engine = json.dumps(prov.get("engine"), sort_keys=True, default=str) if prov.get("engine") else ""
    return {"run": label, "missing": False, "cells": cells, "engine": engine}


def provenance_rows(df: pd.DataFrame, labels: dict[str, str], runs_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for run_id in stats.run_order(df):
        prov = read_provenance(runs_dir / str(run_id) / "provenance.json")
        rows.append({**_provenance_row(labels[run_id], prov), "run_id": run_id})
    return rows
