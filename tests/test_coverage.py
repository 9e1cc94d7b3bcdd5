"""The interval-coverage check: it finds nominal coverage where the bootstrap's assumptions hold, finds it short
where they do not (so the check can fail), and the command writes what the README quotes."""

import json
from pathlib import Path

import numpy as np
import pytest

from hybridrl import cli
from hybridrl.report import coverage, stats

# the verdict studies results/reference/2026-11-27-cpu-coverage/README.md's command names (one lease each,
# 2 arms x 3 runs x 8 steady steps)
README_STUDIES = ["2026-11-27-h200-verdictdraws", "2026-11-24-h200-verdictpin", "2026-11-24-h200-verdictpin2"]


def test_coverage_is_near_nominal_without_run_to_run_noise() -> None:
    """With no run effect, every step is independent: the bootstrap's interval of a ratio of medians over many
    steps holds the truth about 95% of the time (the percentile interval of a median runs a little wide or narrow,
    hence the loose band)."""
    rows = coverage.simulate(coverage.Noise(sd_run=0.0, sd_step=0.1), runs=3, steps=40, ratios=(1.0,), sims=150,
                             n_boot=400, seed=1)
    assert 0.88 <= rows[0]["coverage"]["fraction"] <= 1.0
    assert rows[0]["excludes_one"]["fraction"] <= 0.12
    # the reports' detectable ratio (80% power) lies beyond the half-width (an effect found half the time)
    assert rows[0]["median_detectable"] > rows[0]["median_half_width"] > 1.0


def test_coverage_falls_short_with_two_runs_and_a_large_run_effect() -> None:
    """Two runs a side whose run effect dwarfs the step noise: drawing 2 runs with replacement cannot show the
    spread of runs, and the interval holds the true ratio far less often than 95%."""
    rows = coverage.simulate(coverage.Noise(sd_run=0.3, sd_step=0.02), runs=2, steps=8, ratios=(1.0, 1.2),
                             sims=150, n_boot=400, seed=2)
    assert rows[0]["coverage"]["fraction"] < 0.85
    assert rows[0]["excludes_one"]["fraction"] > 0.15  # false positives at ratio 1
    # the ratios share each pair's noise: the interval scales with the data, so coverage is the same at each
    assert rows[0]["coverage"]["hits"] == rows[1]["coverage"]["hits"]


def test_fraction_carries_its_monte_carlo_error() -> None:
    f = coverage.fraction(95, 100)
    assert f["fraction"] == 0.95 and f["se"] == pytest.approx(np.sqrt(0.95 * 0.05 / 100))


def test_splits_are_every_unordered_pair_of_disjoint_halves() -> None:
    six = coverage.splits(6)
    assert len(six) == 10 and all(set(a).isdisjoint(b) and 0 in a for a, b in six)
    assert len(coverage.splits(9)) == 840


def test_a_null_split_of_like_runs_rarely_excludes_one_and_a_shifted_lease_does() -> None:
    rng = np.random.default_rng(3)
    runs = [np.exp(rng.normal(0, 0.05, 8)) for _ in range(6)]
    leases = ["a", "a", "a", "b", "b", "b"]
    same = coverage.null_split(runs, leases, n_boot=300)
    assert same["splits"] == 10 and same["excluding_one"] <= 2
    assert [(s["a"], s["b"]) for s in same["lease_against_lease"]] == [("a", "b")]
    shifted = coverage.null_split([r * (2.0 if i >= 3 else 1.0) for i, r in enumerate(runs)], leases, n_boot=300)
    assert shifted["lease_against_lease"][0]["excludes_one"]  # a lease twice as slow is not a null


def test_noise_estimates_separate_runs_from_steps() -> None:
    """Runs that differ by a constant and steps that do not vary: all of the spread is between runs."""
    groups = [[np.full(8, x) + np.array([0.0, 1e-9] * 4) for x in (0.0, 0.1, 0.2)]]
    est = coverage.estimate_noise(groups)
    assert est["sd_run"] == pytest.approx(0.1) and est["sd_step"] < 1e-6
    assert est["sd_run_net"] == pytest.approx(0.1)


def test_the_command_writes_the_keys_the_readme_quotes(tmp_path: Path) -> None:
    out = tmp_path / "coverage.json"
    assert cli.main(["interval-coverage", "--noise-studies", *README_STUDIES, "--out", str(out), "--sims", "3",
                     "--n-boot", "50", "--split-n-boot", "50"]) == 0
    result = json.loads(out.read_text())
    assert result["sims"] == 3 and result["n_boot"] == 50 and result["noise_studies"] == README_STUDIES
    for metric in coverage.METRICS:
        assert {"sd_run", "sd_step"} <= set(result["noise_used"][metric])
        for runs, steps in coverage.DESIGNS:
            rows = result["simulation"][metric][f"runs{runs}_steps{steps}"]["ratios"]
            assert [r["ratio"] for r in rows] == list(coverage.RATIOS)
            assert {"fraction", "se", "n"} <= set(rows[0]["coverage"]) and rows[0]["coverage"]["n"] == 3
        assert result["null_splits"]["overall"][metric]["splits"] >= 10
    assert result["null_splits"]["arms"] and all(a["runs"] >= 6 for a in result["null_splits"]["arms"])
    assert "." not in "".join(_keys(result))  # README figures address the JSON by dotted paths


def test_the_command_s_help_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse formats help with %: a bare '95%' in it would break `hybridrl --help`."""
    for argv in (["--help"], ["interval-coverage", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            cli.parser().parse_args(argv)
        assert exit_.value.code == 0
    assert "95% intervals" in capsys.readouterr().out


def test_the_command_defaults_are_the_module_s() -> None:
    args = cli.parser().parse_args(["interval-coverage", "--noise-studies", "s", "--out", "x.json"])
    assert (args.sims, args.n_boot, args.split_n_boot) == (coverage.SIMS, coverage.SIM_N_BOOT, stats.N_BOOT)


def test_the_noise_comes_from_the_studies_named_and_the_command_needs_them(capsys: pytest.CaptureFixture[str]
                                                                            ) -> None:
    committed = json.loads((coverage.REFERENCE / "2026-11-27-cpu-coverage" / "coverage.json").read_text())
    noise = coverage.noise_from_studies(README_STUDIES)
    assert noise.keys() == committed["noise"].keys()
    for metric, estimate in committed["noise"].items():  # the committed output, reproduced
        assert noise[metric] == pytest.approx(estimate)
    one = coverage.noise_from_studies(README_STUDIES[:1])
    assert one["timing_s/step"]["sd_run"] != pytest.approx(committed["noise"]["timing_s/step"]["sd_run"])
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["interval-coverage", "--out", "x.json"])
    assert "--noise-studies" in capsys.readouterr().err


def test_the_readme_s_command_names_the_noise_studies() -> None:
    readme = (coverage.REFERENCE / "2026-11-27-cpu-coverage" / "README.md").read_text()
    assert f"interval-coverage --noise-studies {' '.join(README_STUDIES)} --out" in readme


def _keys(x: object) -> list[str]:
    if isinstance(x, dict):
        return [str(k) for k in x] + [k for v in x.values() for k in _keys(v)]
    if isinstance(x, list):
        return [k for v in x for k in _keys(v)]
    return []
