"""report.md and report.html from the tidy step table, through the jinja2 templates in workflow/report."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from hybridrl.engines.client_ceiling import HEADROOM
from hybridrl.report import client_paths, conditions, headline, learning, machine, placements, stats, trend, wording
from hybridrl.report.aggregate import CONFIG_KEY, atomic_path, commit_label, read_provenance
from hybridrl.report.plots import PLOTS, run_labels
from hybridrl.run.checks import GAP_LIMITS
from hybridrl.run.record import CHECKS, HOST, LEARNING, MEMORY, ROLLOUT, TIMING, TRAINING

TEMPLATES = Path(__file__).resolve().parents[3] / "workflow" / "report"

# (column, heading, unit); the comparison table shows those with data, the detail table all of these.
KEY_METRICS = [
    ("perf/throughput", "Rollout throughput", "tok/s"),
    ("timing_s/step", "Step time", "s"),
    ("timing_s/gen", "Generation", "s"),
    ("timing_s/update_actor", "Training", "s"),
    ("timing_s/update_weights", "Weight sync", "s"),
    ("timing_s/restart", "Engine restart", "s"),
    # latency that means the same for every engine: no per-event ITL percentile (SGLang streams one-token bursts)
    ("perf/ttft_s_p50", "TTFT p50", "s"),
    ("perf/tpot_ms_p50", "TPOT p50 over requests", "ms"),
    ("perf/tpot_ms_p99", "TPOT p99 over requests", "ms"),
    # the engine's own timing of every request (run key engine_timing), where the client streamed only a few
    ("perf/engine_ttft_s_p50", "TTFT p50, engine-timed", "s"),
    ("perf/engine_tpot_ms_p50", "TPOT p50, engine-timed", "ms"),
    ("perf/latency_s_p50", "End-to-end latency p50", "s"),
    ("cost/tok_s_per_gpu", "Tokens/s per GPU, whole step", "tok/s"),
    ("cost/gpu_s_per_step", "GPU-seconds per step", "GPU-s"),
    ("cost/gpu_h_per_1k_rollouts", "GPU-hours per 1,000 rollouts", "GPU-h"),
    ("reward/mean", "Reward mean", ""),
    ("host/cpu_busy_pct_gen", "Host CPU busy in rollout", "%"),
]
RATIO_METRICS = [("perf/throughput", "Rollout throughput"), ("timing_s/step", "Step time"),
                 ("timing_s/gen", "Generation time"), ("cost/tok_s_per_gpu", "Tokens/s per GPU")]
# sleep and wake move what the engine releases: compared only between arms that move the same bytes
TRANSITIONS = [("timing_s/sleep", "sleep"), ("timing_s/wake", "wake")]
MOVES = {"kv-only": "KV cache only (weights stay on the GPU)", "full release": "weights and KV cache",
         "full release, re-pinned": "weights and KV cache, pinning the CPU copy anew every sleep",
         "level 1": "weights and KV cache", "level 2": "weights and KV cache (weights discarded)"}
NO_VLLM_KV_ONLY = ("vLLM 0.26 has no KV-only sleep: level 1 moves the weights to CPU memory and drops the KV "
                   "cache, level 2 drops both; so SGLang's KV-only release has no vLLM arm to compare with")
WARMUP_METRICS = ["timing_s/step", "timing_s/gen", "timing_s/restart", "timing_s/update_weights",
                  "perf/throughput", "perf/ttft_s_p50"]
DETAIL_METRICS = [c for c in (*TIMING, *ROLLOUT, *TRAINING, *MEMORY, *LEARNING, *HOST, *CHECKS)
                  if not c.startswith("check/") or (c.startswith(("check/rollout_logprob", "check/logprob_gap_"))
                                                     and c != "check/logprob_gap_max")]  # a setting, not a reading
BOOL_CHECKS = [
    ("check/base_canary_ok", "Base canary unchanged"),
    ("check/adapter_applied", "Adapter applied"),
    ("check/kv_capacity_ok", "KV capacity recovered"),
    ("check/logprob_agreement_ok", "Logprobs agree"),
]


@dataclass
class Cell:
    text: str
    cls: str = ""  # css class in html: ok / fail / na / num / key


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Cell]] = field(default_factory=list)


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


def _field(value: Any) -> str:
    """A config field as written in the config: 1 not 1.0, – for unset."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)) or value is pd.NA:
        return "–"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def fmt_est(est: stats.Estimate) -> str:
    if est.n == 0:
        return "–"
    if not math.isfinite(est.lo):
        return f"{fmt(est.value)} [n/a]"
    return f"{fmt(est.value)} [{fmt(est.lo)}, {fmt(est.hi)}]"


def fmt_n(est: stats.Estimate) -> str:
    """What an interval rests on: runs and steps."""
    return f"{est.n_runs} run{'s' if est.n_runs != 1 else ''} × {est.n} steps" if est.n else "–"


def _has(df: pd.DataFrame, col: str) -> bool:
    return col in df.columns and pd.to_numeric(df[col], errors="coerce").notna().any()


def _select(df: pd.DataFrame, run_id: str) -> pd.DataFrame:
    return df[(df["run_id"] == run_id).fillna(False).to_numpy(dtype=bool)]


def config_labels(df: pd.DataFrame) -> dict[str, str]:
    """One label per configuration: its first replicate's run label, without the replicate's suffix."""
    first = df.sort_values(["replicate", "run_id"]).drop_duplicates("config_id")
    labels = run_labels(df[df["run_id"].isin(first["run_id"])])
    return {c: labels[r] for c, r in zip(first["config_id"], first["run_id"], strict=True)}


def summary(df: pd.DataFrame, title: str) -> dict[str, Any]:
    steps = df.groupby("run_id")["step"].count()
    span = pd.to_numeric(df["time_unix"], errors="coerce").dropna()
    steady_n = len(stats.steady_state(df))
    drained = int((stats.drain(df) & (df["step"] > stats.warmup_steps(df))).sum())
    excluded = len(df) - len(stats.warmup(df)) - drained - steady_n
    warm = sorted({int(w) for w in stats.warmup_steps(df.drop_duplicates("run_id"))})
    replicates = df.groupby("config_id")["run_id"].nunique()
    return {
        "title": title,
        "n_runs": int(df["run_id"].nunique()),
        "n_configs": int(df["config_id"].nunique()),
        "replicates": f"{replicates.min()}" if replicates.min() == replicates.max()
        else f"{replicates.min()}–{replicates.max()}",
        "steps": f"{steps.min()}" if steps.min() == steps.max() else f"{steps.min()}–{steps.max()}",
        "n_records": len(df),
        **{f: ", ".join(sorted(df[f].dropna().astype(str).unique())) for f in
           ("engine", "placement", "trainer", "model")},
        "measured_s": fmt(pd.to_numeric(df["timing_s/step"], errors="coerce").sum()),
        "span_s": f"{fmt(span.max() - span.min())} s" if len(span) > 1 else "–",
        "warmup_steps": max(warm) if warm else stats.WARMUP_STEPS,
        "warmup_text": " or ".join(f"1–{w}" if w > 1 else str(w) for w in warm if w) or "none",
        "n_boot": stats.N_BOOT,
        "excluded_adapter": excluded,
        "drain": drained,
    }


def comparison_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    """One column per configuration (its replicates together); its fields first, then median [95% CI] of each
    key metric over runs and steps."""
    steady = stats.steady_state(df)
    metrics = [m for m in KEY_METRICS if _has(steady, m[0])]
    cfgs = stats.configs(df)
    table = Table(["", *(labels[c[-1]] for c in cfgs)])
    for i, key in enumerate(CONFIG_KEY):
        table.rows.append([Cell(key.replace("_", " "), "key"), *(Cell(_field(c[i])) for c in cfgs)])
    runs = [stats.select(steady, c) for c in cfgs]
    for col, heading in (("git_commit", "code"), ("gpu", "GPU")):
        values = [stats.select(df, c)[col].dropna().unique() if col in df.columns else [] for c in cfgs]
        if any(len(v) for v in values):
            table.rows.append([Cell(heading, "key"), *(Cell(", ".join(map(_field, v)) or "–") for v in values)])
    table.rows.append([Cell("n runs", "key"), *(Cell(str(stats.n_runs(r)), "num") for r in runs)])
    table.rows.append([Cell("n steps", "key"), *(Cell(str(len(r)), "num") for r in runs)])
    for col, heading, unit in metrics:
        cells = [Cell(heading + (f" ({unit})" if unit else ""), "key")]
        for run in runs:
            est = stats.estimate(run, col)
            # a metric measured on fewer steps than the configuration has says so next to its interval
            note = f" (n={est.n})" if 0 < est.n != len(run) else ""
            cells.append(Cell(fmt_est(est) + note, "num"))
        table.rows.append(cells)
    return table


def ratio_table(df: pd.DataFrame, labels: dict[str, str]) -> tuple[str, Table] | None:
    """Each configuration against the first one, as a ratio of medians with its interval."""
    configs = stats.configs(df)
    metrics = [(m, h) for m, h in RATIO_METRICS if _has(stats.steady_state(df), m)]
    if len(configs) < 2 or not metrics:
        return None
    base = configs[0]
    headers = [f"{h} ratio [95% CI]" for _, h in metrics]
    table = Table(["configuration", "vs baseline", *headers, "runs × steps (configuration / baseline)",
                   "recorded, against the baseline"])
    steady = stats.steady_state(df)
    wins = conditions.windows(df)
    for config in configs[1:]:
        cells = [Cell(fmt_est(stats.compare(df, m, config, base)), "num") for m, _ in metrics]
        a, b = stats.select(steady, config), stats.select(steady, base)
        n_pair = f"{stats.n_runs(a)} × {len(a)} / {stats.n_runs(b)} × {len(b)}"
        table.rows.append([Cell(labels[config[-1]]), Cell(labels[base[-1]]), *cells, Cell(n_pair, "num"),
                           Cell(conditions.relation(wins, config[-1], base[-1]))])
    return labels[base[-1]], table


def transitions(df: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any] | None:
    """Sleep and wake times per colocated configuration, grouped by what the release moves; ratios only within
    a group, so SGLang's KV-only release never sits beside a release that moves weights as if comparable."""
    steady = stats.steady_state(df)
    cfgs = [c for c in stats.configs(df) if c[CONFIG_KEY.index("release")] in MOVES]
    if not cfgs:
        return None
    groups: dict[str, list[tuple]] = {}
    for c in cfgs:
        groups.setdefault(MOVES[c[CONFIG_KEY.index("release")]], []).append(c)
    tables, n = [], 0
    for moves, members in groups.items():
        # one table per group: a KV-only release never stands in a table beside one that moves weights
        table = Table(["configuration", *(f"{h}, s" for _, h in TRANSITIONS),
                       *(f"{h} / {labels[members[0][-1]]} [95% CI]" for _, h in TRANSITIONS), "runs × steps"])
        first = stats.select(steady, members[0])
        for c in members:
            sub = stats.select(steady, c)
            ests = [stats.estimate(sub, m) for m, _ in TRANSITIONS]
            ratios = [stats.hierarchical_ratio(stats.per_run(sub, m), stats.per_run(first, m))
                      if c != members[0] else None for m, _ in TRANSITIONS]
            n += sum(r is not None and math.isfinite(r.lo) for r in ratios)
            table.rows.append([Cell(labels[c[-1]]), *(Cell(fmt_est(e), "num") for e in ests),
                               *(Cell(fmt_est(r) if r else "–", "num") for r in ratios),
                               Cell(fmt_n(ests[0]), "num")])
        tables.append({"moves": moves, "table": table})
    kv_only = any(MOVES.get(c[CONFIG_KEY.index("release")]) == MOVES["kv-only"] for c in cfgs)
    return {"groups": tables, "note": NO_VLLM_KV_ONLY if kv_only else "", "n_comparisons": n}


def _ratio_cell(est: stats.Estimate | None) -> Cell:
    if est is None:
        return Cell("–")
    return Cell(wording.ratio_text(est) if math.isfinite(est.lo) else fmt_est(est), "num")


def placement_tables(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Per engine, each placement against its colocated arm: medians of step time, tokens/s per GPU and
    GPU-seconds per step, their ratios to colocate with intervals, and sentences worded from those intervals."""
    metrics = placements.METRICS
    headers = ["placement", *(f"{m.name} ({m.unit})" for m in metrics),
               *(f"{m.name} / colocate [95% CI]" for m in metrics), "runs × steps", "recorded, against colocate"]
    out = []
    for g in placements.groups(df):
        table = Table(list(headers))
        for arm in g.arms:
            table.rows.append([Cell(arm.label), *(Cell(fmt_est(v), "num") for v in arm.values),
                               *(_ratio_cell(r) for r in arm.ratios), Cell(f"{arm.n[0]} × {arm.n[1]}", "num"),
                               Cell(arm.recorded)])
        out.append({"title": f"{g.engine}: placements against colocate",
                    "shared": ", ".join(f"{k} {_field(v)}" for k, v in g.key.items()), "table": table,
                    "caveats": list(g.caveats),
                    "conclusions": [c for a in g.arms for c in a.conclusions] + [c for _, c in g.against_split],
                    "n_comparisons": sum(r is not None and math.isfinite(r.lo) for a in g.arms for r in a.ratios)
                    + sum(math.isfinite(e.lo) for e, _ in g.against_split)})
    return out


def _fmt_change(x: float, kind: str) -> str:
    if not math.isfinite(x):
        return "–"
    return f"{x:+.0f}%" if kind == "pct" else f"{x:.2f}x"


def headline_tables(df: pd.DataFrame) -> list[dict[str, Any]]:
    """The write-up's table per placement and vLLM variant: claimed figure next to the measured one."""
    out = []
    for h in headline.headlines(df):
        vllm = headline.VLLM_VARIANTS[h.vllm_engine]
        table = Table(["metric", "claimed", "SGLang", vllm, "measured", "95% CI", "detectable",
                       "runs × steps (SGLang / vLLM)"])
        conclusions = []
        for r in h.rows:
            kind, est = r.metric.kind, r.est
            ci = (f"[{_fmt_change(est.lo, kind)}, {_fmt_change(est.hi, kind)}]" if math.isfinite(est.lo)
                  else f"n/a (n={est.n})")
            table.rows.append([
                Cell(r.metric.heading, "key"), Cell(r.metric.claimed, "num"),
                Cell(f"{fmt(r.sglang)} {r.metric.unit}", "num"), Cell(f"{fmt(r.vllm)} {r.metric.unit}", "num"),
                Cell(_fmt_change(est.value, kind), "num"), Cell(ci, "num" if math.isfinite(est.lo) else "na"),
                Cell(_detectable(est, kind), "num"),
                Cell(f"{r.runs_sglang} × {r.n_sglang} / {r.runs_vllm} × {r.n_vllm}", "num"),
            ])
            if r.metric.name == "Rollout throughput":
                conclusions.append(wording.conclusion(
                    r.metric.name, "SGLang", vllm, est, (r.runs_sglang, r.n_sglang), (r.runs_vllm, r.n_vllm)))
        shared = ", ".join(f"{k} {_field(v)}" for k, v in h.key.items())
        out.append({"title": h.title, "table": table, "shared": shared, "caveats": list(h.caveats),
                    "sglang_run": h.sglang_run, "vllm_run": h.vllm_run, "conclusions": conclusions,
                    "verdict": [headline.sentence(r, vllm) for r in h.rows],
                    "n_comparisons": sum(math.isfinite(r.est.lo) for r in h.rows)})
    return out


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
    table = Table(["#", "run", "recorded", "minutes", "GPU", "machine (boot id)", "code", "beside it"])
    for i, w in enumerate(wins, 1):
        others = [labels[o] for o in near[w.run_id]]
        if outside.get(w.run_id, 0):
            others.append(f"another job's GPU process in {int(outside[w.run_id])} step(s)")
        table.rows.append([Cell(str(i), "num"), Cell(labels[w.run_id]), Cell(conditions.span(w.start, w.stop)),
                           Cell(f"{(w.stop - w.start) / 60:.1f}", "num"), Cell(_field(first.at[w.run_id, "gpu"])),
                           Cell(_field(first.at[w.run_id, "machine"])),
                           Cell(_field(first.at[w.run_id, "git_commit"])),
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
    return {"table": table, "note": note}


def _detectable(est: stats.Estimate, kind: str) -> str:
    """For an interval that includes no difference: the smallest effect these data could have detected."""
    if not math.isfinite(est.lo) or est.excludes(0.0 if kind == "pct" else 1.0):
        return "–"
    ratio = wording.detectable(headline.as_ratio(est) if kind == "pct" else est)
    return f"beyond {ratio:.2f}x" if math.isfinite(ratio) else "–"


def warmup_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    """Every run's warm-up steps, each apart (step 1 rolls out the base model, step 2 the first adapter), and an
    overlapped run's last step, which nothing rolled out ahead of."""
    metrics = [m for m in WARMUP_METRICS if _has(df, m)]
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


def _bool_cell(col: pd.Series, steps: pd.Series) -> Cell:
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


def _adapter_cell(run: pd.DataFrame) -> Cell:
    """The adapter gate over the steps it could judge: an identity adapter (no gradient yet) changes nothing."""
    identity = stats.identity_adapter(run)
    cell = _bool_cell(run["check/adapter_applied"].astype("boolean").mask(identity), run["step"])
    if identity.any():
        cell.text += f"; {int(identity.sum())} with the identity adapter, not judged"
    return cell


def correctness_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    table = Table(["run"] + [h for _, h in BOOL_CHECKS] +
                  ["|Δ logprob| median [95% CI]", "|Δ logprob| max", "worst sample's |Δ logprob|", "failed requests",
                   "engine restarts"])
    for run_id in stats.run_order(df):
        run = _select(df, run_id)
        diff = pd.to_numeric(run["check/rollout_logprob_abs_diff"], errors="coerce")
        # recorded since 2026-11-23: a sample far above the mean points at whole requests, not stray tokens
        worst = pd.to_numeric(run["check/logprob_gap_sample_max"], errors="coerce")
        failed = pd.to_numeric(run["errors/requests_failed"], errors="coerce")
        restarts = pd.to_numeric(run["errors/engine_restarts"], errors="coerce")
        table.rows.append([
            Cell(labels[run_id]),
            *(_adapter_cell(run) if c == "check/adapter_applied" else _bool_cell(run[c], run["step"])
              for c, _ in BOOL_CHECKS),
            Cell(fmt_est(stats.bootstrap_median(diff)), "num"),
            Cell(fmt(diff.max()), "num"),
            Cell(fmt(worst.max()) if worst.notna().any() else "–", "num"),
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
        run = _select(df, run_id)

        def col(name: str, run: pd.DataFrame = run) -> pd.Series:
            return pd.to_numeric(run[name], errors="coerce") if name in run.columns else pd.Series(dtype=float)

        ceiling, tok_s = col("perf/client_ceiling_tok_s"), col("perf/throughput")
        if ceiling.notna().any():
            share = (tok_s / ceiling).max()
            flagged = _bool_cell(run["check/client_headroom_ok"], run["step"])
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
    busiest thread in rollout; None where no run recorded them (records before 2026-11-24)."""
    runs = machine.per_run(df)
    if not runs:
        return None
    table = Table(["run", *(h for _, h, _ in machine.COLUMNS), "busiest thread"])
    for run in runs:
        cells = [Cell(labels[run.run_id])]
        for column, _, _ in machine.COLUMNS:
            value = run.values[column]
            if value is None:
                cells.append(Cell("–", "na"))
            elif column.startswith("gpu/slowdown_frac"):
                cells.append(Cell(f"{value:.0%}", "fail" if value > 0 else "num"))
            elif column.startswith("gpu/temp_c"):
                cells.append(Cell(f"{value:.0f}", "num"))
            else:
                cells.append(Cell(fmt(value), "num"))
        table.rows.append([*cells, Cell(run.busiest or "–")])
    return table


def client_paths_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """One engine through two rollout clients: the lighter path over the one that streams more, with intervals."""
    found = client_paths.pairs(df)
    if not found:
        return None
    table = Table(["configuration", "client", "vs (streams more)", "its client",
                   *(f"{h} ratio [95% CI]" for _, h in client_paths.METRICS),
                   "controller CPU in rollout, % (it / vs)", "runs × steps (it / vs)"])
    at = CONFIG_KEY.index("client")
    steady = stats.steady_state(df)
    for p in found:
        a, b = stats.select(steady, p.other), stats.select(steady, p.baseline)
        table.rows.append([Cell(labels[p.other[-1]]), Cell(_field(p.other[at])), Cell(labels[p.baseline[-1]]),
                           Cell(_field(p.baseline[at])), *(Cell(fmt_est(r), "num") for r in p.ratios),
                           Cell(f"{fmt(p.cpu[1])} / {fmt(p.cpu[0])}", "num"),
                           Cell(f"{stats.n_runs(a)} × {len(a)} / {stats.n_runs(b)} × {len(b)}", "num")])
    return table


def gap_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """Per run: the trainer-vs-engine logprob gap at step 1 (identical weights: the numeric noise floor), its
    tiers over the run, and its drift over the steps after the first."""
    table = Table(["run", "step 1: identical weights", "later steps: median [95% CI]", "max", "tiers",
                   "drift over steps (a step, 95% CI)"])
    for run_id in stats.run_order(df):
        run = _select(df, run_id).sort_values("step")
        gap = pd.to_numeric(run["check/rollout_logprob_abs_diff"], errors="coerce")
        if not gap.notna().any():
            continue
        first = gap[run["step"] == 1]
        later = run["step"] > 1
        tiers = run["check/logprob_gap_tier"].dropna() if "check/logprob_gap_tier" in run.columns else []
        counts = ", ".join(f"{n} {t}" for t in ("pass", "warn", "fail") if (n := int((tiers == t).sum())))
        drift = trend.bootstrap_slope(run.loc[later, "step"], gap[later])
        table.rows.append([Cell(labels[run_id]), Cell(fmt(first.iloc[0]) if first.notna().any() else "–", "num"),
                           Cell(fmt_est(stats.bootstrap_median(gap[later])), "num"), Cell(fmt(gap.max()), "num"),
                           Cell(counts or "not tiered (recorded before the tiers)",
                                "fail" if "fail" in counts else "na" if not counts else "num"),
                           Cell(trend.trend_words(drift, ""), "num")])
    return table if table.rows else None


def memory_trend_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """Per run whose engine slept: its GPU memory after each sleep and wake, what warm-up added, and the trend
    over the steps after warm-up (a one-off rise while caches and allocator pools fill is not a leak)."""
    table = Table(["run", "sleeps", "asleep GB: first / after warm-up / last",
                   "asleep: trend after warm-up (GB a step, 95% CI)", "awake GB, first / last", "asleep memory gate"])
    for run_id in stats.run_order(df):
        run = _select(df, run_id).sort_values("step")
        if "mem/engine_asleep_gb" not in run.columns:
            continue
        asleep = pd.to_numeric(run["mem/engine_asleep_gb"], errors="coerce")
        if not asleep.notna().any():
            continue
        awake = pd.to_numeric(run.get("mem/engine_awake_gb", pd.Series(dtype=float)), errors="coerce").dropna()
        later = stats.after_warmup(run)
        after = asleep[later.index]
        taken, first_after = asleep.dropna(), after.dropna()
        readings = [taken.iloc[0], first_after.iloc[0] if len(first_after) else None, taken.iloc[-1]]
        woke = f"{fmt(awake.iloc[0])} / {fmt(awake.iloc[-1])}" if len(awake) else "–"
        est = trend.bootstrap_slope(later["step"], after)
        gate = (_bool_cell(run["check/asleep_memory_ok"], run["step"]) if "check/asleep_memory_ok" in run.columns
                else Cell("not checked", "na"))
        table.rows.append([Cell(labels[run_id]), Cell(str(int(asleep.notna().sum())), "num"),
                           Cell(" / ".join("–" if r is None else fmt(r) for r in readings), "num"),
                           Cell(trend.trend_words(est, "GB"), "num"), Cell(woke, "num"), gate])
    return table if table.rows else None


def accuracy_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """Time to accuracy X per run (report.learning); None when no run has an eval."""
    header, rows = learning.time_to_accuracy(df, labels)
    if not rows:
        return None
    table = Table(header)
    table.rows = [[Cell(r[0]), *(Cell(c, "na" if c in ("not reached", "–") else "num") for c in r[1:])] for r in rows]
    return table


def learning_trend_table(df: pd.DataFrame, labels: dict[str, str]) -> Table | None:
    """Per run: how sampled and eval accuracy, policy entropy and response length moved (report.learning.trends)."""
    header, rows = learning.trends(df, labels)
    if not rows:
        return None
    table = Table(header)
    table.rows = [[Cell(r[0]), *(Cell(c, "na" if c == "–" else "") for c in r[1:])] for r in rows]
    return table


def detail_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    """Every numeric metric (rows) of every configuration (columns), with n where it differs."""
    metrics = [m for m in DETAIL_METRICS if _has(df, m)]
    long = stats.summarise(df, metrics)
    cfgs = stats.configs(df)
    table = Table(["metric", *(labels[c[-1]] for c in cfgs)])
    n_steps = stats.steady_state(df).groupby("config_id")["step"].count()
    for metric, rows in long.groupby("metric", sort=False):
        by_run = rows.set_index("config_id")
        cells = [Cell(str(metric), "key")]
        for config in cfgs:
            row = by_run.loc[config[-1]]
            est = stats.Estimate(row["median"], row["ci_lo"], row["ci_hi"], int(row["n"]), int(row["n_runs"]))
            note = f" (n={est.n})" if 0 < est.n != n_steps.get(config[-1], 0) else ""
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


def _plots(written: dict[str, Path], base: Path) -> list[dict[str, str]]:
    def rel(path: Path) -> str:
        return Path(os.path.relpath(Path(path).resolve(), base)).as_posix()

    return [{"name": name, "title": PLOTS[name][0], "src": rel(path)} for name, path in written.items()]


def context(df: pd.DataFrame, title: str, plots: dict[str, Path], runs_dir: Path) -> dict[str, Any]:
    """Everything the templates show; plot paths are filled in per output file."""
    labels, by_config = run_labels(df), config_labels(df)
    ratios = ratio_table(df, by_config)
    heads = headline_tables(df)
    moves = transitions(df, by_config)
    places = placement_tables(df)
    n_ratio = (len(ratios[1].rows) * sum(h.endswith("[95% CI]") for h in ratios[1].headers)) if ratios else 0
    paths = client_paths_table(df, by_config)
    n_paths = len(paths.rows) * len(client_paths.METRICS) if paths else 0
    n_comparisons = (sum(h["n_comparisons"] for h in heads) + (moves["n_comparisons"] if moves else 0) + n_ratio
                     + n_paths + sum(p["n_comparisons"] for p in places))
    return {
        "summary": summary(df, title),
        "runs": [{"label": labels[r], "run_id": r} for r in stats.run_order(df)],
        "headlines": heads,
        "comparisons_note": wording.comparisons_note(n_comparisons),
        "transitions": moves,
        "placements": places,
        "comparison": comparison_table(df, by_config),
        "baseline": ratios[0] if ratios else None,
        "ratios": ratios[1] if ratios else None,
        "warmup": warmup_table(df, labels),
        "recording": recording(df, labels),
        "correctness": correctness_table(df, labels),
        "accuracy": accuracy_table(df, labels),
        "learning_trends": learning_trend_table(df, labels),
        "client": client_table(df, labels),
        "client_paths": paths,
        "machine": machine_table(df, labels),
        "memory_trend": memory_trend_table(df, labels),
        "gap": gap_table(df, labels),
        "gap_warn": ", ".join(f"{w:g} {fam}" for fam, (w, _) in GAP_LIMITS.items()),
        "gap_fail": ", ".join(sorted({f"{f:g}" for _, f in GAP_LIMITS.values()})),
        "client_headroom": f"{HEADROOM:.0%}",
        "detail": detail_table(df, by_config),
        "provenance": provenance_rows(df, labels, runs_dir),
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
