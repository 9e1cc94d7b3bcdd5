"""Learning against time: the wall clock a run has trained for at each step, the time each run took to reach
an eval accuracy, and how its learning readings moved over its steps.

The wall clock of a step is the sum of timing_s/step up to and including it: the engine's first start and the
eval passes (timing_s/eval) are not part of any step, so runs with and without evals, or with a slower first
start, are compared on the training loop alone.
"""

from __future__ import annotations

import pandas as pd

from hybridrl.report import trend
from hybridrl.report.stats import run_order, with_ids

FIXED_TARGETS = (0.1, 0.25, 0.5)


def with_wall_clock(df: pd.DataFrame) -> pd.DataFrame:
    """df with `wall_s`: each run's cumulative timing_s/step in step order."""
    out = df.sort_values(["run_id", "step"]).copy()
    step_s = pd.to_numeric(out["timing_s/step"], errors="coerce").fillna(0.0)
    out["wall_s"] = step_s.groupby(out["run_id"]).cumsum()
    return out


def evals(df: pd.DataFrame) -> pd.DataFrame:
    """The steps that have an eval/accuracy, with their wall clock."""
    if "eval/accuracy" not in df.columns:
        return df.iloc[0:0].assign(wall_s=[])
    out = with_wall_clock(df)
    out["eval/accuracy"] = pd.to_numeric(out["eval/accuracy"], errors="coerce")
    return out[out["eval/accuracy"].notna()]


def targets(df: pd.DataFrame) -> list[float]:
    """FIXED_TARGETS and the best accuracy that every run reached (when above 0), so one column always compares."""
    found = evals(df)
    if found.empty:
        return []
    common = found.groupby("run_id")["eval/accuracy"].max().min()
    return sorted({*FIXED_TARGETS, *([round(float(common), 4)] if common > 0 else [])})


def time_to_accuracy(df: pd.DataFrame, labels: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per run, its first and best eval accuracy and, per target, the wall clock (s) and step at
    which an eval first reached it; empty when no run has evals."""
    found, wanted = evals(df), targets(df)
    if found.empty:
        return [], []
    header = ["run", "first eval (step: accuracy)", "best eval accuracy",
              *(f"time to accuracy ≥ {t:.1%}" for t in wanted)]
    rows = []
    for rid in run_order(df):
        run = found[found["run_id"] == rid]
        if run.empty:
            rows.append([labels[rid], "no eval", "–", *("–" for _ in wanted)])
            continue
        first = run.iloc[0]
        best = run["eval/accuracy"].max()
        cells = [labels[rid], f"{int(first['step'])}: {first['eval/accuracy']:.1%}", f"{best:.1%}"]
        for t in wanted:
            hit = run[run["eval/accuracy"] >= t - 1e-9]
            cells.append(f"{hit.iloc[0]['wall_s']:.1f} s (step {int(hit.iloc[0]['step'])})" if not hit.empty
                         else "not reached")
        rows.append(cells)
    return header, rows


def replicated(df: pd.DataFrame) -> list[str]:
    """The configurations that have two or more runs (replicates), in the report's order."""
    config_of = with_ids(df).drop_duplicates("run_id").set_index("run_id")["config_id"]
    counts = config_of.value_counts()
    return [c for c in dict.fromkeys(config_of[rid] for rid in run_order(df)) if counts[c] >= 2]


def replicate_curve(source: pd.DataFrame, config_id: str, metric: str, x: str) -> pd.DataFrame:
    """One configuration's curve over its replicates: per step that two or more of its runs recorded, the mean of
    x and of metric over those runs, the metric's lowest and highest run (the band a reader sees) and n_runs."""
    rows = with_ids(source)
    rows = rows[rows["config_id"] == config_id].assign(_y=lambda d: pd.to_numeric(d[metric], errors="coerce"))
    rows = rows[rows["_y"].notna()]
    curve = rows.groupby("step").agg(x=(x, "mean"), mean=("_y", "mean"), lo=("_y", "min"), hi=("_y", "max"),
                                     n_runs=("run_id", "nunique")).reset_index()
    return curve[curve["n_runs"] >= 2]


def time_to_accuracy_over_replicates(df: pd.DataFrame, labels: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per configuration with replicates and per target, how many of its runs reached it and the
    median wall clock of those that did, with the range over them; empty when no configuration has replicates with
    evals. A run that never reached a target has no time for it, so the median is of the runs that did."""
    found, wanted = with_ids(evals(df)), targets(df)
    configs = [c for c in replicated(df) if (found["config_id"] == c).any()]
    n_runs = with_ids(df).groupby("config_id")["run_id"].nunique()
    if not configs:
        return [], []
    header = ["configuration", "runs", *(f"time to accuracy ≥ {t:.1%}: reached by; median [range]" for t in wanted)]
    rows = []
    for config in configs:
        runs = found[found["config_id"] == config]
        n = int(n_runs[config])
        cells = [labels[config], str(n)]
        for t in wanted:
            hit = runs[runs["eval/accuracy"] >= t - 1e-9].sort_values("step").groupby("run_id").first()["wall_s"]
            cells.append(f"{len(hit)} of {n}" + (f"; {hit.median():.1f} s [{hit.min():.1f}, {hit.max():.1f}]"
                                                  if len(hit) else ""))
        rows.append(cells)
    return header, rows


# what a run's learning is read from, each over all of its steps (learning has no warm-up to leave out)
TREND_METRICS = (("reward/accuracy", "sampled accuracy"), ("eval/accuracy", "eval accuracy (greedy)"),
                 ("train/entropy", "policy entropy (nats per token)"),
                 ("response_length/mean", "response length (tokens)"))


def trends(df: pd.DataFrame, labels: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per run, each TREND_METRICS reading's first and last value and its least-squares slope
    over steps with a bootstrap interval (report.trend); empty unless some run has an eval or an entropy on at least
    three steps, the readings that say whether a policy learns or only sharpens."""
    cols = [(c, name) for c, name in TREND_METRICS if c in df.columns]
    signal = [c for c in ("eval/accuracy", "train/entropy") if c in df.columns]
    if not signal or not any(pd.to_numeric(df[c], errors="coerce").groupby(df["run_id"]).count().max() >= 3
                             for c in signal):
        return [], []
    header = ["run", "steps", *(f"{name}: first → last; trend" for _, name in cols)]
    rows = []
    for rid in run_order(df):
        run = df[df["run_id"] == rid].sort_values("step")
        cells = [labels[rid], f"{int(run['step'].min())}–{int(run['step'].max())}"]
        for c, _ in cols:
            y = pd.to_numeric(run[c], errors="coerce")
            seen = y.notna()
            if seen.sum() < 2:
                cells.append("–")
                continue
            est = trend.bootstrap_slope(run.loc[seen, "step"], y[seen])
            cells.append(f"{y[seen].iloc[0]:.3g} → {y[seen].iloc[-1]:.3g}; {trend.trend_words(est, '')}")
        rows.append(cells)
    return header, rows
