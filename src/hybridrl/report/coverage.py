"""How often the reports' 95% intervals hold the truth, measured rather than assumed (`hybridrl interval-coverage`).

A percentile bootstrap that draws runs with replacement sees only the runs it has: with 2 or 3 runs a side it
can understate run-to-run variance, and its interval is then narrower than 95% would need. Two checks:

- simulation: two arms of R runs x S steps, log value = log(mu) + run effect N(0, sd_run) + step noise
  N(0, sd_step), with sd_run and sd_step estimated from the committed verdict studies the caller names; the
  fraction of pairs whose `stats.hierarchical_ratio` interval holds the true ratio (coverage) and excludes 1 (false
  positives at ratio 1, power above it);
- null splits of real data: every configuration with 6 or more committed runs, split 3 against 3 in every way;
  the halves ran the same configuration, so an interval that excludes 1 is a false positive (or a real drift
  between leases, which the reports' intervals would meet too).
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hybridrl.report import stats, wording
from hybridrl.report.aggregate import read_table
from hybridrl.study.run_config import split_replicate

REPO = Path(__file__).resolve().parents[3]
REFERENCE = REPO / "results" / "reference"
METRICS = ("timing_s/step", "perf/throughput")
DESIGNS = ((2, 8), (3, 8), (6, 8))  # (runs, steps) a side, as the studies have them
RATIOS = (1.0, 1.05, 1.10, 1.20)
SIMS = 1500  # 4 to 6 minutes on 2 busy cores; Monte-Carlo error of a 95% coverage about 0.006
SIM_N_BOOT = 2000  # below the reports' N_BOOT (5000), to keep the run to minutes
LEVEL = 0.95
SPLIT_RUNS = 3  # each half of a null split: the runs a side most studies have
SCALES = (0.0, 0.5, 2.0)  # sd_run multiples tried at 3 runs x 8 steps beside the estimate


@dataclass(frozen=True)
class Noise:
    """Log-scale noise of one metric: sd_run between runs of one configuration, sd_step between a run's steps."""

    sd_run: float
    sd_step: float


def fraction(hits: int, n: int) -> dict[str, float | int]:
    """A Monte-Carlo fraction with its binomial standard error, so a reader can tell 0.93 from 0.95."""
    p = hits / n if n else float("nan")
    return {"fraction": p, "se": math.sqrt(p * (1 - p) / n) if n else float("nan"), "hits": hits, "n": n}


def _log_runs(df: pd.DataFrame, metric: str) -> list[np.ndarray]:
    """Each run's finite, positive values of the metric on the log scale (the model's scale)."""
    out = []
    for run in stats.per_run(df, metric):
        x = run.to_numpy(dtype=float)
        x = x[np.isfinite(x) & (x > 0)]
        if len(x):
            out.append(np.log(x))
    return out


def study_steady(folder: str, reference: Path = REFERENCE) -> pd.DataFrame:
    """One committed study's steady-state steps, run ids prefixed with its folder's name as figures.py pools
    folders joined by '+', so that replicates of one configuration from several leases stay apart."""
    df = stats.with_ids(read_table(reference / folder / "steps.csv"))
    return stats.steady_state(df).assign(run_id=lambda d: folder + "/" + d["run_id"].astype(str))


def estimate_noise(groups: Sequence[Sequence[np.ndarray]], steps: int = 8) -> dict[str, float]:
    """sd_run and sd_step from groups of runs (each group one configuration in one lease, log values).

    sd_step: within-run standard deviation, pooled (root mean variance over runs). sd_run: standard deviation of
    the run medians within a group, pooled over groups; it holds some step noise too (a median of `steps` steps
    varies), so sd_run_net takes out what normal step noise alone would give (pi/2 sd_step^2 / steps), and the
    robust pair uses the median absolute deviation, which a few slow steps inflate less than the SD."""
    within = [np.var(r, ddof=1) for g in groups for r in g if len(r) > 1]
    mads = [(1.4826 * np.median(np.abs(r - np.median(r)))) ** 2 for g in groups for r in g if len(r) > 1]
    medians = [np.var([np.median(r) for r in g], ddof=1) for g in groups if len(g) > 1]
    sd_step, sd_step_mad = math.sqrt(np.mean(within)), math.sqrt(np.mean(mads))
    var_runs = float(np.mean(medians))
    median_var = math.pi / 2 / steps  # variance of a median of `steps` normal values, per unit variance
    return {"sd_run": math.sqrt(var_runs), "sd_step": sd_step,
            "sd_run_net": math.sqrt(max(0.0, var_runs - median_var * sd_step**2)),
            "sd_step_mad": sd_step_mad,
            "sd_run_net_mad": math.sqrt(max(0.0, var_runs - median_var * sd_step_mad**2)),
            "groups": len(medians), "runs": sum(len(g) for g in groups)}


def noise_from_studies(folders: Iterable[str], metrics: Iterable[str] = METRICS, reference: Path = REFERENCE
                       ) -> dict[str, dict[str, Any]]:
    """estimate_noise per metric over every configuration of the study folders (under `reference`), one group per
    configuration and lease."""
    frames = [study_steady(f, reference) for f in folders]
    out: dict[str, dict[str, Any]] = {}
    for metric in metrics:
        groups = [_log_runs(g, metric) for df in frames for _, g in df.groupby("config_id", sort=True)]
        out[metric] = estimate_noise([g for g in groups if g])
    return out


def draw_arm(rng: np.random.Generator, runs: int, steps: int, noise: Noise, mu: float = 1.0) -> np.ndarray:
    """runs x steps log-normal values: mu times exp(run effect + step noise)."""
    run_effect = rng.normal(0.0, noise.sd_run, size=(runs, 1))
    return mu * np.exp(run_effect + rng.normal(0.0, noise.sd_step, size=(runs, steps)))


def simulate(noise: Noise, runs: int, steps: int, ratios: Sequence[float] = RATIOS, sims: int = SIMS,
             n_boot: int = SIM_N_BOOT, seed: int = 0, level: float = LEVEL,
             advance: Callable[[], object] | None = None) -> list[dict[str, Any]]:
    """Per true ratio: the fraction of simulated pairs whose hierarchical_ratio interval holds it (coverage) and
    the fraction that excludes 1 (false positives at 1, power above). The ratios share each pair's noise (arm a
    is scaled), so they differ in power only: a percentile interval of a ratio scales with the data, and its
    coverage cannot depend on the true ratio. `advance`, if given, is called once per simulated pair."""
    rng = np.random.default_rng(seed)
    covered, excluded = np.zeros(len(ratios), int), np.zeros(len(ratios), int)
    widths: list[list[float]] = [[] for _ in ratios]
    detectable: list[list[float]] = [[] for _ in ratios]
    for _ in range(sims):
        a, b = draw_arm(rng, runs, steps, noise), draw_arm(rng, runs, steps, noise)
        boot_seed = int(rng.integers(2**31))
        for i, ratio in enumerate(ratios):
            est = stats.hierarchical_ratio(list(ratio * a), list(b), n_boot=n_boot, seed=boot_seed, level=level)
            covered[i] += est.contains(ratio)
            excluded[i] += est.excludes(1.0)
            widths[i].append(math.sqrt(est.hi / est.lo))
            detectable[i].append(wording.detectable(est))
        if advance is not None:
            advance()
    return [{"ratio": r, "coverage": fraction(int(covered[i]), sims), "excludes_one": fraction(int(excluded[i]), sims),
             # the half-width is an effect found about half the time; the reports quote the 80%-power ratio
             "median_half_width": float(np.median(widths[i])),
             "median_detectable": float(np.median(detectable[i]))} for i, r in enumerate(ratios)]


def splits(n: int, half: int = SPLIT_RUNS) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every unordered pair of disjoint `half`-run sets among n runs (10 for 6 runs, 840 for 9)."""
    out = []
    for a in itertools.combinations(range(n), half):
        rest = [i for i in range(n) if i not in a]
        out += [(a, b) for b in itertools.combinations(rest, half) if a[0] < b[0]]
    return out


def null_split(runs: Sequence[np.ndarray], leases: Sequence[str], n_boot: int = stats.N_BOOT,
               half: int = SPLIT_RUNS) -> dict[str, Any]:
    """Every split of one configuration's runs into two halves, each interval as the reports compute it; the
    splits that put one lease against another are listed on their own (a lease-to-lease drift shows there)."""
    hits, by_lease = 0, []
    pairs = splits(len(runs), half)
    for a, b in pairs:
        est = stats.hierarchical_ratio([runs[i] for i in a], [runs[i] for i in b], n_boot=n_boot)
        hits += est.excludes(1.0)
        la, lb = {leases[i] for i in a}, {leases[i] for i in b}
        if len(la) == 1 and len(lb) == 1:
            by_lease.append({"a": la.pop(), "b": lb.pop(), "ratio": est.value, "lo": est.lo, "hi": est.hi,
                             "excludes_one": est.excludes(1.0)})
    return {"splits": len(pairs), "excluding_one": hits, "excludes_one": hits / len(pairs),
            "lease_against_lease": by_lease}


def replicated_configs(min_runs: int = 2 * SPLIT_RUNS, reference: Path = REFERENCE) -> dict[str, pd.DataFrame]:
    """Every configuration (full config id) with at least min_runs committed runs under `reference`, pooled over
    the leases that ran it, as steady-state steps."""
    folders = sorted(p.parent.name for p in reference.glob("*/steps.csv"))
    counts: dict[str, list[str]] = {}
    for folder in folders:  # the run ids alone first (as aggregate.derive names configurations): reading and
        # normalising every committed table would take most of the command's time outside the simulation
        run_ids = pd.read_csv(reference / folder / "steps.csv", usecols=["run_id"], dtype=str)["run_id"].unique()
        for run_id in run_ids:
            counts.setdefault(split_replicate(str(run_id))[0], []).append(folder)
    keep = {c: sorted(set(f)) for c, f in counts.items() if len(f) >= min_runs}
    out = {}
    for cid, where in sorted(keep.items()):
        frames = [study_steady(f, reference) for f in where]
        out[cid] = pd.concat([df[df["config_id"] == cid] for df in frames], ignore_index=True)
    return out


def null_splits(n_boot: int = stats.N_BOOT, metrics: Iterable[str] = METRICS,
                advance: Callable[[], object] | None = None,
                configs: dict[str, pd.DataFrame] | None = None) -> dict[str, Any]:
    """null_split of every replicated configuration (default: replicated_configs()) and metric, and the fraction
    over all of them."""
    arms, total = [], {m: [0, 0] for m in metrics}
    for cid, df in (replicated_configs() if configs is None else configs).items():
        order = sorted(str(r) for r in df["run_id"].unique())  # folder/run id: lease by lease
        leases = [r.split("/", 1)[0] for r in order]
        arm: dict[str, Any] = {"config_id": cid, "runs": len(order), "studies": sorted(set(leases)), "metrics": {}}
        for metric in total:
            values = [pd.to_numeric(df.loc[df["run_id"] == r, metric], errors="coerce").to_numpy(dtype=float)
                      for r in order]
            result = null_split(values, leases, n_boot=n_boot)
            arm["metrics"][metric] = result
            total[metric][0] += result["excluding_one"]
            total[metric][1] += result["splits"]
            if advance is not None:
                advance()
        arms.append(arm)
    # pooled over splits, a configuration with 9 runs (840 splits) outweighs four with 6 (10 each): arm_mean
    # weighs every configuration alike
    def arm_mean(metric: str) -> float:
        return float(np.mean([a["metrics"][metric]["excludes_one"] for a in arms])) if arms else float("nan")

    def leases(metric: str) -> list[bool]:
        return [s["excludes_one"] for a in arms for s in a["metrics"][metric]["lease_against_lease"]]

    overall = {m: _tally(k, n, arm_mean(m), leases(m)) for m, (k, n) in total.items()}
    overall["all"] = _tally(sum(v[0] for v in total.values()), sum(v[1] for v in total.values()),
                            float(np.mean([overall[m]["arm_mean"] for m in total])) if arms else float("nan"),
                            [hit for m in total for hit in leases(m)])
    return {"arms": arms, "overall": overall, "n_boot": n_boot, "half": SPLIT_RUNS,
            "note": "the splits of one configuration share runs, so they are not independent: no binomial error"}


def _tally(excluding: int, splits: int, arm_mean: float, lease_hits: list[bool]) -> dict[str, Any]:
    """One line of null_splits' overall: how many splits excluded 1, pooled and configuration by configuration,
    and how many of the lease-against-lease splits did."""
    return {"splits": splits, "excluding_one": excluding,
            "excludes_one": excluding / splits if splits else float("nan"), "arm_mean": arm_mean,
            "lease_splits": len(lease_hits), "lease_splits_excluding_one": sum(lease_hits)}


def _key(runs: int, steps: int) -> str:
    return f"runs{runs}_steps{steps}"


def main(out: Path | None, noise_studies: Sequence[str], sims: int = SIMS, seed: int = 0, n_boot: int = SIM_N_BOOT,
         split_n_boot: int = stats.N_BOOT, progress: bool = True, reference: Path = REFERENCE) -> dict[str, Any]:
    """Both checks, written to `out` as JSON (keys without dots, so README figures can address them): the
    simulation with the noise of `noise_studies` (study folders under `reference`), the null splits over every
    study there."""
    from rich.progress import Progress

    started, load_before = time.perf_counter(), os.getloadavg()
    noise = noise_from_studies(noise_studies, reference=reference)
    models = {m: Noise(v["sd_run"], v["sd_step"]) for m, v in noise.items()}
    alternatives = {"net": lambda v: Noise(v["sd_run_net"], v["sd_step"]),
                    "robust": lambda v: Noise(v["sd_run_net_mad"], v["sd_step_mad"])}
    replicated = replicated_configs(reference=reference)
    work = sims * len(METRICS) * (len(DESIGNS) * (1 + len(alternatives)) + len(SCALES)) + len(replicated) * len(METRICS)
    simulation: dict[str, Any] = {}
    calibrations: dict[str, Any] = {}
    scaled: dict[str, Any] = {}
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("interval coverage", total=work)

        def advance() -> None:
            bar.advance(task)

        for mi, metric in enumerate(METRICS):
            simulation[metric], calibrations[metric], scaled[metric] = {}, {}, {}
            for di, (runs, steps) in enumerate(DESIGNS):
                rows = simulate(models[metric], runs, steps, RATIOS, sims, n_boot, seed=seed + 1000 * mi + di,
                                advance=advance)
                simulation[metric][_key(runs, steps)] = {"runs": runs, "steps": steps, "ratios": rows}
            for name, make in alternatives.items():
                model = make(noise[metric])
                calibrations[metric][name] = {"sd_run": model.sd_run, "sd_step": model.sd_step}
                for di, (runs, steps) in enumerate(DESIGNS):
                    row = simulate(model, runs, steps, (1.0,), sims, n_boot, seed=seed + 1000 * mi + di,
                                   advance=advance)[0]
                    calibrations[metric][name][_key(runs, steps)] = row
            for scale in SCALES:
                model = Noise(models[metric].sd_run * scale, models[metric].sd_step)
                row = simulate(model, 3, 8, (1.0,), sims, n_boot, seed=seed + 1000 * mi + 1, advance=advance)[0]
                scaled[metric][f"x{scale:g}".replace(".", "_")] = {"sd_run": model.sd_run, **row}
        nulls = null_splits(split_n_boot, advance=advance, configs=replicated)
    result = {
        "what": "coverage of stats.hierarchical_ratio's 95% percentile intervals: simulated log-normal arms with "
                "run and step noise estimated from committed verdict studies, and 3-vs-3 splits of configurations "
                "with 6 or more committed runs (no real difference between the halves)",
        "level": LEVEL, "sims": sims, "seed": seed, "n_boot": n_boot,
        "n_boot_note": f"the simulation draws {n_boot} bootstrap samples per interval (the reports draw "
                       f"{stats.N_BOOT}); the null splits draw {split_n_boot}",
        "common_random_numbers": "the true ratios of one design share each simulated pair's noise (arm a scaled), "
                                 "so coverage is the same at every ratio; only power differs",
        "noise_studies": list(noise_studies), "noise": noise,
        "noise_model": "log value = log(mu) + N(0, sd_run) per run + N(0, sd_step) per step; the simulation uses "
                       "sd_run (spread of run medians) and sd_step (within-run SD); calibrations: net takes the "
                       "step noise out of sd_run, robust uses median absolute deviations",
        "noise_used": {m: asdict(v) for m, v in models.items()},
        "simulation": simulation, "calibrations": calibrations, "sd_run_scaled_runs3_steps8": scaled,
        "null_splits": nulls,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(), "python": platform.python_version(),
                    "numpy": np.__version__, "loadavg_1_5_15_before": load_before,
                    "loadavg_1_5_15_after": os.getloadavg()},
        "runtime_s": time.perf_counter() - started,
    }
    if out is not None:
        from hybridrl.run.provenance import write as write_json

        write_json(out, result)
    return result


def summary(result: dict[str, Any]) -> str:
    """The figures a reader wants first, one line per design and metric."""
    lines = []
    for metric, designs in result["simulation"].items():
        for d in designs.values():
            at_one = d["ratios"][0]
            lines.append(f"{metric:16} {d['runs']} runs x {d['steps']} steps: coverage "
                         f"{at_one['coverage']['fraction']:.3f} (se {at_one['coverage']['se']:.3f}), excludes 1 at "
                         f"ratio 1 {at_one['excludes_one']['fraction']:.3f}; power at "
                         + ", ".join(f"{r['ratio']:g}: {r['excludes_one']['fraction']:.2f}" for r in d["ratios"][1:]))
    for metric, v in result["null_splits"]["overall"].items():
        lines.append(f"null splits {metric:16}: {v['excluding_one']} of {v['splits']} exclude 1 "
                     f"({v['excludes_one']:.3f})")
    return "\n".join(lines)
