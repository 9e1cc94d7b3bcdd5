"""The report's sections that set configurations side by side: the study summary, the comparison and ratio tables,
sleep and wake by what the release moves, placements per engine, the write-up's headline pairs, the rollout
client's paths, and the verdict the report opens with."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from hybridrl.report import client_paths, conditions, headline, placements, stats, wording
from hybridrl.report.aggregate import CONFIG_KEY, checks_untimed
from hybridrl.report.cells import Cell, Table, fmt, fmt_est, fmt_field, fmt_n, has_data
from hybridrl.run.record import COMPARED_STEP, START_PARTS

# (column, heading, unit); the comparison table shows those with data, the detail table all of these.
KEY_METRICS = [
    ("perf/throughput", "Rollout throughput", "tok/s"),
    (COMPARED_STEP, stats.STEP_COMPARED, "s"),
    ("timing_s/step", stats.STEP_WHOLE, "s"),
    # in overlap the rollout runs beside training: gen is then the step's wait for it, perf/rollout_s its length
    ("timing_s/gen", "Generation, on the step's path", "s"),
    ("perf/rollout_s", "Rollout, the engine's own time", "s"),
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
    ("cost/tok_s_per_gpu", stats.TOK_S_PER_GPU, "tok/s"),
    ("cost/gpu_s_per_step", stats.GPU_S_PER_STEP, "GPU-s"),
    ("cost/gpu_h_per_1k_rollouts", stats.GPU_H_PER_1K, "GPU-h"),
    ("reward/mean", "Reward mean", ""),
    ("host/cpu_busy_pct_gen", "Host CPU busy in rollout", "%"),
]

RATIO_METRICS = [("perf/throughput", "Rollout throughput"), (COMPARED_STEP, stats.STEP_COMPARED),
                 ("timing_s/gen", "Generation time on the step's path"), ("cost/tok_s_per_gpu", stats.TOK_S_PER_GPU)]

# sleep and wake move what the engine releases: compared only between arms that move the same bytes
TRANSITIONS = [("timing_s/sleep", "sleep"), ("timing_s/wake", "wake")]

MOVES = {"kv-only": "KV cache only (weights stay on the GPU)", "full release": "weights and KV cache",
         "full release, re-pinned": "weights and KV cache, pinning the CPU copy anew every sleep",
         "full release, onload beside": "the KV cache (the weights leave beside the trainer's onload, release_onload)",
         "level 1": "weights and KV cache", "level 2": "weights and KV cache (weights discarded)"}

# The engine start's parts (record.ENGINE_START_SPLIT), as the headline table names them under the start's row
START_PART_NAMES = {"import": "process and import", "weights": "weight load", "kv": "KV cache",
                    "sampler": "sampler warm-up (FlashInfer JIT)", "graphs": "CUDA graphs, compile",
                    "warmup": "kernel warm-up (Triton JIT)", "ready": "to ready (health check)",
                    "first_request": "first request", "unexplained": "unexplained (no log line)"}

NO_VLLM_KV_ONLY = ("vLLM 0.26 has no KV-only sleep: level 1 moves the weights to CPU memory and drops the KV "
                   "cache, level 2 drops both; so SGLang's KV-only release has no vLLM arm to compare with")


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
        "checks_untimed": compared_step_note(df),
    }


def compared_step_note(df: pd.DataFrame) -> str:
    """Which runs' compared step is the whole step after all: their records predate the check phase's timing."""
    untimed = checks_untimed(df)
    if not untimed.any():
        return ""
    runs = df.loc[untimed, "run_id"].nunique()
    return (f"{int(untimed.sum())} step record(s) of {runs} run(s) predate the check phase's timing: their checks "
            "ran inside the step untimed, so for them the compared step is the whole step, checks included")


def comparison_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    """One column per configuration (its replicates together); its fields first, then median [95% CI] of each
    key metric over runs and steps."""
    steady = stats.steady_state(df)
    metrics = [m for m in KEY_METRICS if has_data(steady, m[0])]
    cfgs = stats.configs(df)
    table = Table(["", *(labels[c[-1]] for c in cfgs)])
    for i, key in enumerate(CONFIG_KEY):
        table.rows.append([Cell(key.replace("_", " "), "key"), *(Cell(fmt_field(c[i])) for c in cfgs)])
    runs = [stats.select(steady, c) for c in cfgs]
    for col, heading in (("git_commit", "code"), ("gpu", "GPU")):
        values = [stats.select(df, c)[col].dropna().unique() if col in df.columns else [] for c in cfgs]
        if any(len(v) for v in values):
            table.rows.append([Cell(heading, "key"), *(Cell(", ".join(map(fmt_field, v)) or "–") for v in values)])
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
    metrics = [(m, h) for m, h in RATIO_METRICS if has_data(stats.steady_state(df), m)]
    if len(configs) < 2 or not metrics:
        return None
    base = configs[0]
    headers = [f"{h} ratio [95% CI]" for _, h in metrics]
    table = Table(["configuration", "vs baseline", *headers, "runs × steps (configuration / baseline)",
                   "recorded, against the baseline"])
    steady = stats.steady_state(df)
    wins = conditions.windows(df)
    for config in configs[1:]:
        ests = [stats.compare(df, m, config, base) for m, _ in metrics]
        table.intervals += sum(math.isfinite(e.lo) for e in ests)
        cells = [Cell(fmt_est(e), "num") for e in ests]
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


def placement_tables(df: pd.DataFrame, found: list[placements.Group] | None = None) -> list[dict[str, Any]]:
    """Per engine, each placement against its colocated arm: medians of step time, tokens/s per GPU and
    GPU-seconds per step, their ratios to colocate with intervals, and sentences worded from those intervals.
    found: placements.groups(df), where the caller has them already (they cost a bootstrap each)."""
    metrics = placements.METRICS
    headers = ["placement", *(f"{m.name} ({m.unit})" for m in metrics),
               *(f"{m.name} / colocate [95% CI]" for m in metrics), "runs × steps", "recorded, against colocate"]
    out = []
    for g in placements.groups(df) if found is None else found:
        table = Table(list(headers))
        for arm in g.arms:
            table.rows.append([Cell(arm.label), *(Cell(fmt_est(v), "num") for v in arm.values),
                               *(_ratio_cell(r) for r in arm.ratios), Cell(f"{arm.n[0]} × {arm.n[1]}", "num"),
                               Cell(arm.recorded)])
        out.append({"title": f"{g.engine}: placements against colocate",
                    "shared": ", ".join(f"{k} {fmt_field(v)}" for k, v in g.key.items()), "table": table,
                    "caveats": list(g.caveats),
                    "conclusions": [c for a in g.arms for c in a.conclusions] + [c for _, c in g.against_split],
                    "n_comparisons": sum(r is not None and math.isfinite(r.lo) for a in g.arms for r in a.ratios)
                    + sum(math.isfinite(e.lo) for e, _ in g.against_split)})
    return out


def _fmt_change(x: float, kind: str) -> str:
    if not math.isfinite(x):
        return "–"
    return f"{x:+.0f}%" if kind == "pct" else f"{x:.2f}x"


def _fmt_interval(est: stats.Estimate, kind: str) -> str | None:
    """The estimate's 95% interval as the write-up's table shows it; None where it has none (one run a side)."""
    return f"[{_fmt_change(est.lo, kind)}, {_fmt_change(est.hi, kind)}]" if math.isfinite(est.lo) else None


def headline_tables(df: pd.DataFrame, found: list[headline.Headline] | None = None) -> list[dict[str, Any]]:
    """The write-up's table per placement and vLLM variant: claimed figure next to the measured one.
    found: headline.headlines(df), where the caller has them already."""
    out = []
    for h in headline.headlines(df) if found is None else found:
        vllm = headline.VLLM_VARIANTS[h.vllm_engine]
        table = Table(["metric", "claimed", "SGLang", vllm, "measured", "95% CI", "detectable (80% power)",
                       "runs × steps (SGLang / vLLM)"])
        conclusions = []
        for r in h.rows:
            kind, est = r.metric.kind, r.est
            ci = _fmt_interval(est, kind) or f"n/a (n={est.n})"
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
            if not r.metric.steady:  # the engine's start: its parts follow it
                table.rows.extend(start_part_rows(df[df["config_id"] == h.sglang_run],
                                                  df[df["config_id"] == h.vllm_run]))
        shared = ", ".join(f"{k} {fmt_field(v)}" for k, v in h.key.items())
        out.append({"title": h.title, "table": table, "shared": shared, "caveats": list(h.caveats),
                    "sglang_run": h.sglang_run, "vllm_run": h.vllm_run, "conclusions": conclusions,
                    "verdict": [headline.sentence(r, vllm) for r in h.rows],
                    "n_comparisons": sum(math.isfinite(r.est.lo) for r in h.rows)})
    return out


def headline_summary(df: pd.DataFrame) -> Table | None:
    """The write-up's rows in one table, for a page that has room for one: each metric's claimed figure, then for
    each pair of SGLang and a vLLM arm its measured ratio (or change) with the 95% interval, and the runs a side."""
    found = headline.headlines(df)
    if not found:
        return None
    table = Table(["metric", "claimed", *(h.title for h in found)])
    cells: dict[str, dict[int, str]] = {}
    metrics = {}
    for i, h in enumerate(found):
        for r in h.rows:
            est, kind = r.est, r.metric.kind
            ci = _fmt_interval(est, kind) or f"(n={est.n})"
            cells.setdefault(r.metric.heading, {})[i] = f"{_fmt_change(est.value, kind)} {ci}"
            metrics[r.metric.heading] = r.metric
    for heading, by_pair in cells.items():
        table.rows.append([Cell(heading, "key"), Cell(metrics[heading].claimed, "num"),
                           *(Cell(by_pair.get(i, "–"), "num" if i in by_pair else "na") for i in range(len(found)))])
    runs = [f"{h.rows[0].runs_sglang} / {h.rows[0].runs_vllm}" if h.rows else "–" for h in found]
    table.rows.append([Cell("runs (SGLang / vLLM)", "key"), Cell("–", "na"), *(Cell(r, "num") for r in runs)])
    return table


def start_part_rows(sglang: pd.DataFrame, vllm: pd.DataFrame) -> list[list[Cell]]:
    """The engine start's parts for the headline table, one row each: each side's median over its runs (one
    value a run, on its first step), not compared: they are read as what the start's row above is made of. Parts
    neither side recorded are left out (runs before the split was recorded have none)."""
    rows = []
    for part in START_PARTS:
        col = f"timing_s/engine_start_{part}"
        values = [pd.to_numeric(side[col], errors="coerce").dropna() if col in side.columns else pd.Series()
                  for side in (sglang, vllm)]
        if not any(len(v) for v in values):
            continue
        medians = [Cell(f"{fmt(v.median())} s" if len(v) else "–", "num" if len(v) else "na") for v in values]
        rows.append([Cell(f"… {START_PART_NAMES[part]}", "key"), Cell("–", "na"), *medians,
                     *(Cell("–", "na") for _ in range(3)), Cell(f"{len(values[0])} / {len(values[1])} runs", "num")])
    return rows


def _detectable(est: stats.Estimate, kind: str) -> str:
    """For an interval that includes no difference: the effect these data had 80% power to detect."""
    if not math.isfinite(est.lo) or est.excludes(0.0 if kind == "pct" else 1.0):
        return "–"
    ratio = wording.detectable(headline.as_ratio(est) if kind == "pct" else est)
    return f"beyond {ratio:.2f}x" if math.isfinite(ratio) else "–"


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
        table.intervals += sum(math.isfinite(r.lo) for r in p.ratios)
        table.rows.append([Cell(labels[p.other[-1]]), Cell(fmt_field(p.other[at])), Cell(labels[p.baseline[-1]]),
                           Cell(fmt_field(p.baseline[at])), *(Cell(fmt_est(r), "num") for r in p.ratios),
                           Cell(f"{fmt(p.cpu[1])} / {fmt(p.cpu[0])}", "num"),
                           Cell(f"{stats.n_runs(a)} × {len(a)} / {stats.n_runs(b)} × {len(b)}", "num")])
    return table


# -- the opening verdict -------------------------------------------------------------------------------------
# One sentence for each pair the sections below compare: SGLang against each vLLM variant per placement (headline),
# each placement of an engine against its colocated arm and an overlapped split against a plain one (placements).
# A study that has neither, such as one whose arms are placements without a colocated one, gets the pairs of its
# ratio table instead: each configuration against the first. Every sentence is wording.conclusion's, so it ranks
# only where the interval excludes no difference and says plainly where there is no interval at all.

# what an engine pair is judged by (its rollout, the engine's own work) and what a placement pair is judged by
# (the whole step, which is what a placement changes): the first metric of each that both sides recorded
VERDICT_ENGINE_METRIC = "Rollout throughput"
VERDICT_STEP_METRICS = ((COMPARED_STEP, stats.STEP_COMPARED, False), ("perf/throughput", "Rollout throughput", True))


@dataclass(frozen=True)
class VerdictLine:
    pair: str  # which two arms, as the section below titles them
    sentence: str
    caveats: int = 0  # how many caveats the section below gives for the pair


def _engine_verdicts(found: list[headline.Headline]) -> list[VerdictLine]:
    """Each engine pair's rollout throughput sentence (its first metric where throughput is missing)."""
    out = []
    for h in found:
        row = next((r for r in h.rows if r.metric.name == VERDICT_ENGINE_METRIC), h.rows[0])
        said = headline.sentence(row, headline.VLLM_VARIANTS[h.vllm_engine])
        out.append(VerdictLine(h.title, said, len(h.caveats)))
    return out


def _placement_verdicts(found: list[placements.Group]) -> list[VerdictLine]:
    """Each placement against its engine's colocated arm, then each overlapped split against a plain split, on
    step time (placements.METRICS' first)."""
    out = []
    for g in found:
        out += [VerdictLine(f"{g.engine}: {arm.label} vs {g.arms[0].label}", arm.conclusions[0], len(g.caveats))
                for arm in g.arms[1:]]
        out += [VerdictLine(f"{g.engine}: overlapped split vs split", said, len(g.caveats))
                for _, said in g.against_split]
    return out


def _configuration_verdicts(df: pd.DataFrame, labels: dict[str, str]) -> list[VerdictLine]:
    """Each configuration against the first, as the ratio table sets them, on step time (or rollout throughput
    where no step time was recorded)."""
    configs, steady = stats.configs(df), stats.steady_state(df)
    metric = next((m for m in VERDICT_STEP_METRICS if has_data(steady, m[0])), None)
    if len(configs) < 2 or metric is None:
        return []
    column, name, higher = metric
    base = configs[0]
    out = []
    for config in configs[1:]:
        sides = [stats.select(steady, c) for c in (config, base)]
        n = [(stats.n_runs(s), len(s)) for s in sides]
        a, b = labels[config[-1]], labels[base[-1]]
        est = stats.compare(df, column, config, base)
        out.append(VerdictLine(f"{a} vs {b}", wording.conclusion(name, a, b, est, n[0], n[1], higher)))
    return out


def verdict_lines(df: pd.DataFrame, labels: dict[str, str], heads: list[headline.Headline],
                  groups: list[placements.Group]) -> list[VerdictLine]:
    """The verdict's sentences: engine pairs, then placement pairs; the ratio table's pairs where there are none."""
    return [*_engine_verdicts(heads), *_placement_verdicts(groups)] or _configuration_verdicts(df, labels)


def nothing_compared(df: pd.DataFrame) -> str:
    """What the verdict says where it has no pair."""
    n = int(df["config_id"].nunique())
    if n < 2:
        return "One configuration, so nothing is compared: the tables below describe its runs."
    return (f"{n} configurations, but no step time or rollout throughput recorded in two of them to set side by "
            "side: the tables below describe each on its own.")
