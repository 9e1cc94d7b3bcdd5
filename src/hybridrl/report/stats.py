"""Medians with hierarchical-bootstrap 95% intervals over runs and steps, and ratios of medians.

A configuration may have several runs (replicates). Its estimate is the median of all its steady-state steps;
the interval resamples runs with replacement, then steps with replacement within each drawn run, and takes
the median of the pooled draw (a two-level bootstrap). With one run it is the plain bootstrap over steps, and
then the interval holds step-to-step noise only: every Estimate says how many runs and steps it rests on.

Where a configuration's runs come from several leases (machines: their boot ids, as per_run labels each run), the
lease is a level above them: leases are resampled first, then runs within each drawn lease, then steps, so that a
difference between leases widens the interval instead of passing for run-to-run noise. Where two configurations
ran side by side in each of several leases, blocked_ratio compares them lease by lease instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from hybridrl.report.aggregate import CONFIG_KEY, ran_ahead
from hybridrl.run.record import IDENTITY_ADAPTER, PHASE_KEYS
from hybridrl.study.run_config import split_replicate

WARMUP_STEPS = 2  # where a run recorded none: step 1 rolls out the base model, step 2 the first adapter
# What comparisons call the step they compare (record.COMPARED_STEP: the wall-clock step less the instrument's
# checks) and the figures taken over it (aggregate.derive), and the whole wall-clock step shown beside it
STEP_COMPARED = "Step time, checks excluded"
STEP_WHOLE = "Step time, checks included"
TOK_S_PER_GPU = "Tokens/s per GPU, checks excluded"
GPU_S_PER_STEP = "GPU-seconds per step, checks excluded"
GPU_H_PER_1K = "GPU-hours per 1,000 rollouts, checks excluded"
N_BOOT = 5000
SEED = 0


@dataclass(frozen=True)
class Estimate:
    """A median (or ratio of medians) with its bootstrap interval; lo/hi are NaN when n < 2.

    n is the number of steps it rests on (for a ratio: the smaller side), n_runs the number of runs.
    """

    value: float
    lo: float
    hi: float
    n: int
    n_runs: int = 1

    @property
    def n_steps(self) -> int:
        return self.n

    def contains(self, x: float) -> bool:
        return bool(self.lo <= x <= self.hi)

    def excludes(self, x: float) -> bool:
        """True only for a real interval that lies wholly on one side of x."""
        return bool(np.isfinite(self.lo) and np.isfinite(self.hi) and not self.contains(x))


def _clean(values: Iterable[float]) -> np.ndarray:
    series = pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce")
    arr = series.to_numpy(dtype=float, na_value=np.nan)
    return arr[np.isfinite(arr)]


LEASE = "lease"  # a run's Series.attrs key for its lease (per_run); runs without one share a single lease


class Runs(list):
    """Each run's finite values (runs without any left out: they carry no information), and each one's lease."""

    def __init__(self, runs: Sequence[Iterable[float]]) -> None:
        kept = [(x, getattr(r, "attrs", {}).get(LEASE)) for x, r in ((_clean(r), r) for r in runs) if len(x)]
        super().__init__(x for x, _ in kept)
        self.leases = [lease for _, lease in kept]


def _boot_medians(runs: Runs, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """Medians of n_boot resamples: leases with replacement where the runs come from several, then runs with
    replacement (within each drawn lease), then steps within each drawn run."""
    n_runs, longest = len(runs), max(len(r) for r in runs)
    table = np.full((n_runs, longest), np.nan)
    for i, r in enumerate(runs):
        table[i, :len(r)] = r
    sizes = np.array([len(r) for r in runs])
    drawn = _drawn_runs(runs.leases, rng, n_boot)  # (n_boot, slots): a run's index, or -1 for an empty slot
    empty = drawn < 0
    drawn = np.where(empty, 0, drawn)
    slots = np.arange(longest)
    picks = np.floor(rng.random((*drawn.shape, longest)) * sizes[drawn][..., None]).astype(int)
    values = table[drawn[..., None], picks]
    values[slots[None, None, :] >= sizes[drawn][..., None]] = np.nan  # a drawn run keeps its own length
    values[empty] = np.nan
    return _row_medians(values.reshape(n_boot, -1))


def _drawn_runs(leases: list[object], rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """Which runs each resample draws: runs with replacement from all of them, or, where they come from more than
    one lease, leases with replacement and then runs with replacement among each drawn lease's own (a drawn lease
    brings as many runs as it has; the slots a smaller lease leaves are -1)."""
    groups: dict[object, list[int]] = {}
    for i, lease in enumerate(leases):
        groups.setdefault(lease, []).append(i)
    if len(groups) < 2:
        return rng.integers(0, len(leases), size=(n_boot, len(leases)))
    members = list(groups.values())
    widest = max(len(m) for m in members)
    table = np.array([m + [-1] * (widest - len(m)) for m in members])
    sizes = np.array([len(m) for m in members])
    lease = rng.integers(0, len(members), size=(n_boot, len(members)))
    slot = np.floor(rng.random((n_boot, len(members), widest)) * sizes[lease][..., None]).astype(int)
    drawn = table[lease[..., None], slot]
    drawn[np.arange(widest)[None, None, :] >= sizes[lease][..., None]] = -1
    return drawn.reshape(n_boot, -1)


def _row_medians(values: np.ndarray) -> np.ndarray:
    """Each row's median over its values that are not NaN (every row holds some): np.nanmedian's figures, without
    its masked-array sort, which took most of a report's time."""
    ordered = np.sort(values, axis=1)  # NaN sorts last
    count = np.sum(~np.isnan(values), axis=1)
    lower = np.take_along_axis(ordered, ((count - 1) // 2)[:, None], axis=1)[:, 0]
    upper = np.take_along_axis(ordered, (count // 2)[:, None], axis=1)[:, 0]
    return (lower + upper) / 2


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(samples, [tail, 100 - tail])
    return float(lo), float(hi)


def hierarchical_median(runs: Sequence[Iterable[float]], n_boot: int = N_BOOT, seed: int = SEED,
                        level: float = 0.95) -> Estimate:
    """Median of every run's finite values pooled, with a seeded hierarchical bootstrap interval (runs, then
    steps; leases first where the runs come from several)."""
    kept = Runs(runs)
    n = sum(len(r) for r in kept)
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0, 0)
    med = float(np.median(np.concatenate(kept)))
    if n < 2:
        return Estimate(med, float("nan"), float("nan"), n, len(kept))
    lo, hi = _interval(_boot_medians(kept, np.random.default_rng(seed), n_boot), level)
    return Estimate(med, lo, hi, n, len(kept))


def hierarchical_ratio(a: Sequence[Iterable[float]], b: Sequence[Iterable[float]], n_boot: int = N_BOOT,
                       seed: int = SEED, level: float = 0.95) -> Estimate:
    """median(a) / median(b) over runs of two configurations, each side resampled on its own as
    hierarchical_median resamples it.

    n and n_runs are the smaller side's."""
    ka, kb = Runs(a), Runs(b)
    na, nb = sum(len(r) for r in ka), sum(len(r) for r in kb)
    n, n_runs = int(min(na, nb)), int(min(len(ka), len(kb)))
    if n == 0 or np.median(np.concatenate(kb)) == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), n, n_runs)
    value = float(np.median(np.concatenate(ka)) / np.median(np.concatenate(kb)))
    if n < 2:
        return Estimate(value, float("nan"), float("nan"), n, n_runs)
    rng = np.random.default_rng(seed)
    ma, mb = _boot_medians(ka, rng, n_boot), _boot_medians(kb, rng, n_boot)
    ratios = ma[mb != 0] / mb[mb != 0]
    lo, hi = _interval(ratios, level)
    return Estimate(value, lo, hi, n, n_runs)


def blocked_ratio(blocks: Sequence[tuple[Sequence[Iterable[float]], Sequence[Iterable[float]]]],
                  n_boot: int = N_BOOT, seed: int = SEED, level: float = 0.95) -> Estimate:
    """The ratio of two configurations measured side by side in several blocks (cards, each a lease's): each
    block's ratio of medians, combined as their geometric mean, so that a block that ran both sides faster moves
    neither the ratio nor its interval. The interval resamples blocks with replacement, and within each drawn
    block each side as hierarchical_ratio does. With one block it is hierarchical_ratio's.

    n and n_runs are the smaller side's totals over the blocks."""
    kept = [(Runs(a), Runs(b)) for a, b in blocks]
    usable = [i for i, (a, b) in enumerate(kept) if a and b and np.median(np.concatenate(b)) != 0]
    if not usable:
        return Estimate(float("nan"), float("nan"), float("nan"), 0, 0)
    if len(usable) == 1:
        return hierarchical_ratio(*blocks[usable[0]], n_boot=n_boot, seed=seed, level=level)
    pairs = [kept[i] for i in usable]
    n = int(min(sum(len(r) for a, _ in pairs for r in a), sum(len(r) for _, b in pairs for r in b)))
    n_runs = int(min(sum(len(a) for a, _ in pairs), sum(len(b) for _, b in pairs)))
    logs = np.array([np.log(np.median(np.concatenate(a)) / np.median(np.concatenate(b))) for a, b in pairs])
    rng = np.random.default_rng(seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        drawn = np.column_stack([np.log(_boot_medians(a, rng, n_boot) / _boot_medians(b, rng, n_boot))
                                 for a, b in pairs])
    picks = rng.integers(0, len(pairs), size=(n_boot, len(pairs)))
    boot = np.exp(drawn[np.arange(n_boot)[:, None], picks].mean(axis=1))
    lo, hi = _interval(boot[np.isfinite(boot)], level)
    return Estimate(float(np.exp(logs.mean())), lo, hi, n, n_runs)


def bootstrap_median(values: Iterable[float], n_boot: int = N_BOOT, seed: int = SEED,
                     level: float = 0.95) -> Estimate:
    """Median of one run's finite values with a seeded percentile-bootstrap interval over its steps."""
    return hierarchical_median([values], n_boot=n_boot, seed=seed, level=level)


def bootstrap_mean(values: Iterable[float], n_boot: int = N_BOOT, seed: int = SEED, level: float = 0.95) -> Estimate:
    """Mean of the finite values with a seeded percentile-bootstrap interval (for paired differences, where the
    mean of the differences is the difference of the means)."""
    x = _clean(values)
    if len(x) < 2:
        return Estimate(float(x.mean()) if len(x) else float("nan"), float("nan"), float("nan"), len(x), 1)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1)
    lo, hi = _interval(means, level)
    return Estimate(float(x.mean()), lo, hi, len(x), 1)


def ratio_of_medians(a: Iterable[float], b: Iterable[float], n_boot: int = N_BOOT, seed: int = SEED,
                     level: float = 0.95) -> Estimate:
    """median(a) / median(b) of one run each; both resampled independently. n = min(n_a, n_b)."""
    return hierarchical_ratio([a], [b], n_boot=n_boot, seed=seed, level=level)


def per_run(df: pd.DataFrame, column: str) -> list[pd.Series]:
    """The column's values, one Series per run, in run order, each labelled with its lease (the machine's boot id,
    where recorded: Series.attrs[LEASE]); none where the column is absent."""
    if column not in df.columns:
        return []
    out = []
    for _, run in df.groupby("run_id", sort=True):
        values = pd.to_numeric(run[column], errors="coerce")
        if "machine" in run.columns and run["machine"].notna().any():
            values.attrs[LEASE] = str(run["machine"].dropna().iloc[0])
        out.append(values)
    return out


def warmup_steps(df: pd.DataFrame) -> pd.Series:
    """Each row's run's warm-up length: its recorded `warmup_steps`, else WARMUP_STEPS."""
    if "warmup_steps" not in df.columns:
        return pd.Series(WARMUP_STEPS, index=df.index)
    return pd.to_numeric(df["warmup_steps"], errors="coerce").fillna(WARMUP_STEPS)


def warmup(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["step"] <= warmup_steps(df)).to_numpy(dtype=bool)]


def after_warmup(df: pd.DataFrame) -> pd.DataFrame:
    """Every step after its run's warm-up, whatever its gates said (what a memory trend is fitted over)."""
    return df[(df["step"] > warmup_steps(df)).to_numpy(dtype=bool)]


def drain(df: pd.DataFrame) -> pd.Series:
    """Rows that are an overlapped run's last step: nothing rolls out ahead beside its training (there is no next
    step), so it is shorter than any step of the run's steady state and is left out of it, as warm-up is. Runs
    aggregated before the run config's `overlap` was are known by their stale rollouts."""
    overlapped = pd.Series(False, index=df.index)
    if "overlap" in df.columns:
        overlapped |= (pd.to_numeric(df["overlap"], errors="coerce") > 0).fillna(False)
    if "rollout/staleness" in df.columns and "trainer" in df.columns:
        overlapped |= ran_ahead(df).groupby(df["run_id"]).transform("max")
    last = df["step"] == df.groupby("run_id")["step"].transform("max")
    return (overlapped & last).astype(bool)


def unattributed_s(df: pd.DataFrame) -> pd.Series:
    """Each step's seconds that no named phase explains: its timing_s/step less its phases (NaN without a step
    time)."""
    phases = sum(pd.to_numeric(df[k], errors="coerce").fillna(0) for k in PHASE_KEYS)
    return pd.to_numeric(df["timing_s/step"], errors="coerce") - phases


def identity_adapter(df: pd.DataFrame) -> pd.Series:
    """Rows whose adapter was still the identity (LoRA's B all zero), which no engine can show applied: the record
    says so (check/adapter_not_judged), its `train/lora_norm` is 0, or, in records without that norm (the Megatron
    trainer's older records), no step of its run up to this one had a gradient (AdamW moves nothing before a first
    nonzero gradient). Pass every step of the runs, warm-up too: a gradient in step 1 moves every adapter after it."""
    norm = pd.to_numeric(df.get("train/lora_norm", pd.Series(float("nan"), index=df.index)), errors="coerce")
    said = df.get("check/adapter_not_judged", pd.Series(pd.NA, index=df.index, dtype="string"))
    out = (norm == 0).fillna(False) | (said.astype("string") == IDENTITY_ADAPTER).fillna(False)
    if "train/grad_norm" in df.columns and "run_id" in df.columns:
        grads = pd.to_numeric(df["train/grad_norm"], errors="coerce").fillna(0.0).abs()
        ordered = grads[df.sort_values("step").index]
        so_far = ordered.groupby(df.loc[ordered.index, "run_id"]).cummax().reindex(df.index)
        out |= norm.isna() & (so_far == 0)
    return out


def adapter_gate(df: pd.DataFrame) -> pd.Series:
    """check/adapter_applied where the check could judge, NA where it could not: an identity adapter is not judged,
    including steps recorded as not applied before the loop told identity adapters apart (relabelled_identity)."""
    return df["check/adapter_applied"].astype("boolean").mask(identity_adapter(df))


def relabelled_identity(df: pd.DataFrame) -> pd.Series:
    """Rows recorded as adapter not applied (False) whose adapter was the identity: read as not judged."""
    return (identity_adapter(df) & df["check/adapter_applied"].astype("boolean").eq(False)).fillna(False)


def steady_state(df: pd.DataFrame) -> pd.DataFrame:
    """Steps after warm-up, but for an overlapped run's last (drain), whose adapter was applied (a LoRA result
    counts only where it held). A step whose adapter was still the identity counts: the check could not judge it
    (identity_adapter)."""
    after = after_warmup(df)
    after = after[~drain(df).loc[after.index].to_numpy(dtype=bool)]
    if "check/adapter_applied" in after.columns:
        applied = adapter_gate(df).loc[after.index]
        after = after[applied.fillna(True).astype(bool)]
    return after


def with_ids(df: pd.DataFrame) -> pd.DataFrame:
    """The frame with config_id, replicate, release and client, for frames built without aggregate.normalise."""
    if {"config_id", "replicate", "release", "client"} <= set(df.columns):
        return df
    split = df["run_id"].astype(str).map(split_replicate)
    return df.assign(config_id=split.map(lambda t: t[0]), replicate=split.map(lambda t: t[1]),
                     **{k: None for k in ("release", "client") if k not in df.columns})


def configs(df: pd.DataFrame) -> list[tuple]:
    """The distinct configurations (replicates of one count once), in a stable order; the last field is the
    configuration id."""
    df = with_ids(df)
    keys = df[CONFIG_KEY].drop_duplicates()
    return [tuple(row) for row in keys.sort_values(CONFIG_KEY).itertuples(index=False)]


def run_order(df: pd.DataFrame) -> list[str]:
    """run_ids in configuration order, then replicate, so every table and plot lists runs the same way."""
    df = with_ids(df)
    runs = df.drop_duplicates("run_id").copy()  # a small frame of its own (the table may be fragmented)
    order = {c[-1]: i for i, c in enumerate(configs(df))}
    runs = runs.assign(_c=runs["config_id"].map(order)).sort_values(["_c", "replicate", "run_id"])
    return [str(r) for r in runs["run_id"]]


def select(df: pd.DataFrame, config: tuple) -> pd.DataFrame:
    """Every run's rows of one configuration."""
    df = with_ids(df)
    return df[(df["config_id"] == config[-1]).fillna(False).to_numpy(dtype=bool)]


def n_runs(df: pd.DataFrame) -> int:
    return int(df["run_id"].nunique())


def estimate(df: pd.DataFrame, metric: str, n_boot: int = N_BOOT, seed: int = SEED) -> Estimate:
    """The metric over the frame's runs (one configuration's steady-state steps)."""
    return hierarchical_median(per_run(df, metric), n_boot=n_boot, seed=seed)


def summarise(df: pd.DataFrame, metrics: list[str], n_boot: int = N_BOOT, seed: int = SEED) -> pd.DataFrame:
    """Long table: one row per configuration and metric, over steady-state steps of all its runs."""
    steady = steady_state(df)
    rows = []
    for config in configs(df):
        sub = select(steady, config)
        for metric in metrics:
            est = estimate(sub, metric, n_boot=n_boot, seed=seed)
            rows.append({**dict(zip(CONFIG_KEY, config, strict=True)), "metric": metric,
                         "median": est.value, "ci_lo": est.lo, "ci_hi": est.hi, "n": est.n, "n_runs": est.n_runs})
    return pd.DataFrame(rows, columns=[*CONFIG_KEY, "metric", "median", "ci_lo", "ci_hi", "n", "n_runs"])


def compare(df: pd.DataFrame, metric: str, config: tuple, baseline: tuple, n_boot: int = N_BOOT,
            seed: int = SEED) -> Estimate:
    """Ratio of the steady-state medians of `metric`: config / baseline, over runs and steps."""
    steady = steady_state(df)
    return hierarchical_ratio(per_run(select(steady, config), metric), per_run(select(steady, baseline), metric),
                              n_boot=n_boot, seed=seed)
