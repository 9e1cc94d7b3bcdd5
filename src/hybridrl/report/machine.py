"""The machine under each run: its GPUs' clock, power, temperature and slowdowns, and the busiest CPU thread of its
rollout (the record's gpu/* and host/* keys, steady-state steps).

Two runs of one engine that differ in speed but not here differ in the engine or its inputs; a run whose GPU clock
sat lower, or that reported slowdowns, was slowed by the machine. A busiest thread at a full core may limit the
rollout or may spin while it waits (SGLang's scheduler reads a full core at any load).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from hybridrl.report import stats

# (column, header, how the steady steps are summed up)
COLUMNS = (
    ("perf/throughput", "rollout tok/s", "median"),
    ("gpu/sm_clock_mhz_gen", "SM clock in rollout (MHz)", "median"),
    ("gpu/power_w_gen", "power in rollout (W)", "median"),
    ("gpu/temp_c_gen", "hottest in rollout (C)", "max"),
    ("gpu/slowdown_frac_gen", "rollout reads slowed", "mean"),
    ("gpu/sm_clock_mhz_update_actor", "SM clock in training (MHz)", "median"),
    ("gpu/slowdown_frac_update_actor", "training reads slowed", "mean"),
    ("host/run_cpu_pct_gen", "run's CPU in rollout (% of a core)", "median"),
    ("host/busiest_thread_cpu_pct_gen", "busiest thread (% of a core)", "median"),
)
MEASURED = tuple(c for c, _, _ in COLUMNS[1:])  # a run is shown where one of these was recorded
# shown where the study recorded them (newer records): the controller's garbage-collector pauses in rollout, which
# stop its rollout client too (hybridrl.run.gc_pauses)
RECORDED_ONLY = (
    ("host/gc_pause_s_gen", "collector pause in rollout (s, longest step)", "max"),
    ("host/gc_full_collections", "full collections", "sum"),
)


def columns(df: pd.DataFrame) -> tuple[tuple[str, str, str], ...]:
    """COLUMNS, and those of RECORDED_ONLY that some step of the study recorded."""
    recorded = tuple(c for c in RECORDED_ONLY
                     if c[0] in df.columns and pd.to_numeric(df[c[0]], errors="coerce").notna().any())
    return COLUMNS + recorded


@dataclass(frozen=True)
class RunMachine:
    run_id: str
    values: dict[str, float | None]  # column -> its summary over the run's steady steps
    busiest: str | None  # the thread most often the busiest in rollout ("process/thread")


def _summary(values: pd.Series, how: str) -> float | None:
    values = pd.to_numeric(values, errors="coerce").dropna()
    return float(getattr(values, how)()) if len(values) else None


def per_run(df: pd.DataFrame) -> list[RunMachine]:
    """One entry per run that recorded its machine, in the order runs are shown; empty for older records."""
    if not any(c in df.columns for c in MEASURED):
        return []
    steady, shown = stats.steady_state(df), columns(df)
    out = []
    for run_id in stats.run_order(df):
        run = steady[steady["run_id"] == run_id]
        values = {c: _summary(run[c], how) if c in run.columns else None for c, _, how in shown}
        if all(values[c] is None for c in MEASURED):
            continue
        names = run["host/busiest_thread_gen"].dropna() if "host/busiest_thread_gen" in run.columns else []
        out.append(RunMachine(run_id, values, str(names.mode().iloc[0]) if len(names) else None))
    return out
