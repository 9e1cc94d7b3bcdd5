"""Medians with percentile-bootstrap 95% intervals over steps, and ratios of medians."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from hybridrl.report.aggregate import CONFIG_KEY

WARMUP_STEPS = 1  # step 1 pays for compilation, cache warm-up and first loads
N_BOOT = 5000
SEED = 0


@dataclass(frozen=True)
class Estimate:
    """A median (or ratio of medians) with its bootstrap interval; lo/hi are NaN when n < 2."""

    value: float
    lo: float
    hi: float
    n: int

    def contains(self, x: float) -> bool:
        return bool(self.lo <= x <= self.hi)


def _clean(values: Iterable[float]) -> np.ndarray:
    series = pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce")
    arr = series.to_numpy(dtype=float, na_value=np.nan)
    return arr[np.isfinite(arr)]


def _boot_medians(x: np.ndarray, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    return np.median(x[idx], axis=1)


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(samples, [tail, 100 - tail])
    return float(lo), float(hi)


def bootstrap_median(values: Iterable[float], n_boot: int = N_BOOT, seed: int = SEED,
                     level: float = 0.95) -> Estimate:
    """Median of the finite values with a seeded percentile-bootstrap interval."""
    x = _clean(values)
    if len(x) == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    med = float(np.median(x))
    if len(x) < 2:
        return Estimate(med, float("nan"), float("nan"), 1)
    lo, hi = _interval(_boot_medians(x, np.random.default_rng(seed), n_boot), level)
    return Estimate(med, lo, hi, len(x))


def ratio_of_medians(a: Iterable[float], b: Iterable[float], n_boot: int = N_BOOT, seed: int = SEED,
                     level: float = 0.95) -> Estimate:
    """median(a) / median(b); both samples are resampled independently for the interval. n = min(n_a, n_b)."""
    xa, xb = _clean(a), _clean(b)
    n = int(min(len(xa), len(xb)))
    if n == 0 or np.median(xb) == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), n)
    value = float(np.median(xa) / np.median(xb))
    if n < 2:
        return Estimate(value, float("nan"), float("nan"), n)
    rng = np.random.default_rng(seed)
    ma, mb = _boot_medians(xa, rng, n_boot), _boot_medians(xb, rng, n_boot)
    ratios = ma[mb != 0] / mb[mb != 0]
    lo, hi = _interval(ratios, level)
    return Estimate(value, lo, hi, n)


def warmup(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["step"] <= WARMUP_STEPS]


def steady_state(df: pd.DataFrame) -> pd.DataFrame:
    """Steps after warm-up whose adapter was applied (a LoRA result counts only where it held)."""
    after = df[df["step"] > WARMUP_STEPS]
    if "check/adapter_applied" in after.columns:
        applied = after["check/adapter_applied"].astype("boolean")
        after = after[applied.fillna(True).astype(bool)]
    return after


def configs(df: pd.DataFrame) -> list[tuple]:
    """The distinct configurations, in a stable order."""
    keys = df[CONFIG_KEY].drop_duplicates()
    return [tuple(row) for row in keys.sort_values(CONFIG_KEY).itertuples(index=False)]


def run_order(df: pd.DataFrame) -> list[str]:
    """run_ids in configuration order, so every table and plot lists runs the same way."""
    return [str(c[-1]) for c in configs(df)]


def _select(df: pd.DataFrame, config: tuple) -> pd.DataFrame:
    mask = np.ones(len(df), dtype=bool)
    for col, val in zip(CONFIG_KEY, config, strict=True):
        same = (df[col] == val).fillna(False) | (df[col].isna() & bool(pd.isna(val)))
        mask &= same.to_numpy(dtype=bool)  # a missing field (tp unset) still matches itself
    return df[mask]


def summarise(df: pd.DataFrame, metrics: list[str], n_boot: int = N_BOOT, seed: int = SEED) -> pd.DataFrame:
    """Long table: one row per configuration and metric, over steady-state steps."""
    steady = steady_state(df)
    rows = []
    for config in configs(df):
        sub = _select(steady, config)
        for metric in metrics:
            values = sub[metric] if metric in sub.columns else []
            est = bootstrap_median(values, n_boot=n_boot, seed=seed)
            rows.append({**dict(zip(CONFIG_KEY, config, strict=True)), "metric": metric,
                         "median": est.value, "ci_lo": est.lo, "ci_hi": est.hi, "n": est.n})
    return pd.DataFrame(rows, columns=[*CONFIG_KEY, "metric", "median", "ci_lo", "ci_hi", "n"])


def compare(df: pd.DataFrame, metric: str, config: tuple, baseline: tuple, n_boot: int = N_BOOT,
            seed: int = SEED) -> Estimate:
    """Ratio of the steady-state medians of `metric`: config / baseline."""
    steady = steady_state(df)
    return ratio_of_medians(_select(steady, config)[metric], _select(steady, baseline)[metric],
                            n_boot=n_boot, seed=seed)
