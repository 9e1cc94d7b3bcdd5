"""Replicates: their ids and order, the DAG's interleaving, the hierarchical bootstrap and the wording rules."""

import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from hybridrl.report import wording
from hybridrl.report.stats import (
    LEASE,
    Estimate,
    _drawn_runs,
    blocked_ratio,
    hierarchical_median,
    hierarchical_ratio,
    per_run,
)
from hybridrl.study.config import load_study
from hybridrl.study.run_config import RunConfig, run_id, split_replicate

REPO = Path(__file__).resolve().parents[1]


def _study(tmp_path: Path, replicates: int = 3) -> Path:
    raw = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    raw["defaults"]["replicates"] = replicates
    raw["runs"] = [{"placement": "split"}, {"placement": "restart"}, {"placement": "split", "lr": 1e-3}]
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_replicates_get_own_ids_same_seed_and_run_round_by_round(tmp_path: Path) -> None:
    study = load_study(_study(tmp_path))
    ids = list(study.runs)
    assert len(ids) == 9
    configs = [split_replicate(r) for r in ids]
    # A1 B1 C1 A2 B2 C2 A3 B3 C3
    assert [k for _, k in configs] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [c for c, _ in configs[:3]] == [c for c, _ in configs[3:6]] == [c for c, _ in configs[6:]]
    assert ids[3] == ids[0] + "-r2" and ids[6] == ids[0] + "-r3"
    # the same seed, hence the same request sets: replicates differ in their id only
    assert study.runs[ids[0]] == study.runs[ids[3]] == study.runs[ids[6]]


def test_raising_replicates_keeps_the_runs_already_measured(tmp_path: Path) -> None:
    one = list(load_study(_study(tmp_path, replicates=1)).runs)
    three = list(load_study(_study(tmp_path, replicates=3)).runs)
    assert one == three[:3] and all(split_replicate(r)[1] == 1 for r in one)
    run = RunConfig(model="m")
    with pytest.raises(ValueError, match="outside 1..1"):
        run_id(run, 2)
    assert split_replicate("sglang-r2-aaaa1111") == ("sglang-r2-aaaa1111", 1)  # a name is not a suffix


def test_snakemake_dry_run_orders_the_replicates_interleaved(tmp_path: Path) -> None:
    config = _study(tmp_path)
    order = list(load_study(config).runs)
    snakemake = REPO / ".venv" / "bin" / "snakemake"
    out = subprocess.run([str(snakemake), "-s", str(REPO / "Snakefile"), "--configfile", str(config), "-n",
                          "--cores", "1", "results/steps.csv"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    priority = {}
    for block in text.split("rule ")[1:]:
        if not block.startswith("train_"):
            continue
        rid = block.split("run_id=")[1].split()[0]
        priority[rid] = int(block.split("priority: ")[1].split()[0])
    # the scheduler starts the highest priority first: exactly the interleaved order
    assert sorted(priority, key=priority.get, reverse=True) == order


def test_hierarchical_interval_widens_with_run_to_run_spread() -> None:
    rng = np.random.default_rng(0)
    steady = [rng.normal(100, 1, 8) for _ in range(3)]
    drifting = [rng.normal(mu, 1, 8) for mu in (90, 100, 110)]
    a, b = hierarchical_median(steady), hierarchical_median(drifting)
    assert (a.n_runs, a.n_steps) == (3, 24)
    assert b.hi - b.lo > 5 * (a.hi - a.lo)  # a run-level spread is in the interval, not averaged away
    one = hierarchical_median([np.r_[drifting[0], drifting[2]]])  # the same steps as if one run
    assert one.n_runs == 1 and (one.hi - one.lo) < (b.hi - b.lo)


def _leased(runs: list[np.ndarray], leases: list[str]) -> list[pd.Series]:
    out = []
    for values, lease in zip(runs, leases, strict=True):
        series = pd.Series(values)
        series.attrs[LEASE] = lease
        out.append(series)
    return out


def test_the_lease_is_a_level_where_the_runs_come_from_several() -> None:
    rng = np.random.default_rng(2)
    # three leases of three runs each, alike within a lease, 3% apart between them
    runs = [rng.normal(mu, 1, 8) for mu in (100, 100, 100, 103, 103, 103, 106, 106, 106)]
    pooled = hierarchical_median(runs)  # every run one draw: the leases' gap passes for run-to-run spread
    leased = hierarchical_median(_leased(runs, ["a"] * 3 + ["b"] * 3 + ["c"] * 3))
    assert (leased.value, leased.n_runs, leased.n_steps) == (pooled.value, 9, 72)
    assert leased.hi - leased.lo > 1.1 * (pooled.hi - pooled.lo)
    # runs of one lease are resampled as before, draw for draw
    assert hierarchical_median(_leased(runs, ["a"] * 9)) == pooled


def test_a_resample_draws_whole_leases_then_runs_within_each() -> None:
    drawn = _drawn_runs(["a", "a", "a", "b"], np.random.default_rng(0), 4000)
    assert drawn.shape == (4000, 6)  # two lease slots of the widest lease's three runs
    blocks = drawn.reshape(4000, 2, 3)
    from_a = (blocks >= 0).all(axis=2) & (blocks <= 2).all(axis=2)
    from_b = (blocks[:, :, 0] == 3) & (blocks[:, :, 1:] == -1).all(axis=2)
    assert (from_a ^ from_b).all()  # each drawn lease brings its own runs, as many as it has
    assert 0.45 < (from_a[:, 0] == from_a[:, 1]).mean() < 0.55  # one lease drawn twice in about half


def test_per_run_labels_each_run_with_its_machine_as_its_lease() -> None:
    df = pd.DataFrame({"run_id": ["r1", "r1", "r2", "r2", "r3"], "x": [1.0, 2.0, 3.0, 4.0, 5.0],
                       "machine": ["boot-a", "boot-a", "boot-b", "boot-b", None]})
    runs = per_run(df, "x")
    assert [list(r) for r in runs] == [[1.0, 2.0], [3.0, 4.0], [5.0]]
    assert [r.attrs.get(LEASE) for r in runs] == ["boot-a", "boot-b", None]
    assert all(LEASE not in r.attrs for r in per_run(df.drop(columns="machine"), "x"))


def test_hierarchical_ratio_and_its_counts() -> None:
    rng = np.random.default_rng(1)
    fast = [rng.normal(200, 4, 8) for _ in range(3)]
    slow = [rng.normal(100, 2, 8) for _ in range(2)]
    est = hierarchical_ratio(fast, slow)
    assert est.value == pytest.approx(np.median(np.concatenate(fast)) / np.median(np.concatenate(slow)))
    assert est.excludes(1.0) and est.contains(2.0)
    assert (est.n_runs, est.n_steps) == (2, 16)  # the smaller side
    assert np.isnan(hierarchical_ratio([[1.0]], [[2.0]]).lo)


def test_a_blocked_ratio_compares_side_by_side_runs_card_by_card() -> None:
    """Two cards, the second running both sides twice as fast: the ratio card by card stays 0.7 with a narrow
    interval, where pooling both cards resamples the cards' difference into it; one card is hierarchical_ratio's;
    a card where one side did not run is left out."""
    rng = np.random.default_rng(1)
    steps = lambda mean: list(mean * (1 + 0.01 * rng.standard_normal(8)))  # noqa: E731
    slow = ([steps(4.2), steps(4.2)], [steps(6.0), steps(6.0)])
    fast = ([steps(2.1), steps(2.1)], [steps(3.0), steps(3.0)])
    blocked = blocked_ratio([slow, fast])
    assert blocked.value == pytest.approx(0.7, abs=0.01)
    assert 0.68 < blocked.lo < blocked.hi < 0.72 and (blocked.n, blocked.n_runs) == (32, 4)
    pooled = hierarchical_ratio(slow[0] + fast[0], slow[1] + fast[1])
    assert pooled.hi - pooled.lo > 10 * (blocked.hi - blocked.lo)
    assert blocked_ratio([slow]) == hierarchical_ratio(*slow)
    assert blocked_ratio([slow, ([], fast[1])]) == hierarchical_ratio(*slow)
    assert np.isnan(blocked_ratio([([], fast[1])]).value)
    # a card whose ratio differs from the other's widens the interval: the cards are resampled
    apart = blocked_ratio([slow, (fast[0], [steps(2.4), steps(2.4)])])
    assert apart.lo < 0.72 and apart.hi > 0.85


def test_conclusions_follow_the_wording_rules() -> None:
    excl = Estimate(1.30, 1.10, 1.50, 16, 3)
    incl = Estimate(1.05, 0.90, 1.20, 16, 3)
    faster = wording.conclusion("Rollout throughput", "SGLang", "vLLM", excl, (3, 24), (3, 24))
    assert "SGLang is faster than vLLM" in faster and "1.30x [1.10, 1.50]" in faster
    apart = wording.conclusion("Rollout throughput", "SGLang", "vLLM", incl, (3, 24), (3, 24))
    assert "could not be told apart" in apart and "faster" not in apart
    # the ratio these data had 80% power for: wider than the half-width sqrt(1.2 / 0.9), an effect found half the time
    se = np.log(1.2 / 0.9) / (2 * 1.959964)
    assert f"80% power for a ratio of about {np.exp(2.801585 * se):.2f}x" in apart
    assert np.exp(2.801585 * se) > np.sqrt(1.2 / 0.9)
    single = wording.conclusion("Rollout throughput", "SGLang", "vLLM", excl, (1, 8), (3, 24))
    assert "in these runs" in single and "step-to-step noise only" in single
    slower = wording.conclusion("Step time", "SGLang", "vLLM", excl, (3, 24), (3, 24), higher_is_better=False)
    assert "SGLang is slower than vLLM" in slower
    for text in (faster, apart, single, slower):
        assert wording.violations(text) == []
    assert "3 comparisons" in wording.comparisons_note(3) and "0.1" in wording.comparisons_note(2)


def test_wording_check_refuses_what_the_intervals_do_not_say() -> None:
    # the example: "equally fast" beside an interval that excludes 1
    bad = "The engines roll out equally fast: SGLang / vLLM 0.83x [0.74, 0.89] with HF."
    assert len(wording.violations(bad)) == 1
    assert wording.violations("Every interval contains 1 and so there is no difference: 0.59x [0.26, 0.81].")
    # a ranking from an interval that includes 1
    assert wording.violations("SGLang is faster: 1.55x [0.70, 2.54].")
    assert wording.violations("p99 latency favours SGLang, -36% [-60%, +44%].")
    # one sentence that ranks two comparisons, one of which includes 1 (the placement README after its third round)
    assert wording.violations("Colocated and split, SGLang was faster: 1.36x [1.14, 1.49] colocated and 1.37x "
                              "[0.96, 1.67] split.")
    assert wording.violations("Colocated, SGLang was faster, 1.36x [1.14, 1.49]. Split, the two could not be told "
                              "apart, 1.37x [0.96, 1.67].") == []
    # apportioning a gap from an interval that includes none (the in-process vLLM benchmark's old sentence)
    assert wording.violations("The client kept 0.92x [0.83, 1.02] of raw, so most of the gap lies outside it.")
    assert wording.violations("The gap is in decoding: TPOT 1.01x [0.85, 1.21].")
    assert wording.violations("Most of the step is the update, 1.36x [1.14, 1.49] of the rollout.") == []
    # and what the rules allow
    assert wording.violations("SGLang is faster: 1.66x [1.46, 1.86].") == []
    assert wording.violations("Neither is faster here: 1.55x [0.70, 2.54].") == []
    assert wording.violations("Not told apart: +10% [-31%, +61%].") == []
