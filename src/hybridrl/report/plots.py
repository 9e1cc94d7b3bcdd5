"""PNG plots of the tidy step table: throughput, step-time breakdown, latency, reward, memory, timeline, machine."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

matplotlib.use("Agg")  # headless: cluster nodes and CI have no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from PIL import Image  # noqa: E402

from hybridrl.report.aggregate import atomic_path, placement_name, to_bool  # noqa: E402
from hybridrl.report.learning import evals, replicate_curve, replicated, with_wall_clock  # noqa: E402
from hybridrl.report.placements import METRICS as PLACEMENT_METRICS  # noqa: E402
from hybridrl.report.placements import groups as placement_groups  # noqa: E402
from hybridrl.report.placements import pairings as placement_pairings  # noqa: E402
from hybridrl.report.stats import WARMUP_STEPS, run_order, steady_state, unattributed_s, with_ids  # noqa: E402
from hybridrl.run.record import PHASE_KEYS as PHASES  # noqa: E402

LABEL_FIELDS = ["engine", "placement", "trainer", "model", "tp", "release", "update_layout", "text", "connections",
                "heap"]
TEXT_KEYS = ("vllm_detokenize", "sglang_detokenize")  # an engine asked for token ids only: one label for both
# label field -> (run key, its name where the run set it true)
SWITCH_LABELS = {"connections": ("keep_connections", "connections kept"), "heap": ("gc_freeze", "heap frozen")}
PHASE_COLORS = {
    "timing_s/prepare": "#A6C8E0", "timing_s/gen": "#4C72B0", "timing_s/reward": "#DD8452", "timing_s/sleep": "#937860",
    "timing_s/release_onload": "#6B6B2E",
    "timing_s/trainer_onload": "#8C8C3C", "timing_s/update_actor": "#55A868", "timing_s/save_adapter": "#64B5CD",
    "timing_s/trainer_offload": "#CCB974", "timing_s/await_rollout": "#2F4B7C", "timing_s/wake": "#DA8BC3",
    "timing_s/restart": "#8172B3",
    "timing_s/update_weights": "#C44E52", "timing_s/check": "#4A4A4A", "timing_s/save_state": "#9DB0C8",
    "timing_s/recover": "#E5AE38",
    "other": "#BBBBBB",
}
LATENCY = [
    # per-request TPOT, not per-event ITL: SGLang's one-token bursts make ITL percentiles compare nothing
    ("perf/ttft_s_p50", "TTFT p50 (s)"), ("perf/tpot_ms_p50", "TPOT p50 over requests (ms)"),
    ("perf/latency_s_p50", "Latency p50 (s)"), ("perf/ttft_s_p99", "TTFT p99 (s)"),
    ("perf/tpot_ms_p99", "TPOT p99 over requests (ms)"), ("perf/latency_s_p99", "Latency p99 (s)"),
]
MEMORY = [("mem/used_gb_gen", "during gen"), ("mem/used_gb_train", "during train"), ("mem/peak_gb", "peak")]

# Every figure is drawn at most as wide as report.html's column (the body's 1,200 px less its padding and the
# image's border), so the page shows it at the size it is drawn and no text shrinks below MIN_TEXT_PX.
DPI = 110
PAGE_PX = 1150
PAD_IN = 0.1  # what savefig's tight box adds around the figure on each side
PAGE_IN = PAGE_PX / DPI - 2 * PAD_IN
MIN_TEXT_PX = 10.0


def run_labels(df: pd.DataFrame) -> dict[str, str]:
    """Short legend labels: the config fields that differ between runs, plus the id's hash if needed."""
    first = df.drop_duplicates("run_id").set_index("run_id")
    keys = [k for k in TEXT_KEYS if k in first.columns]
    if keys:  # named only where an engine made no text; runs before the keys made it
        first = first.assign(text=["token ids only" if any(to_bool(row[k]) is False for k in keys) else ""
                                   for _, row in first.iterrows()])
    for field_, (key, name) in SWITCH_LABELS.items():  # named only where on: the arm beside its twin without it
        if key in first.columns:
            first = first.assign(**{field_: [name if to_bool(v) is True else "" for v in first[key]]})
    fields = [f for f in LABEL_FIELDS if f in first.columns]
    runs = first[fields].astype(object).fillna("").astype(str)
    if "placement" in fields:  # a split whose rollouts run ahead is its own arm
        named = pd.Series([placement_name(row) for _, row in first.iterrows()], index=first.index, dtype=object)
        runs["placement"] = named.where(runs["placement"] != "", "")
    varying = [f for f in fields if runs[f].nunique() > 1] or ["engine", "placement"]
    if (runs[varying] == "").all(axis=1).any():  # a field only some runs name (token ids only): the rest read as
        varying = [f for f in ("engine", "release") if f in fields and f not in varying] + varying  # their engine
    labels = {rid: " · ".join(v for v in runs.loc[rid, varying] if v) for rid in runs.index}
    if len(set(labels.values())) < len(labels):  # same config, different seed or parameter
        labels = {rid: f"{lab} ({str(rid).rsplit('-', 1)[-1]})" for rid, lab in labels.items()}
    return labels


def config_labels(df: pd.DataFrame) -> dict[str, str]:
    """One label per configuration: its first replicate's run label, without the replicate's suffix."""
    first = df.sort_values(["replicate", "run_id"]).drop_duplicates("config_id")
    labels = run_labels(df[df["run_id"].isin(first["run_id"])])
    return {c: labels[r] for c, r in zip(first["config_id"], first["run_id"], strict=True)}


def run_colors(df: pd.DataFrame) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10" if df["run_id"].nunique() <= 10 else "tab20")
    return {rid: cmap(i % cmap.N) for i, rid in enumerate(run_order(df))}


def _runs(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    return [(rid, df[df["run_id"] == rid]) for rid in run_order(df)]


def _has(df: pd.DataFrame, cols: list[str]) -> bool:
    return any(c in df.columns and pd.to_numeric(df[c], errors="coerce").notna().any() for c in cols)


def _save(fig: Figure, out: Path) -> Path:
    """The figure as a PNG of 256 colours: a quarter of the bytes of full colour for these plots, and every
    committed study's plots travel with the tree to each GPU lease (64 MiB a call, overlay parts included)."""
    raw = io.BytesIO()
    fig.savefig(raw, format="png", dpi=DPI, bbox_inches="tight", pad_inches=PAD_IN,
                metadata={"Software": None})
    plt.close(fig)
    raw.seek(0)
    image = Image.open(raw).convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    with atomic_path(out) as tmp:
        image.save(tmp, format="PNG", optimize=True)
    return out


def text_px_on_page(fig: Figure, width_px: int) -> float:
    """The height in screen pixels of the figure's smallest visible text, once its PNG (width_px wide) is shown in
    the report's column: images wider than the column are scaled down to it."""
    sizes = [t.get_fontsize() for t in fig.findobj(plt.Text) if t.get_visible() and t.get_text().strip()]
    return min(sizes, default=math.inf) * DPI / 72 * min(1.0, PAGE_PX / width_px)


def _grid(n: int, cols: int = 2, panel_in: float = 3.2) -> tuple[Figure, list[plt.Axes]]:
    """n panels, `cols` to a row, the figure as wide as the report's column; the slots past n are switched off
    (the legend takes the first of them)."""
    cols = min(cols, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(PAGE_IN, panel_in * rows), squeeze=False, layout="constrained")
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.axis("off")
    return fig, flat


def _legend(fig: Figure, axes: list[plt.Axes], n: int) -> None:
    """The first panel's legend in the grid's spare slot, or under the panels where there is none: on a panel it
    would hide the lines of as many runs as it lists."""
    handles, names = axes[0].get_legend_handles_labels()
    if len(axes) > n:
        axes[n].legend(handles, names, fontsize=8, loc="center")
    else:
        fig.legend(handles, names, fontsize=8, loc="outside lower center", ncols=min(3, len(names)))


def _mark_warmup(ax: plt.Axes) -> None:
    ax.axvspan(0.5, WARMUP_STEPS + 0.5, color="#999999", alpha=0.15, lw=0, label="warm-up")


def _per_step(df: pd.DataFrame, metrics: list[tuple[str, str]], title: str, out: Path) -> Path | None:
    metrics = [(m, lab) for m, lab in metrics if _has(df, [m])]
    if not metrics:
        return None
    labels, colors = run_labels(df), run_colors(df)
    fig, axes = _grid(len(metrics))
    for ax, (metric, ylabel) in zip(axes, metrics, strict=False):
        for rid, run in _runs(df):
            ax.plot(run["step"], pd.to_numeric(run[metric], errors="coerce"), marker="o", ms=3,
                    color=colors[rid], label=labels[rid])
        _mark_warmup(ax)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    _legend(fig, axes, len(metrics))
    fig.suptitle(title)
    return _save(fig, out)


THROUGHPUT = [("perf/throughput", "rollout throughput (tok/s)"), ("perf/train_tok_s", "training throughput (tok/s)")]
REWARD = [("reward/mean", "reward mean"), ("reward/accuracy", "accuracy"),
          ("response_length/mean", "response length (tokens)"), ("response/stop_ratio", "share stopped at EOS"),
          ("train/entropy", "policy entropy (nats per token)")]
SLEEP_MEMORY = [("mem/engine_asleep_gb", "used after sleep (GB)"), ("mem/engine_awake_gb", "used after wake (GB)")]
MISMATCH = [("check/rollout_logprob_abs_diff", "mean |Δ logprob|"), ("mismatch/kl_k3", "k3 KL"),
            ("mismatch/ess", "effective sample size (share of tokens)")]


def plot_throughput(df: pd.DataFrame, out: Path) -> Path | None:
    """Rollout output tokens/s (and trainer tokens/s when recorded) per step, one line per run."""
    return _per_step(df, THROUGHPUT, "Throughput per step (shaded: warm-up, excluded from statistics)", out)


def plot_reward(df: pd.DataFrame, out: Path) -> Path | None:
    return _per_step(df, REWARD, "Learning per step", out)


def plot_sleep_memory(df: pd.DataFrame, out: Path) -> Path | None:
    """NVML's used GPU memory right after each sleep and each wake, per step: a leak shows as a rising line."""
    return _per_step(df, SLEEP_MEMORY, "Engine GPU memory across sleep and wake (NVML, whole GPU; shaded: warm-up)",
                     out)


def plot_mismatch(df: pd.DataFrame, out: Path) -> Path | None:
    """The trainer-vs-engine mismatch per step, one line per run: a gap that grows over the steps is drift; step 1
    (identical weights) is the numeric noise floor."""
    return _per_step(df, MISMATCH, "Trainer vs engine on the rollout tokens, per step (shaded: warm-up)", out)


def has_evals(df: pd.DataFrame) -> bool:
    return not evals(df).empty


def plot_learning(df: pd.DataFrame, out: Path) -> Path | None:
    """Eval accuracy and rollout reward against the step and against the wall clock the run has trained for
    (report.learning): one line per run, and for a configuration with replicates their mean, shaded from the
    lowest to the highest run, its runs drawn faint; None when no run has an eval."""
    if not has_evals(df):
        return None
    df = with_ids(df)
    labels, colors, timed, found = run_labels(df), run_colors(df), with_wall_clock(df), evals(df)
    pooled = replicated(df)
    by_config, config_of = config_labels(df), df.drop_duplicates("run_id").set_index("run_id")["config_id"]
    fig, flat = _grid(4, panel_in=3.4)
    axes = [flat[:2], flat[2:]]
    panels = [(found, "eval/accuracy", "eval accuracy (greedy, test slice)"), (timed, "reward/mean", "reward mean")]
    for row, (source, metric, ylabel) in enumerate(panels):
        for col, (x, xlabel) in enumerate([("step", "step"), ("wall_s", "training wall clock (s)")]):
            ax = axes[row][col]
            for rid in run_order(df):
                run, replicate = source[source["run_id"] == rid], config_of[rid] in pooled
                ax.plot(run[x], pd.to_numeric(run[metric], errors="coerce"), marker="o", ms=2 if replicate else 3,
                        color=colors[rid], alpha=0.3 if replicate else 1.0,
                        label=None if replicate else labels[rid])
            for config in pooled:
                curve = replicate_curve(source, config, metric, x)
                if curve.empty:
                    continue
                color = colors[next(r for r in run_order(df) if config_of[r] == config)]
                ax.fill_between(curve["x"], curve["lo"], curve["hi"], color=color, alpha=0.2, lw=0)
                ax.plot(curve["x"], curve["mean"], color=color, lw=2,
                        label=f"{by_config[config]}: mean of {int(curve['n_runs'].max())} runs")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if x == "step":
                ax.xaxis.get_major_locator().set_params(integer=True)
    fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=8, loc="outside lower center", ncols=2)
    # two lines: as one, the title is wider than the report's column
    fig.suptitle("Learning against steps and wall clock\n(eval passes and the first engine start excluded"
                 + ("; replicated configurations: mean, shaded over their runs)" if pooled else ")"))
    return _save(fig, out)


def step_breakdown(df: pd.DataFrame) -> pd.DataFrame:
    """Median steady-state seconds per phase and run; 'other' is the median of what each step's phases do not
    explain (not the median step less the phases' medians: medians do not add, and that gap is no time of any step)."""
    steady = steady_state(df)
    if steady.empty:
        steady = df
    rows = {}
    for rid, run in _runs(steady):
        phases = {p: float(np.nan_to_num(pd.to_numeric(run[p], errors="coerce").median())) for p in PHASES}
        phases["other"] = max(0.0, float(np.nan_to_num(unattributed_s(run).median())))
        rows[rid] = phases
    return pd.DataFrame.from_dict(rows, orient="index")


def has_step_times(df: pd.DataFrame) -> bool:
    return _has(df, [*PHASES, "timing_s/step"])


def plot_step_breakdown(df: pd.DataFrame, out: Path) -> Path | None:
    """Stacked bars: median seconds per phase of a steady-state step, one bar per run."""
    if not has_step_times(df):
        return None
    table = step_breakdown(df)
    labels = run_labels(df)
    fig, ax = plt.subplots(figsize=(min(PAGE_IN, max(6.0, 1.4 * len(table) + 3)), 4.5), layout="constrained")
    x = np.arange(len(table))
    bottom = np.zeros(len(table))
    for phase in table.columns:
        vals = table[phase].to_numpy()
        if not vals.any():
            continue
        name = phase.split("/")[-1]
        ax.bar(x, vals, bottom=bottom, color=PHASE_COLORS[phase], label=name, width=0.6)
        bottom += vals
    ax.set_xticks(x, [labels[r] for r in table.index], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds (median over steady-state steps)")
    ax.set_title("Step-time breakdown")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    return _save(fig, out)


def stacked_bars(rows: list[tuple[str, list[float], Any]], parts: list[str], ylabel: str, title: str,
                 out: Path) -> Path:
    """Stacked bars from medians already taken: one bar a row (label, a median for each of `parts`, the whole's
    estimate, drawn as a whisker where it has an interval)."""
    fig, ax = plt.subplots(figsize=(min(PAGE_IN, max(6.0, 1.4 * len(rows) + 3)), 4.5), layout="constrained")
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    colors = plt.get_cmap("tab10")
    for j, part in enumerate(parts):
        vals = np.nan_to_num(np.array([r[1][j] for r in rows], dtype=float))
        ax.bar(x, vals, bottom=bottom, color=colors(j), label=part, width=0.6)
        bottom += vals
    for i, (_, _, est) in enumerate(rows):
        if np.isfinite(est.lo) and np.isfinite(est.hi):
            ax.errorbar(i, est.value, yerr=[[est.value - est.lo], [est.hi - est.value]], color="black", capsize=4)
    ax.set_xticks(x, [r[0] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    return _save(fig, out)


def has_placements(df: pd.DataFrame) -> bool:
    return bool(placement_pairings(df))


def plot_placements(df: pd.DataFrame, out: Path) -> Path | None:
    """Per engine (a row) and metric (a column): each placement's median with its 95% interval over runs and
    steps, and every run's own median beside it, so a reader sees both the estimate and the runs it rests on."""
    if not has_placements(df):
        return None
    gs, steady = placement_groups(df), steady_state(df)
    fig, axes = plt.subplots(len(gs), len(PLACEMENT_METRICS), figsize=(PAGE_IN, 3.4 * len(gs)), squeeze=False,
                             layout="constrained")
    for row, g in zip(axes, gs, strict=True):
        for j, (ax, m) in enumerate(zip(row, PLACEMENT_METRICS, strict=True)):
            for i, arm in enumerate(g.arms):
                est = arm.values[j]
                if np.isfinite(est.lo):
                    ax.errorbar([i], [est.value], yerr=[[est.value - est.lo], [est.hi - est.value]], fmt="o",
                                color="#4C72B0", capsize=4)
                runs = steady[steady["config_id"] == arm.config_id].groupby("run_id")[m.column]
                medians = runs.apply(lambda x: pd.to_numeric(x, errors="coerce").median())
                ax.scatter(np.full(len(medians), i + 0.15), medians, s=12, color="#888888", zorder=3)
            ticks = [a.label.replace(" (", "\n(").replace(", ", "\n") for a in g.arms]
            ax.set_xticks(range(len(g.arms)), ticks, fontsize=8)
            ax.set_title(f"{g.engine}\n{m.name}", fontsize=9)  # two lines: three titles share the width
            ax.set_ylabel(m.unit)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Placements per engine: median [95% CI] over runs and steps (blue), each run's median (grey)",
                 fontsize=10)
    return _save(fig, out)


def plot_latency(df: pd.DataFrame, out: Path) -> Path | None:
    """Boxplots over steady-state steps of the per-step TTFT, per-request TPOT and latency percentiles."""
    if not _has(df, [m for m, _ in LATENCY]):
        return None
    steady = steady_state(df)
    if steady.empty:
        steady = df
    labels, colors = run_labels(df), run_colors(df)
    runs = run_order(df)
    fig, axes = _grid(len(LATENCY), cols=2 if len(runs) <= 4 else 1, panel_in=2.8)
    for ax, (metric, title) in zip(axes, LATENCY, strict=True):
        data = [pd.to_numeric(steady.loc[steady["run_id"] == r, metric], errors="coerce").dropna().to_numpy()
                for r in runs]
        if not any(len(d) for d in data):
            ax.set_title(f"{title}: no data", fontsize=9)
            ax.axis("off")
            continue
        box = ax.boxplot([d if len(d) else [np.nan] for d in data], patch_artist=True, widths=0.6)
        for patch, rid in zip(box["boxes"], runs, strict=True):
            patch.set_facecolor(colors[rid])
            patch.set_alpha(0.6)
        ax.set_xticks(range(1, len(runs) + 1), [labels[r] for r in runs], rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Request latency per step (steady-state steps)")
    return _save(fig, out)


def plot_memory(df: pd.DataFrame, out: Path) -> Path | None:
    """Grouped bars of NVML GPU memory per phase (median over steps); skipped where not measured."""
    metrics = [(m, lab) for m, lab in MEMORY if _has(df, [m])]
    if not metrics:
        return None
    labels = run_labels(df)
    # CPU runs have no NVML numbers: leave them out rather than draw empty slots
    runs = [rid for rid, run in _runs(df) if _has(run, [m for m, _ in metrics])]
    fig, ax = plt.subplots(figsize=(min(PAGE_IN, max(6.0, 1.6 * len(runs) + 3)), 4.5), layout="constrained")
    width = 0.8 / len(metrics)
    x = np.arange(len(runs))
    for i, (metric, name) in enumerate(metrics):
        vals = [pd.to_numeric(df.loc[df["run_id"] == r, metric], errors="coerce").median() for r in runs]
        ax.bar(x + (i - (len(metrics) - 1) / 2) * width, vals, width=width, label=name)
    ax.set_xticks(x, [labels[r] for r in runs], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("GPU memory used (GB, NVML, max over GPUs)")
    ax.set_title("GPU memory per phase")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)


SESSION_GAP_S = 600.0  # steps further apart than this belong to separate sittings (e.g. two GPU leases)


def sittings(start: pd.Series, stop: pd.Series, gap_s: float = SESSION_GAP_S) -> pd.Series:
    """A sitting number per step: steps that follow each other with less than gap_s idle share one."""
    order = start.sort_values().index
    ids, latest, current = {}, -np.inf, -1
    for i in order:
        if start[i] > latest + gap_s:
            current += 1
        latest = max(latest, stop[i])
        ids[i] = current
    return pd.Series(ids).reindex(start.index)


def plot_timeline(df: pd.DataFrame, out: Path) -> Path | None:
    """Each step as a bar on the wall clock, from its start to its end, at its rollout throughput (and the
    host's CPU load, where recorded): which runs overlapped in time, and what that did to them. Sittings
    hours apart (two leases) get a panel each."""
    fig = timeline_figure(df)
    return None if fig is None else _save(fig, out)


def has_timeline(df: pd.DataFrame) -> bool:
    return all(_has(df, [c]) for c in ("time_unix", "timing_s/step", "perf/throughput"))


def timeline_figure(df: pd.DataFrame) -> Figure | None:
    """The figure of plot_timeline, unsaved; None without wall-clock times, step times or throughput."""
    if not has_timeline(df):
        return None
    panels = [("perf/throughput", "rollout throughput (tok/s)")]
    if _has(df, ["host/cpu_busy_pct_gen"]):
        panels.append(("host/cpu_busy_pct_gen", "host CPU busy in rollout (%)"))
    df = df.assign(_stop=pd.to_numeric(df["time_unix"], errors="coerce"))
    df = df.assign(_start=df["_stop"] - pd.to_numeric(df["timing_s/step"], errors="coerce")).dropna(
        subset=["_start", "_stop"])
    df = df.assign(_sitting=sittings(df["_start"], df["_stop"]))
    n_sit = int(df["_sitting"].max()) + 1
    labels, colors = run_labels(df), run_colors(df)
    fig, axes = plt.subplots(len(panels), n_sit, figsize=(PAGE_IN, 3.4 * len(panels)), sharey="row", squeeze=False,
                             layout="constrained")
    for k in range(n_sit):
        here = df[df["_sitting"] == k]
        t0 = here["_start"].min()
        for ax, (metric, ylabel) in zip(axes[:, k], panels, strict=True):
            if pd.to_numeric(here[metric], errors="coerce").isna().all():
                # e.g. host CPU load, which older runs did not record: say so rather than draw empty axes
                ax.text(0.5, 0.5, "not recorded in this sitting", ha="center", va="center",
                        transform=ax.transAxes, color="0.4")
                ax.set_xticks([])
            for rid, run in _runs(here):
                ax.hlines(pd.to_numeric(run[metric], errors="coerce"), (run["_start"] - t0) / 60,
                          (run["_stop"] - t0) / 60, color=colors[rid], lw=3, label=labels[rid])
            ax.grid(alpha=0.3)
            if k == 0:
                ax.set_ylabel(ylabel)
        start = pd.Timestamp(t0, unit="s").strftime("%Y-%m-%d %H:%M UTC")
        axes[-1][k].set_xlabel(f"minutes since {start}")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_legend_handles_labels()[0]}
    names = [labels[rid] for rid in run_order(df) if labels[rid] in handles]
    # beside the plot, not on it: the last runs' steps sit where "best" would put it
    axes[0][-1].legend([handles[n] for n in names], names, fontsize=8, loc="upper left",
                       bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("Steps on the wall clock: runs that overlapped in time")
    return fig


MACHINE = [("gpu/power_w_gen", "GPU power in rollout (W)"),
           ("host/busiest_thread_cpu_pct_gen", "busiest thread in rollout (% of a core)")]


def has_machine(df: pd.DataFrame) -> bool:
    return _has(df, [c for c, _ in MACHINE]) and _has(steady_state(df), ["perf/throughput"])


def plot_machine(df: pd.DataFrame, out: Path) -> Path | None:
    """Each steady step's rollout throughput against the GPU's power draw and the run's busiest CPU thread during
    that rollout, one colour per run: whether a slow step was the GPU's or one thread's doing. None where no run
    recorded them."""
    if not has_machine(df):
        return None
    panels, steady = [(c, x) for c, x in MACHINE if _has(df, [c])], steady_state(df)
    labels, colors = run_labels(df), run_colors(df)
    fig, axes = plt.subplots(1, len(panels), figsize=(PAGE_IN, 4), sharey=True, squeeze=False, layout="constrained")
    for ax, (column, xlabel) in zip(axes[0], panels, strict=True):
        for rid, run in _runs(steady):
            ax.scatter(pd.to_numeric(run[column], errors="coerce"), pd.to_numeric(run["perf/throughput"],
                       errors="coerce"), color=colors[rid], label=labels[rid], s=22)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("rollout throughput (tok/s)")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("The machine under each rollout (steady steps)")
    return _save(fig, out)


def _any_of(metrics: list[tuple[str, str]]) -> Callable[[pd.DataFrame], bool]:
    return lambda df: _has(df, [m for m, _ in metrics])


class Plot(NamedTuple):
    title: str
    draw: Callable[[pd.DataFrame, Path], Path | None]
    # whether the table has what the plot draws, asked without drawing it (make_all, `hybridrl reports`)
    has_data: Callable[[pd.DataFrame], bool]


PLOTS: dict[str, Plot] = {
    "throughput": Plot("Throughput per step", plot_throughput, _any_of(THROUGHPUT)),
    "step_breakdown": Plot("Step-time breakdown", plot_step_breakdown, has_step_times),
    "latency": Plot("Latency distributions", plot_latency, _any_of(LATENCY)),
    "reward": Plot("Reward per step", plot_reward, _any_of(REWARD)),
    "learning": Plot("Accuracy and reward against steps and wall clock", plot_learning, has_evals),
    "memory": Plot("GPU memory per phase", plot_memory, _any_of(MEMORY)),
    "mismatch": Plot("Trainer-vs-engine mismatch per step", plot_mismatch, _any_of(MISMATCH)),
    "sleep_memory": Plot("Engine GPU memory across sleep and wake", plot_sleep_memory, _any_of(SLEEP_MEMORY)),
    "placements": Plot("Placements per engine against colocate", plot_placements, has_placements),
    "timeline": Plot("Steps on the wall clock", plot_timeline, has_timeline),
    "machine": Plot("Rollout throughput against GPU power and the busiest CPU thread", plot_machine, has_machine),
}


def drawable(df: pd.DataFrame) -> list[str]:
    """The plots this table has data for: what make_all writes."""
    return [name for name, plot in PLOTS.items() if plot.has_data(df)]


def make_all(df: pd.DataFrame, plots_dir: Path) -> dict[str, Path]:
    """Write every plot that has data to plots_dir/<name>.png; return name -> path of those written."""
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, plot in PLOTS.items():
        path = plot.draw(df, plots_dir / f"{name}.png") if plot.has_data(df) else None
        if path is not None:
            written[name] = path
        else:  # a plot from an earlier report with data this table lacks would mislead
            (plots_dir / f"{name}.png").unlink(missing_ok=True)
    return written
