"""Replicates: their ids and order, the DAG's interleaving, the hierarchical bootstrap and the wording rules."""

import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from hybridrl.report import wording
from hybridrl.report.stats import Estimate, hierarchical_median, hierarchical_ratio
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


def test_hierarchical_ratio_and_its_counts() -> None:
    rng = np.random.default_rng(1)
    fast = [rng.normal(200, 4, 8) for _ in range(3)]
    slow = [rng.normal(100, 2, 8) for _ in range(2)]
    est = hierarchical_ratio(fast, slow)
    assert est.value == pytest.approx(np.median(np.concatenate(fast)) / np.median(np.concatenate(slow)))
    assert est.excludes(1.0) and est.contains(2.0)
    assert (est.n_runs, est.n_steps) == (2, 16)  # the smaller side
    assert np.isnan(hierarchical_ratio([[1.0]], [[2.0]]).lo)


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
