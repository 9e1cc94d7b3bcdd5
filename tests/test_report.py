"""Aggregation, statistics, plots and the rendered report, on synthetic steps.jsonl runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hybridrl import provenance
from hybridrl.report import aggregate_main, report_main
from hybridrl.report.aggregate import KNOWN, gather, read_table
from hybridrl.report.plots import make_all
from hybridrl.report.stats import (
    bootstrap_median,
    compare,
    configs,
    ratio_of_medians,
    steady_state,
    summarise,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WARMUP_THROUGHPUT = 3.0  # step 1 is far slower than every later step


def record(run_id: str, engine: str, placement: str, step: int, rng: np.random.Generator,
           speed: float, mem: bool = False) -> dict:
    warm = step == 1
    gen = 4.0 / speed * (5 if warm else 1) + rng.normal(0, 0.05)
    rec = {
        "run_id": run_id, "engine": engine, "placement": placement, "trainer": "hf", "model": "tiny",
        "tp": 1, "seed": 0, "step": step, "time_unix": 1_700_000_000 + 10 * step,
        "timing_s/gen": gen, "timing_s/reward": 0.01, "timing_s/sleep": None,
        "timing_s/update_actor": 2.0, "timing_s/wake": None,
        "timing_s/update_weights": 0.3 if placement == "split" else None,
        "timing_s/restart": 6.0 if placement == "restart" else None,
        "perf/gen_tokens": 1000,
        "perf/throughput": WARMUP_THROUGHPUT if warm else 250.0 * speed + rng.normal(0, 5),
        "perf/ttft_s_mean": 0.2, "perf/ttft_s_p50": 0.18 + rng.normal(0, 0.01), "perf/ttft_s_p99": 0.5,
        "perf/itl_ms_mean": 20.0, "perf/itl_ms_p50": 19.0 + rng.normal(0, 0.5), "perf/itl_ms_p99": 40.0,
        "perf/latency_s_p50": 2.0, "perf/latency_s_p99": 3.5 + rng.normal(0, 0.1),
        "errors/requests_failed": 0,
        "perf/train_tokens": 2000, "perf/train_tok_s": 1000.0, "train/loss": 0.1, "train/grad_norm": 1.0,
        "train/kl": 0.0, "train/clipfrac": 0.0,
        "reward/mean": 0.1 * step, "reward/accuracy": 0.05 * step, "response_length/mean": 100.0,
        "check/rollout_logprob_abs_diff": 0.01, "check/base_canary_ok": True, "check/adapter_applied": True,
        "check/kv_capacity_ok": None, "errors/engine_restarts": 0,
        "extra/custom": step * 2,
    }
    rec["timing_s/step"] = sum(v for k, v in rec.items() if k.startswith("timing_s/") and v is not None) + 0.2
    if mem:
        rec.update({"mem/used_gb_gen": 30.0, "mem/used_gb_train": 50.0, "mem/peak_gb": 60.0,
                    "mem/kv_capacity_tokens": 100000})
    return rec


def write_run(results: Path, run_id: str, engine: str, placement: str, steps: int = 8, speed: float = 1.0,
              mem: bool = False, seed: int = 0) -> Path:
    run_dir = results / "runs" / run_id
    run_dir.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    lines = [json.dumps(record(run_id, engine, placement, s, rng, speed, mem)) for s in range(1, steps + 1)]
    (run_dir / "steps.jsonl").write_text("\n".join(lines) + "\n")
    provenance.write(run_dir / "provenance.json",
                     provenance.collect({"engine": engine, "placement": placement}, {"flags": ["--x", "1"]}))
    return run_dir


@pytest.fixture
def study(tmp_path: Path) -> list[Path]:
    results = tmp_path / "results"
    return [write_run(results, "vllm-split-aaaa1111", "vllm", "split", speed=1.0, seed=1),
            write_run(results, "vllm-restart-bbbb2222", "vllm", "restart", speed=0.5, seed=2)]


# -- statistics ---------------------------------------------------------------------------------------

def test_bootstrap_ci_contains_median_and_is_seeded() -> None:
    values = np.random.default_rng(3).lognormal(0, 0.5, size=40)
    est = bootstrap_median(values)
    assert est.n == 40
    assert est.value == pytest.approx(np.median(values))
    assert est.lo < est.value < est.hi
    assert bootstrap_median(values) == est  # same seed, same interval
    assert bootstrap_median(values, seed=1) != est


def test_bootstrap_drops_missing_and_handles_tiny_samples() -> None:
    est = bootstrap_median([1.0, None, float("nan"), 3.0, 2.0])
    assert (est.value, est.n) == (2.0, 3)
    one = bootstrap_median([5.0])
    assert one.value == 5.0 and one.n == 1 and math.isnan(one.lo) and math.isnan(one.hi)
    assert bootstrap_median([]).n == 0 and math.isnan(bootstrap_median([]).value)


def test_ratio_of_medians_has_interval_around_true_ratio() -> None:
    rng = np.random.default_rng(0)
    b = rng.normal(100, 5, size=30)
    a = 2 * rng.normal(100, 5, size=30)
    est = ratio_of_medians(a, b)
    assert est.value == pytest.approx(np.median(a) / np.median(b))
    assert est.lo < est.value < est.hi
    assert est.contains(2.0)
    assert est.n == 30
    assert math.isnan(ratio_of_medians([1.0], [0.0]).value)  # no division by a zero median


def test_warmup_step_is_excluded_from_statistics(study: list[Path]) -> None:
    df = gather(study)
    table = summarise(df, ["perf/throughput"])
    assert (table["n"] == 7).all()  # 8 steps, step 1 left out
    assert (table["ci_lo"] > 50).all()  # the slow first step would drag the interval down
    assert WARMUP_THROUGHPUT not in steady_state(df)["perf/throughput"].to_numpy()


def test_steps_without_applied_adapter_do_not_count(study: list[Path]) -> None:
    df = gather(study)
    df.loc[(df["run_id"] == "vllm-split-aaaa1111") & (df["step"] == 3), "check/adapter_applied"] = False
    n = summarise(df, ["perf/throughput"]).set_index("run_id")["n"]
    assert n["vllm-split-aaaa1111"] == 6 and n["vllm-restart-bbbb2222"] == 7


def test_compare_configs_ratio(study: list[Path]) -> None:
    df = gather(study)
    split, restart = sorted(configs(df), key=lambda c: c[1] != "split")
    est = compare(df, "perf/throughput", split, restart)
    assert est.contains(2.0)  # split was generated at twice the speed
    assert est.value == pytest.approx(2.0, rel=0.1)


# -- aggregation --------------------------------------------------------------------------------------

def test_aggregate_writes_tidy_csv_and_parquet(study: list[Path], tmp_path: Path) -> None:
    out_csv, out_parquet = tmp_path / "out" / "steps.csv", tmp_path / "out" / "steps.parquet"
    aggregate_main(study, out_csv, out_parquet)
    csv = pd.read_csv(out_csv)
    assert list(csv.columns[: len(KNOWN)]) == KNOWN
    assert "extra/custom" in csv.columns  # unknown keys are kept
    assert len(csv) == 16
    assert csv.groupby("run_id")["step"].apply(list).map(lambda s: s == list(range(1, 9))).all()
    assert csv["mem/peak_gb"].isna().all()  # absent on CPU, still a column
    back = read_table(out_parquet)
    assert str(back["check/base_canary_ok"].dtype) == "boolean"
    assert back["check/base_canary_ok"].all()
    assert back["check/kv_capacity_ok"].isna().all()
    pd.testing.assert_frame_equal(back, read_table(out_csv), check_dtype=False)
    assert not [p for p in out_csv.parent.iterdir() if p.name.endswith(".tmp")]


def test_aggregate_tolerates_torn_line_duplicates_and_missing_run_id(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "my-run-1234"
    run_dir.mkdir(parents=True)
    recs = [{"step": 1, "perf/throughput": 1.0}, {"step": 2, "perf/throughput": 2.0},
            {"step": 2, "perf/throughput": 5.0}]  # step 2 rerun after a resume: the last one wins
    (run_dir / "steps.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + '\n{"step": 3, "perf/thr')
    with pytest.warns(UserWarning):
        df = gather([run_dir])
    assert df["run_id"].unique().tolist() == ["my-run-1234"]
    assert df["step"].tolist() == [1, 2]
    assert df["perf/throughput"].tolist() == [1.0, 5.0]


def test_aggregate_fails_clearly_without_steps(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="steps.jsonl"):
        gather([tmp_path / "runs" / "nope"])


# -- plots and report ---------------------------------------------------------------------------------

def test_plots_are_valid_pngs(study: list[Path], tmp_path: Path) -> None:
    import matplotlib.image

    written = make_all(gather(study), tmp_path / "plots")
    assert set(written) == {"throughput", "step_breakdown", "latency", "reward"}  # no memory data on CPU
    for path in written.values():
        assert path.read_bytes()[:8] == PNG_MAGIC
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 200 and width > 300


def test_memory_plot_when_memory_recorded(tmp_path: Path) -> None:
    run = write_run(tmp_path / "results", "sglang-colocate-cccc3333", "sglang", "colocate", mem=True)
    written = make_all(gather([run]), tmp_path / "plots")
    assert written["memory"].read_bytes()[:8] == PNG_MAGIC


def test_report_renders_md_and_html(study: list[Path], tmp_path: Path) -> None:
    results = tmp_path / "results"
    aggregate_main(study, results / "steps.csv", results / "steps.parquet")
    report_main(results / "steps.parquet", results / "report.md", results / "report.html", results / "plots",
                "Smoke study")
    md = (results / "report.md").read_text()
    html = (results / "report.html").read_text()
    for text in (md, html):
        assert "Smoke study" in text
        assert "Warm-up (step 1)" in text
        assert "Ratios against" in text
        assert "vllm-split-aaaa1111" in text and "vllm-restart-bbbb2222" in text
        assert "8/8 ok" in text  # canary held on every step
    assert "![Throughput per step](plots/throughput.png)" in md
    assert '<img src="plots/step_breakdown.png"' in html
    assert "<style>" in html and "http" not in html.split("<body>")[0]  # self-contained, no remote CSS
    # the comparison table carries median [lo, hi] with n = 7 steady-state steps
    comparison = md.split("## Comparison")[1].split("###")[0]
    assert "| 7 |" in comparison and "[" in comparison
    # step 1's throughput is shown in the warm-up table but is not any configuration's median
    warm = md.split("## Warm-up (step 1)")[1].split("## Correctness")[0]
    assert f"{WARMUP_THROUGHPUT:.2f}" in warm


def test_report_flags_failed_checks_and_missing_provenance(study: list[Path], tmp_path: Path) -> None:
    df = gather(study)
    df.loc[df["step"] == 4, "check/base_canary_ok"] = False
    table = tmp_path / "results" / "steps.parquet"
    df.to_parquet(table, index=False)
    (study[1] / "provenance.json").unlink()
    out = tmp_path / "elsewhere"
    report_main(table, out / "r.md", out / "r.html", tmp_path / "results" / "plots", "t")
    html = (out / "r.html").read_text()
    assert '<td class="fail">7/8 ok (failed at step 4)</td>' in html
    assert "No provenance.json recorded" in html
    assert '<img src="../results/plots/throughput.png"' in html  # relative to the html file
