"""A least-squares slope over steps with a pairs-bootstrap interval: does a reading drift as a run goes on
(e.g. the engine's GPU memory after each sleep)?"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from hybridrl.report.stats import N_BOOT, SEED, Estimate, _interval


def _slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slope of each row of (x, y); NaN where a row's x does not vary."""
    xc = x - x.mean(axis=-1, keepdims=True)
    var = (xc * xc).sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(var > 0, (xc * (y - y.mean(axis=-1, keepdims=True))).sum(axis=-1) / var, np.nan)


def bootstrap_slope(steps: Iterable[float], values: Iterable[float], n_boot: int = N_BOOT, seed: int = SEED,
                    level: float = 0.95) -> Estimate:
    """Change of `values` per step, with a seeded percentile interval from resampling (step, value) pairs;
    n is the number of finite pairs, the interval NaN below three."""
    x, y = np.asarray(list(steps), dtype=float), np.asarray(list(values), dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if len(x) < 2:
        return Estimate(float("nan"), float("nan"), float("nan"), len(x))
    value = float(_slopes(x, y))
    if len(x) < 3 or not np.isfinite(value):  # too few pairs, or every reading at one step
        return Estimate(value, float("nan"), float("nan"), len(x))
    idx = np.random.default_rng(seed).integers(0, len(x), size=(n_boot, len(x)))
    boot = _slopes(x[idx], y[idx])
    lo, hi = _interval(boot[np.isfinite(boot)], level)
    return Estimate(value, lo, hi, len(x))


def trend_words(est: Estimate, unit: str) -> str:
    """The slope as a finding, worded from its interval: growth or decline only where the interval excludes 0."""
    if est.n < 3 or not np.isfinite(est.lo):
        return f"too few readings for a trend (n = {est.n})"
    per = f"{unit} a step" if unit else "a step"
    if est.lo > 0:
        return f"grows {est.value:+.3g} {per} [{est.lo:+.3g}, {est.hi:+.3g}]"
    if est.hi < 0:
        return f"falls {est.value:+.3g} {per} [{est.lo:+.3g}, {est.hi:+.3g}]"
    return f"no trend shown: {est.value:+.3g} {per} [{est.lo:+.3g}, {est.hi:+.3g}] contains 0"
