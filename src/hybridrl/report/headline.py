"""The write-up's headline table: SGLang against each vLLM variant, per placement.

A public write-up claims that SGLang + Megatron beats vLLM + Megatron on Qwen3-30B-A3B (GSM8K, 64 requests
a step, TP 2, 4 x A100, 10 steps) by the figures in each Metric's `claimed`. Here every claim sits next to
the measured ratio of steady-state medians and its hierarchical-bootstrap 95% interval over the two
configurations' runs and steps (stats.hierarchical_ratio).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any

import pandas as pd

from hybridrl.report import conditions, stats, wording
from hybridrl.report.aggregate import AWAKE, placement_name, shared_split

SGLANG = "sglang"
VLLM_VARIANTS = {"vllm": "vLLM server", "vllm-inprocess": "vLLM in-process"}
PLACEMENTS = ("colocate", "split", "restart")
# Two runs are compared only where these match; the request set depends on the seed, the rollout client sets how
# much of an engine's throughput the controller can take in, and a split whose rollouts run ahead
# (overlap) is a placement of its own
PAIR_KEY = ("trainer", "model", "tp", "seed", "client", "overlap")
# also matched for a pair, and shown in its title's release arm ("stays awake") rather than among the shared keys
PAIR_ALSO = ("engine_sleep",)
APART_S = 3600.0  # two runs' first steps further apart than this get a caveat
DIRECTIONS = {"x": "SGLang / vLLM", "inv": "vLLM / SGLang", "pct": "SGLang vs vLLM"}


@dataclass(frozen=True)
class Metric:
    name: str
    columns: tuple[str, ...]  # the first column with data in both runs is used
    unit: str
    kind: str  # "x": SGLang/vLLM; "inv": vLLM/SGLang (> 1: SGLang faster); "pct": % change SGLang vs vLLM
    claimed: str
    steady: bool = True  # False: one value per run (engine start), taken from every step
    better: str = "faster"  # the verdict's word for the side that comes out ahead, and for the other
    worse: str = "slower"

    @property
    def heading(self) -> str:
        return f"{self.name} ({DIRECTIONS[self.kind]})"


METRICS = (
    Metric("Rollout throughput", ("perf/rollout_tok_s", "perf/throughput"), "tok/s", "x", "3.9x"),
    # the mean: runs recorded before ITL was per token have near-zero SGLang p50s (one gap per burst), and SGLang's
    # one-token bursts make any per-event percentile meaningless; per-request TPOT below means the same everywhere
    Metric("ITL, mean", ("perf/itl_ms_mean",), "ms", "inv", "2.3x"),
    Metric("TPOT p50 over requests", ("perf/tpot_ms_p50",), "ms", "inv", "–"),
    Metric("TTFT p50", ("perf/ttft_s_p50",), "s", "inv", "–"),
    Metric("p99 latency", ("perf/latency_s_p99",), "s", "pct", "-52%"),
    Metric("Peak GPU memory", ("mem/peak_gb",), "GB", "pct", "-29%", better="lower", worse="higher"),
    # cost per GPU: the step's tokens over every GPU the run held, the instrument's checks left out (aggregate.derive)
    Metric(stats.TOK_S_PER_GPU, ("cost/tok_s_per_gpu",), "tok/s", "x", "–", better="higher", worse="lower"),
    Metric(stats.GPU_H_PER_1K, ("cost/gpu_h_per_1k_rollouts",), "GPU-h", "pct", "–", better="lower",
           worse="higher"),
    Metric("Engine startup", ("timing_s/engine_start",), "s", "inv", "3.4x", steady=False),
)


@dataclass(frozen=True)
class Row:
    metric: Metric
    column: str
    sglang: float  # median of the configuration's values (every run's steps pooled)
    vllm: float
    est: stats.Estimate  # ratio in the metric's direction, or percent change for kind "pct"
    n_sglang: int  # steps
    n_vllm: int
    runs_sglang: int = 1
    runs_vllm: int = 1


@dataclass(frozen=True)
class Headline:
    placement: str
    vllm_engine: str
    sglang_run: str  # configuration ids (a configuration's first run id)
    vllm_run: str
    key: dict[str, Any]  # the PAIR_KEY fields both runs share
    rows: list[Row]
    label: str = ""  # which pair, where several share the placement and vLLM variant
    caveats: tuple[str, ...] = ()  # what differs between the two runs besides the engine
    release: str = ""  # SGLang's arm: "kv-only", "full release" or "full release, re-pinned"

    @property
    def title(self) -> str:
        arm = f" ({self.release})" if self.release else ""
        # an awake engine pairs only with another awake one (pairable), so both sides say so
        vllm_arm = f" ({AWAKE})" if self.release == AWAKE else ""
        placement = placement_name({"placement": self.placement, "overlap": self.key.get("overlap")})
        return f"{placement}: SGLang{arm} vs {VLLM_VARIANTS[self.vllm_engine]}{vllm_arm}" + (
            f" ({self.label})" if self.label else "")


def as_ratio(est: stats.Estimate) -> stats.Estimate:
    """A "pct" metric's estimate (100 * (ratio - 1)) back as the ratio it came from."""
    return stats.Estimate(1 + est.value / 100, 1 + est.lo / 100, 1 + est.hi / 100, est.n, est.n_runs)


def sentence(row: Row, vllm: str) -> str:
    """The row's conclusion by the fixed wording rules, each ratio written the way round its table shows it."""
    est, m = row.est, row.metric
    n_s, n_v = (row.runs_sglang, row.n_sglang), (row.runs_vllm, row.n_vllm)
    if m.kind == "inv":  # vLLM / SGLang of a time: above 1, vLLM takes longer
        return wording.conclusion(m.name, vllm, "SGLang", est, n_v, n_s, False, m.better, m.worse)
    if m.kind == "pct":
        return wording.conclusion(m.name, "SGLang", vllm, as_ratio(est), n_s, n_v, False, m.better, m.worse)
    return wording.conclusion(m.name, "SGLang", vllm, est, n_s, n_v, True, m.better, m.worse)


def pairable(key: str, a: Any, b: Any) -> bool:
    """Whether two configurations agree on a PAIR_KEY field. In-process vLLM has no HTTP client, so its client
    is only the share of requests streamed: it pairs with an HTTP engine's client that streams the same share."""
    if key == "client" and isinstance(a, str) and isinstance(b, str) and (", " in a) != (", " in b):
        return a.split(", ")[0] == b.split(", ")[0]
    if key == "overlap":  # runs recorded before the key existed ran none
        return _same(0 if pd.isna(a) else a, 0 if pd.isna(b) else b)
    if key == "engine_sleep":  # a colocated engine that stays awake pairs only with another; earlier runs slept
        return _same(1 if pd.isna(a) else float(a), 1 if pd.isna(b) else float(b))
    return _same(a, b)


def _values(runs: pd.DataFrame, col: str) -> list[pd.Series]:
    return [v.dropna() for v in stats.per_run(runs, col)]


def compare_metric(metric: Metric, sglang: pd.DataFrame, vllm: pd.DataFrame) -> Row | None:
    """One row from two configurations' steps (every replicate), or None where either lacks the metric."""
    if metric.steady:
        sglang, vllm = stats.steady_state(sglang), stats.steady_state(vllm)
    for col in metric.columns:
        a, b = [v for v in _values(sglang, col) if len(v)], [v for v in _values(vllm, col) if len(v)]
        if a and b:
            break
    else:
        return None
    est = stats.hierarchical_ratio(b, a) if metric.kind == "inv" else stats.hierarchical_ratio(a, b)
    if not pd.notna(est.value):
        return None
    if metric.kind == "pct":
        est = stats.Estimate(100 * (est.value - 1), 100 * (est.lo - 1), 100 * (est.hi - 1), est.n, est.n_runs)
    pa, pb = pd.concat(a), pd.concat(b)
    return Row(metric, col, float(pa.median()), float(pb.median()), est, len(pa), len(pb), len(a), len(b))


def _same(a: Any, b: Any) -> bool:
    if pd.isna(a) or pd.isna(b):
        return bool(pd.isna(a) and pd.isna(b))
    return bool(a == b)


def _suffix(run_id: str) -> str:
    return run_id.rsplit("-", 1)[-1]


def headlines(df: pd.DataFrame) -> list[Headline]:
    """One table per placement, vLLM variant and matching pair of configurations (each with all its replicates)
    that has at least one row. SGLang's KV-only and full-release arms are paired apart."""
    order = [c[-1] for c in stats.configs(df)]
    runs = df.drop_duplicates("config_id").set_index("config_id").loc[order]
    wins = conditions.windows(df)
    out = []
    for placement, variant in product(PLACEMENTS, VLLM_VARIANTS):
        here = runs[(runs["placement"] == placement).fillna(False).to_numpy(dtype=bool)]
        engines = here["engine"].astype(str)
        pairs = [(s, v) for s, v in product(here.index[engines == SGLANG], here.index[engines == variant])
                 if all(pairable(k, runs.at[s, k], runs.at[v, k]) for k in (*PAIR_KEY, *PAIR_ALSO))]
        for s, v in pairs:
            found = [compare_metric(m, df[df["config_id"] == s], df[df["config_id"] == v]) for m in METRICS]
            rows = [r for r in found if r is not None]
            if rows:
                # the configurations' ids tell apart pairs that the title (placement, overlap, release) does not
                alike = [p for p in pairs if all(pairable(k, runs.at[p[0], k], runs.at[s, k])
                                                 for k in ("overlap", "release"))]
                label = f"{_suffix(s)} vs {_suffix(v)}" if len(alike) > 1 else ""
                key = {k: runs.at[s, k] for k in PAIR_KEY}
                release = runs.at[s, "release"] if "release" in runs.columns else None
                order_note = conditions.order_caveat(wins, s, v, "SGLang", VLLM_VARIANTS[variant])
                notes = (caveats(df[df["config_id"] == s], df[df["config_id"] == v])
                         + ((order_note,) if order_note else ())
                         + restart_caveats(df, {"SGLang": s, VLLM_VARIANTS[variant]: v}))
                start_note = conditions.start_order_caveat(df, {"SGLang": s, VLLM_VARIANTS[variant]: v})
                notes += (start_note,) if start_note else ()
                out.append(Headline(placement, variant, s, v, key, rows, label, notes,
                                    "" if pd.isna(release) else str(release)))
    return out


def restart_caveats(df: pd.DataFrame, sides: dict[str, str]) -> tuple[str, ...]:
    """A side whose engine was started again mid-run (a crash, a fault run): its restarts and the steps that paid
    for them, which a steady-state median may or may not leave out."""
    out = []
    for name, config in sides.items():
        rows = df[df["config_id"] == config]
        counts = pd.to_numeric(rows.get("errors/engine_restarts"), errors="coerce").fillna(0)
        if counts.sum() > 0:
            steps = ", ".join(str(int(x)) for x in rows.loc[counts > 0, "step"])
            out.append(f"{name}'s engine was started again mid-run {int(counts.sum())} time(s) (step {steps}; "
                       "errors/engine_restarts): those steps include the restart")
    return tuple(out)


def caveats(sglang_rows: pd.DataFrame, vllm_rows: pd.DataFrame) -> tuple[str, ...]:
    """What a reader must know to read the pair: different code, GPUs or machines, or hours between its runs (every
    replicate of both sides read), and what peak memory compares."""
    out = [f"recorded by different {what}: {', '.join(a) or 'not recorded'} (SGLang) vs "
           f"{', '.join(b) or 'not recorded'}" for what, [a, b] in conditions.recorded_apart([sglang_rows, vllm_rows])]
    # runs hours apart (two GPU leases, say) may have run on other machines of the same kind
    times = [conditions.first_steps(rows) for rows in (sglang_rows, vllm_rows)]
    apart = max(t[-1] for t in times) - min(t[0] for t in times) if all(times) else 0.0
    if apart > APART_S:
        when = [conditions.span(t[0], t[-1]) if len(t) > 1 else f"{conditions.utc(t[0])} UTC" for t in times]
        out.append(f"recorded {apart / 3600:.0f} h apart ({when[0]} SGLang, {when[1]} vLLM), "
                   "perhaps on different machines of the same kind")
    sglang, vllm = sglang_rows.iloc[0], vllm_rows.iloc[0]  # the configuration's settings, alike in its replicates
    # in colocate the trainer's peak comes on top of what the engine keeps while asleep (no trainer, no peak)
    release, level = sglang.get("sglang_release"), vllm.get("vllm_sleep_level")
    if (sglang.get("placement") == "colocate" and isinstance(release, str) and release == "kv_cache"
            and sglang.get("trainer") != "none"):
        slept = "" if pd.isna(level) else f" and vLLM slept at level {level:g}, moving its weights to CPU memory"
        out.append("colocated, SGLang kept its weights on the GPU while the trainer ran (it released only its KV "
                   f"cache){slept}: peak GPU memory follows that setting")
    arm = sglang.get("release")
    if isinstance(arm, str) and arm == "full release, re-pinned" and not pd.isna(level):
        out.append("SGLang pinned its CPU copy of the weights anew on every sleep and freed it on every wake "
                   "(torch_memory_saver's default), while vLLM reused its pinned buffers: sleep, wake and step "
                   "time follow that setting more than the engines (sglang_retain_cpu_backup)")
    shared = [name for name, run in (("SGLang", sglang), ("vLLM", vllm)) if shared_split(run)]
    if shared:
        out.append(f"split on fewer GPUs than it asks for ({' and '.join(shared)}): the engine shared the trainer's "
                   "GPU and competed with it for the SMs, so this compares neither placements nor engines")
    # both engines reserve their share of the GPU up front (weights, KV cache, graphs), so peak memory
    # mostly reports that configured share: an engine "using less" may only have been given less
    a, b = sglang.get("gpu_memory_utilization"), vllm.get("gpu_memory_utilization")
    if not (pd.isna(a) or pd.isna(b)):
        out.append(f"both engines were given {a:g} of each GPU's memory, so peak GPU memory compares that setting "
                   "more than the engines" if a == b else
                   f"the engines were given different shares of each GPU's memory ({a:g} SGLang, {b:g} vLLM), "
                   "which peak GPU memory follows")
    return tuple(out)
