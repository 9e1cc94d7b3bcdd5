"""Aggregation, statistics, plots and the rendered report, on synthetic steps.jsonl runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

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
from hybridrl.run import provenance
from hybridrl.study.run_config import RunConfig

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
        "train/kl": 0.0, "train/clipfrac": 0.0, "train/entropy": 1.0 - 0.02 * step,
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
                     provenance.collect(RunConfig(model="tiny", engine=engine, placement=placement),
                                        {"flags": ["--x", "1"]}))
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


def test_the_bootstraps_row_medians_are_numpys_nanmedian_to_the_bit() -> None:
    from hybridrl.report.stats import _row_medians

    rng = np.random.default_rng(3)
    for width in (1, 2, 7, 16):  # odd and even counts of values a row keeps
        values = rng.lognormal(size=(200, width)) * 1e3
        values[rng.random(values.shape) < 0.4] = np.nan  # drawn runs shorter than the longest
        values[:, 0] = rng.lognormal(size=200)  # every row keeps one value at least
        assert np.array_equal(_row_medians(values), np.nanmedian(values, axis=1))


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
    assert (table["n"] == 6).all()  # 8 steps; step 1 (base model) and step 2 (first adapter) left out
    assert (table["ci_lo"] > 50).all()  # the slow first step would drag the interval down
    assert WARMUP_THROUGHPUT not in steady_state(df)["perf/throughput"].to_numpy()


def test_steps_without_applied_adapter_do_not_count(study: list[Path]) -> None:
    df = gather(study)
    df.loc[(df["run_id"] == "vllm-split-aaaa1111") & (df["step"] == 3), "check/adapter_applied"] = False
    n = summarise(df, ["perf/throughput"]).set_index("config_id")["n"]
    assert n["vllm-split-aaaa1111"] == 5 and n["vllm-restart-bbbb2222"] == 6


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


def test_a_table_that_aggregate_did_not_write_is_refused_by_name_before_any_report(tmp_path: Path) -> None:
    from hybridrl.cli import main

    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "other.csv").write_text("x,y\n1,2\n")
    (tmp_path / "header.csv").write_text(",".join(KNOWN) + "\n")
    (tmp_path / "steps.txt").write_text("run_id\n")
    (tmp_path / "empty.parquet").write_bytes(b"")
    said = {"empty.csv": "empty file, not a table of steps",
            "other.csv": "not a table of steps: no column run_id, engine, placement, trainer, model, tp, seed, step",
            "header.csv": "holds no steps: no run recorded one",
            "steps.txt": "expected a .parquet or .csv table of steps",
            "empty.parquet": "not a readable parquet table"}
    for name, why in said.items():
        with pytest.raises(RuntimeError, match=why):
            read_table(tmp_path / name)
        md = tmp_path / f"{name}.md"
        assert main(["report", "--table", str(tmp_path / name), "--md", str(md), "--html", str(tmp_path / "r.html"),
                     "--plots", str(tmp_path / "plots")]) == 1
        assert not md.exists()  # no report of nothing


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
    # no memory data on CPU
    assert set(written) == {"throughput", "step_breakdown", "latency", "reward", "timeline", "mismatch"}
    for path in written.values():
        assert path.read_bytes()[:8] == PNG_MAGIC
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 200 and width > 300


def _drawn(df: pd.DataFrame, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple]:
    """Every plot of the table, each as (its figure, its PNG's width and height)."""
    from PIL import Image

    from hybridrl.report import plots

    seen, save = {}, plots._save

    def keep(fig, path: Path) -> Path:
        written = save(fig, path)
        seen[Path(path).stem] = (fig, Image.open(written).size)
        return written

    monkeypatch.setattr(plots, "_save", keep)
    plots.make_all(df, out)
    return seen


def test_every_plot_is_legible_at_the_reports_width(study: list[Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No text smaller than 10 px on screen once report.html's column scales the PNG to its width."""
    from test_report_placements import _study as placement_study

    from hybridrl.report.plots import MIN_TEXT_PX, PAGE_PX, text_px_on_page

    placed = placement_study(overlap_s=6.0, split_s=8.0).assign(**{
        "gpu/power_w_gen": 500.0, "host/busiest_thread_cpu_pct_gen": 90.0})
    placed["eval/accuracy"] = np.where(placed["step"] % 2 == 0, 0.1 * placed["step"], np.nan)
    drawn = {**_drawn(placed, tmp_path / "placed", monkeypatch), **_drawn(gather(study), tmp_path / "cpu", monkeypatch)}
    assert set(drawn) == {"throughput", "step_breakdown", "latency", "reward", "learning", "memory", "mismatch",
                          "placements", "timeline", "machine"}
    for name, (fig, (width, _)) in drawn.items():
        assert width <= PAGE_PX, name
        assert text_px_on_page(fig, width) >= MIN_TEXT_PX, name


def test_the_reward_plots_five_panels_stand_in_a_grid_not_a_row(study: list[Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridrl.report.plots import REWARD, text_px_on_page

    df = gather(study).assign(**{"response/stop_ratio": 1.0})
    fig, (width, height) = _drawn(df, tmp_path, monkeypatch)["reward"]
    panels = [ax for ax in fig.axes if ax.has_data()]
    assert len(panels) == len(REWARD) == 5
    assert len({ax.get_subplotspec().rowspan.start for ax in panels}) == 3  # two to a row
    assert height > 0.8 * width  # the row of five was 2817 x 452
    # the rule the layout keeps: the row of five, at the same size of text, would be shown at 6 px
    assert text_px_on_page(fig, 2817) < 7


def test_steps_hours_apart_fall_into_separate_sittings() -> None:
    from hybridrl.report.plots import sittings

    start = pd.Series([0.0, 5.0, 30.0, 10_000.0, 10_020.0, 40.0])
    stop = pd.Series([20.0, 25.0, 50.0, 10_015.0, 10_040.0, 700.0])  # the last step ran long
    assert sittings(start, stop).tolist() == [0, 0, 0, 1, 1, 0]
    assert sittings(start, stop, gap_s=1e6).tolist() == [0] * 6


def test_timeline_says_where_a_sitting_lacks_host_cpu_load() -> None:
    from hybridrl.report.plots import timeline_figure

    same = {"placement": "colocate", "trainer": "megatron", "model": "m", "tp": 2}
    rows = [{"run_id": "old-run", "engine": "sglang", **same, "step": s,
             "time_unix": 1000.0 + 30 * s, "timing_s/step": 30.0, "perf/throughput": 7000.0}
            for s in (1, 2)]  # recorded before host CPU load was
    rows += [{"run_id": "new-run", "engine": "vllm", **same, "step": s,
              "time_unix": 90_000.0 + 30 * s, "timing_s/step": 30.0, "perf/throughput": 7200.0,
              "host/cpu_busy_pct_gen": 14.0} for s in (1, 2)]
    fig = timeline_figure(pd.DataFrame(rows))
    axes = fig.axes
    texts = [[t.get_text() for t in ax.texts] for ax in axes]
    # panels row by row: throughput (old, new), CPU load (old, new)
    assert texts == [[], [], ["not recorded in this sitting"], []]
    assert len(axes[3].collections) == 1  # the new run's bars are drawn


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
        assert "Warm-up (steps 1–2, each apart)" in text
        assert "Ratios against" in text
        assert "vllm-split-aaaa1111" in text and "vllm-restart-bbbb2222" in text
        assert "8/8 ok" in text  # canary held on every step
        # the policy's entropy fell every step: the learning trends say so from the interval
        assert "Learning over steps" in text and "0.98 → 0.84; falls -0.02 a step" in text
    assert "![Throughput per step](plots/throughput.png)" in md
    assert '<img src="plots/step_breakdown.png"' in html
    assert "<style>" in html and "http" not in html.split("<body>")[0]  # self-contained, no remote CSS
    # the comparison table carries median [lo, hi] with n = 6 steady-state steps of one run
    comparison = md.split("## Comparison")[1].split("###")[0]
    assert "| n runs | 1 | 1 |" in comparison and "| 6 |" in comparison and "[" in comparison
    # step 1's throughput is shown in the warm-up table but is not any configuration's median
    warm = md.split("## Warm-up (steps 1–2, each apart)")[1].split("\n## ")[0]
    assert f"{WARMUP_THROUGHPUT:.2f}" in warm
    # steps 1 and 2 of each run have rows of their own
    assert [line.split("|")[2].strip() for line in warm.splitlines() if line.startswith("| split")] == ["1", "2"]


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


# -- headline table in the write-up's format (issue 6) -------------------------------------------------

def headline_run(run_id: str, engine: str, placement: str = "colocate", trainer: str = "megatron",
                 speed: float = 1.0, seed: int = 0, steps: int = 10) -> pd.DataFrame:
    """A run's steps: throughput 250*speed tok/s, mean ITL and p99 latency 1/speed, startup 60/speed s."""
    rng = np.random.default_rng(seed + len(run_id))
    recs = []
    for step in range(1, steps + 1):
        rec = record(run_id, engine, placement, step, rng, speed, mem=True)
        rec.update({"trainer": trainer, "perf/itl_ms_mean": 20.0 / speed + rng.normal(0, 0.3),
                    "perf/latency_s_p99": 7.0 / speed + rng.normal(0, 0.1), "mem/peak_gb": 60.0 / speed,
                    "timing_s/engine_start": 60.0 / speed if step == 1 else None})
        recs.append(rec)
    return pd.DataFrame.from_records(recs)


def headline_study(*runs: pd.DataFrame) -> pd.DataFrame:
    from hybridrl.report.aggregate import normalise

    return normalise(pd.concat(runs, ignore_index=True))


def test_headline_ratios_point_sglang_ahead_with_intervals() -> None:
    from hybridrl.report.headline import headlines

    df = headline_study(headline_run("sglang-colocate-aaaa", "sglang", speed=2.0),
                        headline_run("vllm-colocate-bbbb", "vllm"))
    [h] = headlines(df)
    assert (h.placement, h.vllm_engine, h.sglang_run, h.vllm_run) == (
        "colocate", "vllm", "sglang-colocate-aaaa", "vllm-colocate-bbbb")
    rows = {r.metric.name: r for r in h.rows}
    assert list(rows) == ["Rollout throughput", "ITL, mean", "TTFT p50", "p99 latency", "Peak GPU memory",
                          "Tokens/s per GPU, checks excluded", "Engine startup"]  # GPU-hours: no rollouts per step
    tput = rows["Rollout throughput"]
    assert tput.column == "perf/throughput" and tput.metric.claimed == "3.9x"
    assert tput.est.value == pytest.approx(tput.sglang / tput.vllm)  # SGLang / vLLM
    assert tput.est.lo < tput.est.value < tput.est.hi and tput.est.contains(2.0)
    assert (tput.n_sglang, tput.n_vllm) == (8, 8)  # steps 1 and 2 are warm-up
    itl = rows["ITL, mean"]
    assert itl.est.value == pytest.approx(itl.vllm / itl.sglang) and itl.est.contains(2.0)  # > 1: SGLang faster
    p99 = rows["p99 latency"]
    assert p99.est.value == pytest.approx(100 * (p99.sglang / p99.vllm - 1))
    assert p99.est.lo < p99.est.value < p99.est.hi < 0 and p99.est.contains(-50.0)  # SGLang half the latency
    assert rows["Peak GPU memory"].est.value == pytest.approx(-50.0)
    start = rows["Engine startup"]
    assert start.est.value == pytest.approx(2.0) and start.est.n == 1 and math.isnan(start.est.lo)


def test_headline_table_shows_the_engine_starts_parts_under_its_row_as_each_sides_median() -> None:
    from hybridrl.report.comparisons import headline_tables

    runs = [headline_run("sglang-colocate-aaaaaaaa", "sglang", speed=2.0),
            headline_run("sglang-colocate-aaaaaaaa-r2", "sglang", speed=2.0, seed=1),
            headline_run("vllm-colocate-bbbbbbbb", "vllm")]
    for i, run in enumerate(runs):  # weights 10 s and 20 s for SGLang's two runs; vLLM's log had no KV line
        run.loc[0, ["timing_s/engine_start_weights", "timing_s/engine_start_unexplained"]] = [10.0 * (i + 1), 5.0]
        run.loc[0, "timing_s/engine_start_kv"] = 1.0 if i < 2 else None
    [table] = [h["table"] for h in headline_tables(headline_study(*runs))]
    names = [row[0].text for row in table.rows]
    at = names.index("Engine startup (vLLM / SGLang)")
    assert names[at + 1:] == ["… weight load", "… KV cache", "… unexplained (no log line)"]  # none recorded the rest
    weights, kv = table.rows[at + 1], table.rows[at + 2]
    assert (weights[2].text, weights[3].text, weights[-1].text) == ("15.00 s", "30.00 s", "2 / 1 runs")
    assert (kv[3].text, kv[-1].text) == ("–", "2 / 0 runs")
    without = headline_tables(headline_study(headline_run("sglang-colocate-aaaa", "sglang"),
                                             headline_run("vllm-colocate-bbbb", "vllm")))
    assert without[0]["table"].rows[-1][0].text == "Engine startup (vLLM / SGLang)"  # runs recorded before the split


def test_headline_leaves_out_missing_metrics() -> None:
    from hybridrl.report.headline import headlines

    df = headline_study(headline_run("sglang-split-aaaa", "sglang", "split"),
                        headline_run("vllm-split-bbbb", "vllm", "split"))
    df = df.drop(columns=["perf/itl_ms_mean", "timing_s/engine_start"])
    df["mem/peak_gb"] = np.nan  # a CPU run: no NVML
    [h] = headlines(df)
    assert [r.metric.name for r in h.rows] == ["Rollout throughput", "TTFT p50", "p99 latency",
                                               "Tokens/s per GPU, checks excluded"]
    from hybridrl.report.headline import METRICS

    gone = {c for m in METRICS for c in m.columns} & set(df.columns)
    assert headlines(df.drop(columns=sorted(gone))) == []


def test_headline_pairs_only_runs_with_same_trainer_and_labels_several() -> None:
    from hybridrl.report.headline import headlines

    sglang = headline_run("sglang-colocate-aaaa", "sglang", trainer="hf")
    other_trainer = headline_run("vllm-colocate-bbbb", "vllm", trainer="megatron")
    other_placement = headline_run("vllm-split-eeee", "vllm", "split", trainer="hf")
    assert headlines(headline_study(sglang, other_trainer, other_placement)) == []
    inproc = [headline_run(f"vllm-inprocess-colocate-{h}", "vllm-inprocess", trainer="hf") for h in ("cccc", "dddd")]
    found = headlines(headline_study(sglang, other_trainer, *inproc))
    assert [(h.vllm_engine, h.vllm_run) for h in found] == [("vllm-inprocess", r["run_id"][0]) for r in inproc]
    assert [h.title for h in found] == ["colocate: SGLang vs vLLM in-process (aaaa vs cccc)",
                                        "colocate: SGLang vs vLLM in-process (aaaa vs dddd)"]


def test_report_shows_headline_with_claims(tmp_path: Path) -> None:
    results = tmp_path / "results"
    df = headline_study(headline_run("sglang-colocate-aaaa", "sglang", speed=2.0),
                        headline_run("vllm-colocate-bbbb", "vllm"))
    df.to_parquet(tmp_path / "steps.parquet", index=False)
    report_main(tmp_path / "steps.parquet", results / "report.md", results / "report.html", results / "plots", "t")
    md = (results / "report.md").read_text()
    section = md.split("## Headline")[1].split("## Comparison")[0]
    assert "### colocate: SGLang vs vLLM server" in section
    assert "| Rollout throughput (SGLang / vLLM) | 3.9x |" in section
    assert "| Engine startup (vLLM / SGLang) | 3.4x |" in section and "n/a (n=1)" in section
    assert "| -50% |" in section  # peak memory halved
    assert "trainer megatron, model tiny, tp 1, seed 0" in section
    assert "<h2>Headline: SGLang vs vLLM" in (results / "report.html").read_text()


def test_aggregate_records_each_runs_commit_and_gpu(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, "vllm-split-cccc3333", "vllm", "split", steps=2)
    prov = json.loads((run_dir / "provenance.json").read_text())
    prov["git"] = {"commit": "f095935ace4e53eda7574c565f41b580f6b33f27-dirty", "dirty": None}
    prov["gpu"] = {"devices": [{"index": 0, "name": "NVIDIA H200"}, {"index": 1, "name": "NVIDIA H200"}]}
    prov["run_config"]["gpu_memory_utilization"] = 0.35  # not the default: read from the provenance
    (run_dir / "provenance.json").write_text(json.dumps(prov))
    df = gather([run_dir])
    assert set(df["git_commit"]) == {"f095935-dirty"} and set(df["gpu"]) == {"NVIDIA H200"}
    assert set(df["gpu_memory_utilization"]) == {0.35}
    (run_dir / "provenance.json").unlink()
    assert gather([run_dir])["git_commit"].isna().all()  # unknown, not guessed


def test_headline_says_what_peak_memory_compares() -> None:
    from hybridrl.report.headline import headlines

    sglang = headline_run("sglang-colocate-aaaa", "sglang").assign(gpu_memory_utilization=0.5)
    [same] = headlines(headline_study(sglang, headline_run("vllm-colocate-bbbb", "vllm").assign(
        gpu_memory_utilization=0.5)))
    assert same.caveats == ("both engines were given 0.5 of each GPU's memory, so peak GPU memory compares that "
                            "setting more than the engines",)
    [other] = headlines(headline_study(sglang, headline_run("vllm-colocate-bbbb", "vllm").assign(
        gpu_memory_utilization=0.9)))
    assert other.caveats == ("the engines were given different shares of each GPU's memory (0.5 SGLang, 0.9 "
                             "vLLM), which peak GPU memory follows",)


def test_headline_says_when_the_pair_ran_hours_apart_or_kept_weights_resident() -> None:
    from hybridrl.report.headline import headlines

    sglang = headline_run("sglang-colocate-aaaa", "sglang").assign(time_unix=1_795_348_323.0)
    vllm = headline_run("vllm-colocate-bbbb", "vllm").assign(time_unix=1_795_348_323.0 + 19 * 3600)
    [apart] = headlines(headline_study(sglang, vllm))
    assert apart.caveats == ("recorded 19 h apart (2026-11-22 11:52 UTC SGLang, 2026-11-23 06:52 UTC vLLM), "
                             "perhaps on different machines of the same kind",)
    [near] = headlines(headline_study(sglang, vllm.assign(time_unix=1_795_348_323.0 + 900)))
    assert near.caveats == ()  # one sitting: runs one after the other on one machine
    [resident] = headlines(headline_study(sglang.assign(sglang_release="kv_cache"),
                                          vllm.assign(time_unix=1_795_348_323.0, vllm_sleep_level=1)))
    assert resident.caveats == ("colocated, SGLang kept its weights on the GPU while the trainer ran (it released "
                                "only its KV cache) and vLLM slept at level 1, moving its weights to CPU memory: "
                                "peak GPU memory follows that setting",)
    # rollout only (trainer none): nothing trains beside the sleeping engine, so the caveat would mislead
    [rollout] = headlines(headline_study(
        headline_run("sglang-colocate-aaaa", "sglang", trainer="none").assign(sglang_release="kv_cache"),
        headline_run("vllm-colocate-bbbb", "vllm", trainer="none").assign(vllm_sleep_level=1)))
    assert not any("while the trainer ran" in c for c in rollout.caveats)
    split = [h for h in headlines(headline_study(
        headline_run("sglang-split-aaaa", "sglang", "split").assign(sglang_release="kv_cache"),
        headline_run("vllm-split-bbbb", "vllm", "split")))]
    assert split[0].caveats == ()  # nothing sleeps in split


def test_headline_says_when_the_pair_ran_different_code(tmp_path: Path) -> None:
    from hybridrl.report.headline import headlines

    sglang = headline_run("sglang-colocate-aaaa", "sglang").assign(git_commit="f095935", gpu="NVIDIA H200")
    vllm = headline_run("vllm-colocate-bbbb", "vllm").assign(git_commit="90e50ca", gpu="NVIDIA H200")
    [h] = headlines(headline_study(sglang, vllm))
    assert h.caveats == ("recorded by different code versions: f095935 (SGLang) vs 90e50ca",)
    [same] = headlines(headline_study(sglang, vllm.assign(git_commit="f095935")))
    assert same.caveats == ()
    df = headline_study(sglang, vllm)
    df.to_parquet(tmp_path / "steps.parquet", index=False)
    out = tmp_path / "out"
    report_main(tmp_path / "steps.parquet", out / "report.md", out / "report.html", out / "plots", "t")
    md = (out / "report.md").read_text()
    assert "\n\n- **Caveat:** recorded by different code versions: f095935 (SGLang) vs 90e50ca.\n" in md
    assert "| code | f095935 | 90e50ca |" in md


def test_report_flags_rollouts_near_the_client_ceiling(study: list[Path], tmp_path: Path) -> None:
    from hybridrl.engines.client_ceiling import client_headroom_ok

    df = gather(study)
    first = df["run_id"] == "vllm-split-aaaa1111"
    df.loc[first, "perf/client_ceiling_tok_s"] = 300.0  # its rollouts run at ~250 tok/s: above 80% of it
    df.loc[first, "check/client_headroom_ok"] = [client_headroom_ok(t, 300.0)
                                                 for t in df.loc[first, "perf/throughput"]]
    df.loc[first, "host/controller_cpu_pct_gen"] = 97.0
    table = tmp_path / "steps.parquet"
    df.to_parquet(table, index=False)
    report_main(table, tmp_path / "r.md", tmp_path / "r.html", tmp_path / "plots", "t")
    client = (tmp_path / "r.md").read_text().split("## Rollout client")[1].split("## Plots")[0]
    split_row = next(line for line in client.splitlines() if line.startswith("| split |"))
    assert "1/8 ok (failed at step 2, 3, 4, 5, 6, …)" in split_row  # only the slow warm-up step is clear of it
    assert "| 97.00 |" in split_row and "| 87% |" in split_row  # the fastest rollout against the ceiling
    restart_row = next(line for line in client.splitlines() if line.startswith("| restart |"))
    assert "not measured" in restart_row and "all (before 2026-11-23)" in restart_row


def test_slope_interval_calls_growth_only_where_it_excludes_zero() -> None:
    from hybridrl.report.trend import bootstrap_slope, trend_words

    steps = np.arange(1, 21)
    growing = bootstrap_slope(steps, 1.5 + 0.2 * steps + np.random.default_rng(0).normal(0, 0.05, 20))
    assert growing.value == pytest.approx(0.2, abs=0.01) and growing.lo > 0
    assert trend_words(growing, "GB").startswith("grows +0.199 GB a step [+0.195, +0.201]")
    flat = bootstrap_slope(steps, 1.5 + np.random.default_rng(1).normal(0, 0.05, 20))
    assert flat.contains(0.0) and trend_words(flat, "GB").startswith("no trend shown")
    assert trend_words(bootstrap_slope([1, 2], [1.0, 2.0]), "GB") == "too few readings for a trend (n = 2)"
    assert bootstrap_slope([1, 1, 1], [1.0, 2.0, 3.0]).n == 3  # no spread in steps: no slope, no crash


def test_report_shows_engine_memory_across_sleeps(study: list[Path], tmp_path: Path) -> None:
    df = gather(study)
    first = (df["run_id"] == "vllm-split-aaaa1111").to_numpy()
    df.loc[first, "mem/engine_asleep_gb"] = 1.6 + 0.5 * df.loc[first, "step"]  # a leak of 0.5 GB a cycle
    df.loc[first, "mem/engine_awake_gb"] = 70.0
    df.loc[first, "check/asleep_memory_ok"] = df.loc[first, "step"] < 4
    table = tmp_path / "steps.parquet"
    df.to_parquet(table, index=False)
    report_main(table, tmp_path / "r.md", tmp_path / "r.html", tmp_path / "plots", "t")
    section = (tmp_path / "r.md").read_text().split("## Engine memory across sleep and wake")[1].split("## ")[0]
    row = next(line for line in section.splitlines() if line.startswith("| split |"))
    assert "| 8 |" in row and "2.10 / 3.10 / 5.60" in row and "grows +0.5 GB a step" in row
    assert "3/8 ok (failed at step 4, 5, 6, 7, 8)" in row
    assert "restart" not in section  # a run whose engine never slept has no row
    assert "the engine's own asleep GB" not in section  # no run read it: no column
    df.loc[first, "mem/engine_asleep_own_gb"] = 1.0 + 0.1 * df.loc[first, "step"]
    df.to_parquet(table, index=False)
    report_main(table, tmp_path / "r.md", tmp_path / "r.html", tmp_path / "plots", "t")
    section = (tmp_path / "r.md").read_text().split("## Engine memory across sleep and wake")[1].split("## ")[0]
    assert "the engine's own asleep GB (trainer left out): first / last" in section
    row = next(line for line in section.splitlines() if line.startswith("| split |"))
    assert "| 2.10 / 3.10 / 5.60 | 1.10 / 1.80 |" in row
    # a study where no engine slept has no such section
    plain = gather(study)
    plain.to_parquet(tmp_path / "plain.parquet", index=False)
    report_main(tmp_path / "plain.parquet", tmp_path / "p.md", tmp_path / "p.html", tmp_path / "plots", "t")
    assert "Engine memory across sleep and wake" not in (tmp_path / "p.md").read_text()
    assert not (tmp_path / "plots" / "sleep_memory.png").exists()  # no engine slept: no plot, none left over


def test_report_holds_each_wake_to_the_memory_its_engine_started_with(study: list[Path], tmp_path: Path) -> None:
    df = gather(study)
    first = (df["run_id"] == "vllm-split-aaaa1111").to_numpy()
    steps = df.loc[first, "step"]
    df.loc[first, "mem/engine_asleep_gb"] = 1.6
    df.loc[first, "mem/engine_started_gb"] = np.where(steps == 1, 70.0, np.nan)
    df.loc[first, "mem/engine_awake_gb"] = np.where(steps < 5, 70.0, 17.0)  # 53 GB short from step 5 on
    df.loc[first, "check/awake_shortfall_gb"] = 70.0 - df.loc[first, "mem/engine_awake_gb"]
    df.loc[first, "check/awake_memory_ok"] = steps < 5
    df.to_parquet(tmp_path / "steps.parquet", index=False)
    report_main(tmp_path / "steps.parquet", tmp_path / "r.md", tmp_path / "r.html", tmp_path / "plots", "t")
    section = (tmp_path / "r.md").read_text().split("## Engine memory across sleep and wake")[1].split("## ")[0]
    assert "awake GB: at start / first wake / last" in section and "awake memory gate" in section
    row = next(line for line in section.splitlines() if line.startswith("| split |"))
    assert "70.00 / 70.00 / 17.00" in row and "4/8 ok (failed at step 5, 6, 7, 8); 53.00 GB short at most" in row


def test_memory_trend_leaves_warm_up_out(study: list[Path], tmp_path: Path) -> None:
    """A one-off rise in warm-up (caches and pools filling) then flat memory is no growth; as on the H200 soak
    runs, whose slope over all steps read as growth only because of warm-up's rise."""
    df = gather(study)
    first = (df["run_id"] == "vllm-split-aaaa1111").to_numpy()
    steps = df.loc[first, "step"]
    df.loc[first, "mem/engine_asleep_gb"] = np.where(steps <= 2, 2.5 + 0.4 * (steps - 1), 2.9)
    table = tmp_path / "steps.parquet"
    df.to_parquet(table, index=False)
    report_main(table, tmp_path / "r.md", tmp_path / "r.html", tmp_path / "plots", "t")
    section = (tmp_path / "r.md").read_text().split("## Engine memory across sleep and wake")[1].split("## ")[0]
    row = next(line for line in section.splitlines() if line.startswith("| split |"))
    assert "2.50 / 2.90 / 2.90" in row and "grows" not in row and "no trend shown" in row
    assert (tmp_path / "plots" / "sleep_memory.png").read_bytes()[:8] == PNG_MAGIC
    assert "![Engine GPU memory across sleep and wake](plots/sleep_memory.png)" in (tmp_path / "r.md").read_text()


def test_a_commit_that_looks_like_a_number_stays_text_in_the_csv(study: list[Path], tmp_path: Path) -> None:
    from hybridrl.report.aggregate import write_table

    df = gather(study)
    df["git_commit"] = "33439e1"  # a short sha that pandas would read as 3.3439e5
    write_table(df, tmp_path / "steps.csv", tmp_path / "steps.parquet")
    assert set(read_table(tmp_path / "steps.csv")["git_commit"]) == {"33439e1"}


def test_report_shows_the_logprob_gap_floor_tiers_and_drift(study: list[Path], tmp_path: Path) -> None:
    df = gather(study)
    first = (df["run_id"] == "vllm-split-aaaa1111").to_numpy()
    df.loc[first, "check/rollout_logprob_abs_diff"] = 0.004 + 0.003 * (df.loc[first, "step"] - 1)  # drifts up
    df.loc[first, "check/logprob_gap_tier"] = ["pass"] * 6 + ["warn"] * 2
    table = tmp_path / "steps.parquet"
    df.to_parquet(table, index=False)
    report_main(table, tmp_path / "r.md", tmp_path / "r.html", tmp_path / "plots", "t")
    md = (tmp_path / "r.md").read_text()
    section = md.split("### The trainer-vs-engine logprob gap")[1].split("## ")[0]
    assert "default 0.02 dense, 0.05 moe" in section and "default 0.1; the run stops" in section
    split = next(line for line in section.splitlines() if line.startswith("| split |"))
    assert "| 0.00400 |" in split and "6 pass, 2 warn" in split and "grows +0.003 a step" in split
    restart = next(line for line in section.splitlines() if line.startswith("| restart |"))
    assert "not tiered (recorded before the tiers)" in restart and "no trend shown" in restart
def test_stale_steps_gaps_read_not_judged_and_stay_out_of_the_median_drift_and_tiers(study: list[Path],
                                                                                     tmp_path: Path) -> None:
    df = gather(study)
    ahead = ((df["run_id"] == "vllm-split-aaaa1111") & (df["step"] > 1)).to_numpy()  # rolled out one step ahead
    df["rollout/staleness"] = np.where(ahead, 1, 0)
    df["check/rollout_logprob_abs_diff"] = np.where(ahead, 0.12, 0.004)  # above the fail tier, by design
    df["check/logprob_gap_tier"] = np.where(ahead, None, "pass")
    table = tmp_path / "steps.parquet"
    df.to_parquet(table, index=False)
    report_main(table, tmp_path / "r.md", tmp_path / "r.html", tmp_path / "plots", "t")
    md = (tmp_path / "r.md").read_text()
    correctness = md.split("## Correctness")[1].split("### ")[0]
    split = next(line for line in correctness.splitlines() if line.startswith("| split |"))
    assert "| 0.00400 [n/a] | 0.00400; 0.120 not judged (stale) |" in split, split
    gap = md.split("### The trainer-vs-engine logprob gap")[1].split("## ")[0]
    split = next(line for line in gap.splitlines() if line.startswith("| split |"))
    assert split.startswith("| split | 0.00400 | – | 0.00400; 0.120 not judged (stale) | "
                            "1 pass, 7 not judged (stale) | too few readings"), split
    restart = next(line for line in gap.splitlines() if line.startswith("| restart |"))
    assert "stale" not in restart and "| 0.00400 [0.00400, 0.00400] | 0.00400 | 8 pass |" in restart, restart
    detail = next(line for line in md.splitlines() if line.startswith("| check/rollout_logprob_abs_diff |"))
    assert detail.count("not judged (stale)") == 1, detail


def test_the_chance_line_counts_only_intervals_that_exist(tmp_path: Path) -> None:
    from hybridrl.report.comparisons import ratio_table
    from hybridrl.report.plots import config_labels

    def md_of(steps: int) -> tuple[str, int]:
        results = tmp_path / f"s{steps}"
        runs = [write_run(results, "vllm-split-aaaa1111", "vllm", "split", steps=steps, seed=1),
                write_run(results, "vllm-restart-bbbb2222", "vllm", "restart", steps=steps, speed=0.5, seed=2)]
        df = gather(runs)
        table = results / "steps.parquet"
        df.to_parquet(table, index=False)
        report_main(table, results / "r.md", results / "r.html", results / "plots", "t")
        _, ratios = ratio_table(df, config_labels(df))
        return (results / "r.md").read_text(), ratios.intervals

    # one steady step a run: every ratio is shown, none has an interval, and none can exclude 1 by chance
    md, intervals = md_of(3)
    assert intervals == 0 and "[n/a]" in md.split("### Ratios against")[1]
    assert "- No comparisons with intervals were made." in md and "by chance" not in md
    md, intervals = md_of(8)
    assert intervals > 0 and "[n/a]" not in md.split("### Ratios against")[1]
    assert f"- {intervals} comparisons with 95% intervals: " in md


def test_an_engine_that_stays_awake_is_its_own_arm_and_pairs_only_with_another_awake_one() -> None:
    from hybridrl.report.headline import headlines
    from hybridrl.report.placements import arm_label
    from hybridrl.report.plots import config_labels

    runs = {rid: headline_run(rid, engine) for rid, engine in (
        ("sglang-colocate-aaaa1111", "sglang"), ("vllm-colocate-bbbb2222", "vllm"),
        ("sglang-colocate-cccc3333", "sglang"), ("vllm-colocate-dddd4444", "vllm"))}
    for rid, run in runs.items():
        run["sglang_release"], run["vllm_sleep_level"] = ("all", None) if "sglang" in rid else (None, 1)
        run["sglang_retain_cpu_backup"] = True
        # the second pair never slept; the first was recorded before the key (NaN: it slept)
        run["engine_sleep"] = False if rid.split("-")[2][:4] in ("cccc", "dddd") else None
    df = headline_study(*runs.values())
    arms = df.drop_duplicates("config_id").set_index("config_id")["release"].to_dict()
    assert arms == {"sglang-colocate-aaaa1111": "full release", "vllm-colocate-bbbb2222": "level 1",
                    "sglang-colocate-cccc3333": "stays awake", "vllm-colocate-dddd4444": "stays awake"}
    pairs = {(h.sglang_run, h.vllm_run): h.release for h in headlines(df)}
    assert pairs == {("sglang-colocate-aaaa1111", "vllm-colocate-bbbb2222"): "full release",
                     ("sglang-colocate-cccc3333", "vllm-colocate-dddd4444"): "stays awake"}
    # the title names the vLLM side awake too, not only SGLang's (a reader took it for vLLM at level 1)
    assert sorted(h.title for h in headlines(df)) == [
        "colocate: SGLang (full release) vs vLLM server",
        "colocate: SGLang (stays awake) vs vLLM server (stays awake)"]
    assert "stays awake" in config_labels(df)["sglang-colocate-cccc3333"]
    first = df.drop_duplicates("config_id").set_index("config_id")
    assert [arm_label(first.loc[c]) for c in ("sglang-colocate-aaaa1111", "sglang-colocate-cccc3333")] == [
        "colocate", "colocate, engine awake"]


def test_in_process_vllm_without_text_is_labelled_apart_from_its_twin_with_text() -> None:
    from hybridrl.report.plots import config_labels

    runs = [headline_run(rid, "vllm-inprocess") for rid in ("vllm-colocate-aaaa1111", "vllm-colocate-bbbb2222")]
    for run, detok in zip(runs, (None, False), strict=True):  # the first recorded before the key: it made text
        run["engine_sleep"], run["vllm_detokenize"] = False, detok
    assert config_labels(headline_study(*runs)) == {
        "vllm-colocate-aaaa1111": "vllm-inprocess · stays awake",
        "vllm-colocate-bbbb2222": "vllm-inprocess · stays awake · token ids only"}


def test_sglang_without_text_reads_as_token_ids_only_as_vllm_does() -> None:
    from hybridrl.report.plots import config_labels

    runs = [headline_run("sglang-colocate-aaaa1111", "sglang"), headline_run("sglang-colocate-bbbb2222", "sglang"),
            headline_run("vllm-colocate-cccc3333", "vllm-inprocess")]
    for run, sglang_text, vllm_text in zip(runs, (True, False, None), (None, None, False), strict=True):
        run["engine_sleep"], run["sglang_detokenize"], run["vllm_detokenize"] = False, sglang_text, vllm_text
    assert config_labels(headline_study(*runs)) == {
        "sglang-colocate-aaaa1111": "sglang",  # all awake: only what differs is named
        "sglang-colocate-bbbb2222": "sglang · token ids only",
        "vllm-colocate-cccc3333": "vllm-inprocess · token ids only"}


def test_an_arm_that_keeps_its_connections_is_labelled_apart_from_its_twin() -> None:
    from hybridrl.report.plots import config_labels

    runs = [headline_run(rid, "sglang") for rid in ("sglang-colocate-aaaa1111", "sglang-colocate-bbbb2222")]
    for run, kept in zip(runs, (None, True), strict=True):  # the first recorded before the key: it reconnected
        run["engine_sleep"], run["sglang_detokenize"], run["keep_connections"] = False, False, kept
    assert config_labels(headline_study(*runs)) == {
        "sglang-colocate-aaaa1111": "sglang · stays awake",  # both make no text: only what differs is named
        "sglang-colocate-bbbb2222": "sglang · stays awake · connections kept"}


def test_an_arm_that_freezes_the_controllers_heap_is_labelled_apart_from_its_twin() -> None:
    from hybridrl.report.plots import config_labels

    runs = [headline_run(rid, "sglang") for rid in ("sglang-colocate-aaaa1111", "sglang-colocate-bbbb2222")]
    for run, frozen in zip(runs, (None, True), strict=True):  # the first recorded before the key
        run["engine_sleep"], run["keep_connections"], run["gc_freeze"] = False, True, frozen
    assert config_labels(headline_study(*runs)) == {
        "sglang-colocate-aaaa1111": "sglang · stays awake",
        "sglang-colocate-bbbb2222": "sglang · stays awake · heap frozen"}


def test_transition_times_are_compared_only_between_releases_that_move_the_same_bytes() -> None:
    from hybridrl.report.comparisons import NO_VLLM_KV_ONLY, transitions
    from hybridrl.report.plots import run_labels

    frames = []
    # SGLang's full release twice: its CPU copy kept pinned (as vLLM's), and pinned anew every sleep (a run
    # recorded before the key existed: NaN)
    for rid, engine, release, level, retain in (("sglang-colocate-aaaa1111", "sglang", "kv_cache", None, None),
                                                ("sglang-colocate-cccc3333", "sglang", "all", None, True),
                                                ("sglang-colocate-dddd4444", "sglang", "all", None, None),
                                                ("vllm-colocate-bbbb2222", "vllm", None, 1, None)):
        run = headline_run(rid, engine)
        run["timing_s/sleep"], run["timing_s/wake"] = 0.5, 0.6
        run["sglang_release"], run["vllm_sleep_level"] = release, level
        run["sglang_retain_cpu_backup"] = retain
        frames.append(run)
    df = headline_study(*frames)
    labels = {c: lab for c, lab in zip(sorted(df["config_id"].unique()), [""] * 4, strict=True)}
    labels = {**labels, **run_labels(df)}
    found = transitions(df, labels)
    groups = {g["moves"]: [row[0].text for row in g["table"].rows] for g in found["groups"]}
    kv_only = groups.pop("KV cache only (weights stay on the GPU)")
    assert len(kv_only) == 1 and "kv-only" in kv_only[0]  # alone: no ratio against a weights-moving release
    [repinned] = groups.pop("weights and KV cache, pinning the CPU copy anew every sleep")
    assert "re-pinned" in repinned  # alone too: vLLM reuses its pinned buffers
    [both] = groups.values()
    assert sorted(both) == sorted(lab for lab in labels.values()
                                  if ("full release" in lab and "re-pinned" not in lab) or "level 1" in lab)
    assert found["note"] == NO_VLLM_KV_ONLY and found["n_comparisons"] == 2  # sleep and wake, full vs level 1


def test_a_pair_whose_sglang_pinned_its_cpu_copy_anew_every_sleep_says_so() -> None:
    from hybridrl.report.headline import headlines

    def pair(retain: bool | None) -> tuple[str, ...]:
        sglang, vllm = headline_run("sglang-colocate-aaaa1111", "sglang"), headline_run("vllm-colocate-bbbb", "vllm")
        sglang["sglang_release"], sglang["sglang_retain_cpu_backup"] = "all", retain
        vllm["vllm_sleep_level"] = 1
        [h] = headlines(headline_study(sglang, vllm))
        return h.caveats

    assert any("pinned its CPU copy of the weights anew" in n for n in pair(None))  # recorded before the key
    assert any("pinned its CPU copy of the weights anew" in n for n in pair(False))
    assert not any("pinned its CPU copy" in n for n in pair(True))


def test_every_phase_of_a_step_has_a_colour_in_the_breakdown() -> None:
    from hybridrl.report.plots import PHASE_COLORS
    from hybridrl.run.record import PHASE_KEYS

    assert set(PHASE_KEYS) <= set(PHASE_COLORS), sorted(set(PHASE_KEYS) - set(PHASE_COLORS))


# -- rollout client paths (issue 20) ---------------------------------------------------------------------

def client_run(run_id: str, engine: str, stream_fraction: float | None, shared_pool: bool | None,
               speed: float = 1.0) -> pd.DataFrame:
    run = headline_run(run_id, engine, trainer="hf", speed=speed)
    run["stream_fraction"], run["shared_pool"] = stream_fraction, shared_pool
    run["host/controller_cpu_pct_gen"] = 80.0 if shared_pool else 40.0
    return run


def test_rollout_client_names_the_path_and_older_runs_have_none() -> None:
    from hybridrl.report.aggregate import rollout_client

    assert rollout_client("sglang", 1.0, True) == "every request streamed, one shared pool"
    assert rollout_client("vllm", 0.125, False) == "0.125 streamed, a connection per slot"
    assert rollout_client("vllm", 0.0, "False") == "none streamed, a connection per slot"  # as CSV reads it
    assert rollout_client("vllm-inprocess", 1.0, False) == "every request streamed"  # no HTTP pool
    assert rollout_client("sglang", None, None) is None  # recorded before the choice existed
    # rollout_process: the client in a worker process is a path of its own; off (or not recorded): a thread
    assert rollout_client("vllm", 0.125, False, True) == "0.125 streamed, a connection per slot, in a worker process"
    assert rollout_client("vllm", 0.125, False, "False") == rollout_client("vllm", 0.125, False, float("nan"))
    # keep_connections: connections kept from one rollout to the next are a path of their own; the old shared pool
    # is made anew each rollout whatever the key says
    assert rollout_client("sglang", 0.125, False, False, True) == "0.125 streamed, a connection per slot, kept"
    assert rollout_client("sglang", 0.125, False, False, "False") == "0.125 streamed, a connection per slot"
    assert rollout_client("sglang", 1.0, True, False, True) == "every request streamed, one shared pool"


def test_a_run_through_the_worker_process_is_a_configuration_of_its_own_in_the_table(tmp_path) -> None:
    from hybridrl.report.aggregate import normalise

    thread = client_run("sglang-a-aaaa", "sglang", 0.125, False)
    worker = client_run("sglang-b-bbbb", "sglang", 0.125, False).assign(rollout_process=True)
    df = normalise(pd.concat([thread, worker], ignore_index=True))
    assert df.groupby("run_id")["client"].first().to_dict() == {
        "sglang-a-aaaa": "0.125 streamed, a connection per slot",
        "sglang-b-bbbb": "0.125 streamed, a connection per slot, in a worker process"}


def test_headline_never_pairs_engines_measured_through_different_clients() -> None:
    from hybridrl.report.headline import headlines

    df = headline_study(client_run("sglang-new-aaaa", "sglang", 0.125, False, speed=2.0),
                        client_run("sglang-old-bbbb", "sglang", 1.0, True),
                        client_run("vllm-new-cccc", "vllm", 0.125, False),
                        client_run("vllm-old-dddd", "vllm", 1.0, True))
    pairs = {(h.sglang_run, h.vllm_run) for h in headlines(df)}
    assert pairs == {("sglang-new-aaaa", "vllm-new-cccc"), ("sglang-old-bbbb", "vllm-old-dddd")}


def test_client_paths_compare_one_engine_through_two_clients_lighter_over_heavier() -> None:
    from hybridrl.report.client_paths import pairs
    from hybridrl.report.comparisons import client_paths_table
    from hybridrl.report.plots import run_labels

    df = headline_study(client_run("sglang-old-bbbb", "sglang", 1.0, True),
                        client_run("sglang-new-aaaa", "sglang", 0.125, False, speed=2.0),
                        client_run("vllm-new-cccc", "vllm", 0.125, False))  # another engine: no pair
    [p] = pairs(df)
    assert (p.baseline[-1], p.other[-1]) == ("sglang-old-bbbb", "sglang-new-aaaa")
    tput, gen = p.ratios
    assert tput.contains(2.0) and tput.lo > 1 and gen.hi < 1  # the new path let twice the tokens through
    assert p.cpu == (80.0, 40.0)
    table = client_paths_table(df, run_labels(df))
    assert [row[1].text for row in table.rows] == ["0.125 streamed, a connection per slot"]
    # the same client on both sides, or another seed (other request sets), is no client comparison
    same = headline_study(client_run("sglang-a-aaaa", "sglang", 1.0, True),
                          client_run("sglang-b-bbbb", "sglang", 1.0, True))
    assert pairs(same) == [] and client_paths_table(same, run_labels(same)) is None
    reseeded = client_run("sglang-new-aaaa", "sglang", 0.125, False).assign(seed=1)
    assert pairs(headline_study(client_run("sglang-old-bbbb", "sglang", 1.0, True), reseeded)) == []
    # runs older than the client key have none recorded: no comparison, and no error on the missing values
    old = headline_study(client_run("sglang-a-aaaa", "sglang", None, None), client_run("sglang-b-bbbb", "sglang", None,
                                                                                        None).assign(seed=1))
    assert pairs(old) == []


def test_the_step_breakdown_names_as_other_only_what_each_steps_phases_leave_out() -> None:
    from hybridrl.report.plots import step_breakdown
    from hybridrl.run.record import PHASE_KEYS

    # three steady steps whose phases explain every second, but whose phases peak in different steps: the median
    # step (10 s) less the phases' medians (4 + 4) would invent 2 s
    config = {"engine": "sglang", "placement": "colocate", "trainer": "hf", "model": "m", "tp": 1}
    rows = [{"run_id": "r", "config_id": "c", "step": s, **config, **dict.fromkeys(PHASE_KEYS, 0.0)}
            for s in (3, 4, 5)]
    for row, (gen, train) in zip(rows, [(4.0, 6.0), (6.0, 4.0), (4.0, 4.0)], strict=True):
        row.update({"timing_s/gen": gen, "timing_s/update_actor": train, "timing_s/step": gen + train})
    table = step_breakdown(pd.DataFrame(rows))
    assert table.loc["r", "other"] == 0.0
    rows[0]["timing_s/step"] += 3.0  # one step with 3 s no phase names, two with none: the median is 0
    rows[1]["timing_s/step"] += 2.0
    assert step_breakdown(pd.DataFrame(rows)).loc["r", "other"] == 2.0


def test_steps_whose_adapter_was_still_the_identity_stay_in_the_statistics() -> None:
    from hybridrl.report.stats import identity_adapter, steady_state

    def run(rid: str, grads: list[float], applied: list[bool], lora: list[float] | None = None) -> pd.DataFrame:
        rows = {"run_id": rid, "step": range(1, len(grads) + 1), "train/grad_norm": grads,
                "check/adapter_applied": applied}
        return pd.DataFrame(rows if lora is None else {**rows, "train/lora_norm": lora})

    # no gradient before step 5: steps 3-4's adapters were the identity, which no engine can show applied
    untouched = run("a", [0, 0, 0, 0, 0.1, 0], [False] * 4 + [True, True])
    assert identity_adapter(untouched).tolist() == [True] * 4 + [False] * 2
    assert steady_state(untouched)["step"].tolist() == [3, 4, 5, 6]
    # a gradient in warm-up moved every later adapter: a later "not applied" is a failure and leaves the statistics
    moved = run("b", [0.1, 0, 0, 0], [True, True, False, True])
    assert steady_state(moved)["step"].tolist() == [4]
    # a recorded LoRA norm decides where there is one: zero is the identity, whatever the gradients said
    normed = run("c", [0.1, 0, 0, 0], [True, True, False, False], lora=[0.0, 0.0, 0.0, 0.2])
    assert identity_adapter(normed).tolist() == [True, True, True, False]
    assert steady_state(normed)["step"].tolist() == [3]


def test_a_recorded_not_judged_step_counts_and_an_identity_recorded_as_not_applied_is_read_again() -> None:
    from hybridrl.report.run_tables import correctness_table

    def run(rid: str, applied: list, why: list, grads: list[float], lora: list[float | None]) -> pd.DataFrame:
        rows = [record(rid, "vllm", "split", s, np.random.default_rng(s), 1.0) for s in range(1, 7)]
        return pd.DataFrame(rows).assign(**{"check/adapter_applied": applied, "check/adapter_not_judged": why,
                                            "train/grad_norm": grads, "train/lora_norm": lora})

    ident = "identity adapter"
    today = run("vllm-split-aaaa", [None] * 3 + [True] * 3, [ident] * 3 + [None] * 3, [0.0] * 3 + [1.0] * 3,
                [0.0] * 3 + [0.5] * 3)
    # recorded before identity steps were told apart: False, no LoRA norm, and no gradient yet
    before = run("vllm-split-bbbb", [False] * 3 + [True] * 3, [None] * 6, [0.0] * 3 + [1.0] * 3, [None] * 6)
    dropped = run("vllm-split-cccc", [True, True, False, True, True, True], [None] * 6, [1.0] * 6, [0.5] * 6)
    df = headline_study(today, before, dropped)
    kept = steady_state(df).groupby("run_id")["step"].apply(list).to_dict()
    assert kept == {"vllm-split-aaaa": [3, 4, 5, 6], "vllm-split-bbbb": [3, 4, 5, 6], "vllm-split-cccc": [4, 5, 6]}
    labels = {r: r for r in df["run_id"].unique()}
    cells = {row[0].text: row[2] for row in correctness_table(df, labels).rows}
    assert cells["vllm-split-aaaa"].text == "3/3 ok; 3 with the identity adapter, not judged"
    assert cells["vllm-split-bbbb"].text == ("3/3 ok; 3 with the identity adapter, not judged (3 recorded as not "
                                             "applied, before identity adapters were told apart: read again as not "
                                             "judged)")
    assert cells["vllm-split-cccc"].cls == "fail" and cells["vllm-split-cccc"].text == "5/6 ok (failed at step 3)"


def test_the_gap_section_gives_the_other_mismatch_metrics_and_plots_them_per_step(study: list[Path],
                                                                                   tmp_path: Path) -> None:
    df = gather(study)
    without = tmp_path / "without.parquet"
    df.to_parquet(without, index=False)
    report_main(without, tmp_path / "a.md", tmp_path / "a.html", tmp_path / "a", "t")
    section = (tmp_path / "a.md").read_text().split("### The trainer-vs-engine logprob gap")[1].split("## ")[0]
    assert "k3 KL, later steps" not in section  # not recorded: no column for it
    assert (tmp_path / "a" / "mismatch.png").is_file()  # the gap alone is still drawn per step
    split = (df["run_id"] == "vllm-split-aaaa1111").to_numpy()
    df["mismatch/kl_k3"], df["mismatch/ess"] = np.nan, np.nan
    df.loc[split, "mismatch/kl_k3"] = np.where(df.loc[split, "step"] == 1, 9.0, 0.002)  # step 1 stays out
    df.loc[split, "mismatch/ess"] = 0.97
    table = tmp_path / "steps.parquet"
    df.to_parquet(table, index=False)
    report_main(table, tmp_path / "r.md", tmp_path / "r.html", tmp_path / "plots", "t")
    section = (tmp_path / "r.md").read_text().split("### The trainer-vs-engine logprob gap")[1].split("## ")[0]
    header = next(line for line in section.splitlines() if line.startswith("| run |"))
    assert "k3 KL, later steps" in header and "ESS share, later steps" in header and "IS weight" not in header
    row = next(line for line in section.splitlines() if line.startswith("| split |"))
    assert row.rstrip().endswith("| 0.00200 [0.00200, 0.00200] | 0.970 [0.970, 0.970] |"), row
    restart = next(line for line in section.splitlines() if line.startswith("| restart |"))
    assert restart.rstrip().endswith("| – | – |"), restart
    assert (tmp_path / "plots" / "mismatch.png").read_bytes().startswith(PNG_MAGIC)


def test_aggregate_of_runs_without_a_step_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from hybridrl import cli

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "steps.jsonl").write_text("\n")
    with pytest.warns(UserWarning, match="holds no steps"):
        code = cli.main(["aggregate", "--runs", str(tmp_path / "a"), str(tmp_path / "b"), "--csv",
                         str(tmp_path / "s.csv"), "--parquet", str(tmp_path / "s.parquet")])
    assert code == 1
    err = capsys.readouterr().err
    assert err == f"hybridrl: TableError: no steps in any of the 2 run folders given ({tmp_path / 'a'}, ...): " \
                  "nothing to aggregate\n"
    assert not (tmp_path / "s.csv").exists()


def test_a_warning_of_hybridrls_own_is_one_line_on_the_console(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "steps.jsonl").write_text("\n")
    run = write_run(tmp_path / "runs", "vllm-colocate-aaaa1111", "vllm", "colocate", steps=3)
    out = subprocess.run([sys.executable, "-m", "hybridrl", "aggregate", "--runs", str(tmp_path / "empty"), str(run),
                          "--csv", str(tmp_path / "s.csv"), "--parquet", str(tmp_path / "s.parquet")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == f"hybridrl: warning: {tmp_path / 'empty'}: steps.jsonl holds no steps; run left out\n"


# -- the compared step: the wall-clock step less the instrument's checks ----------------------------------------

def _checked(run: pd.DataFrame, check_s: float) -> pd.DataFrame:
    """The run with a check phase of check_s seconds inside each of its steps."""
    return run.assign(**{"timing_s/check": check_s, "timing_s/step": run["timing_s/step"] + check_s})


def test_comparisons_compare_the_step_less_its_checks_and_say_so() -> None:
    from hybridrl.report.comparisons import comparison_table, ratio_table, summary

    # alike but for the checks: SGLang's canary took 3 s a step, vLLM's 0.1 s
    df = headline_study(_checked(headline_run("sglang-colocate-aaaa", "sglang"), 3.0),
                        _checked(headline_run("vllm-colocate-bbbb", "vllm"), 0.1))
    sg, vl = sorted(configs(df), key=lambda c: c[0] != "sglang")
    assert compare(df, "timing_s/step", sg, vl).excludes(1.0)  # the whole step holds the instrument's cost
    compared = compare(df, "timing_s/step_compared", sg, vl)
    assert compared.contains(1.0) and compared.value == pytest.approx(1.0, abs=0.02)
    step = pd.to_numeric(df["timing_s/step"]) - pd.to_numeric(df["timing_s/check"])
    assert np.allclose(df["timing_s/step_compared"], step)
    assert np.allclose(df["cost/tok_s_per_gpu"], df["perf/gen_tokens"] / step / df["cost/gpus"])
    labels = {c[-1]: c[0] for c in configs(df)}
    _, ratios = ratio_table(df, labels)
    at = ratios.headers.index("Step time, checks excluded ratio [95% CI]")
    assert float(ratios.rows[0][at].text.split()[0]) == pytest.approx(1.0, abs=0.03)  # the whole step's: about 1.5
    rows = {r[0].text: r for r in comparison_table(df, labels).rows}
    assert {"Step time, checks excluded (s)", "Step time, checks included (s)"} <= set(rows)
    assert summary(df, "t")["checks_untimed"] == ""  # every step timed its checks


def test_records_without_a_check_phase_compare_the_whole_step_and_the_report_says_so(tmp_path: Path) -> None:
    from hybridrl.report.comparisons import summary

    old = headline_run("vllm-colocate-bbbb", "vllm")  # recorded before the check phase was timed
    df = headline_study(old, _checked(headline_run("sglang-colocate-aaaa", "sglang"), 0.5))
    untimed = df["run_id"] == "vllm-colocate-bbbb"
    assert np.allclose(df.loc[untimed, "timing_s/step_compared"], df.loc[untimed, "timing_s/step"])
    note = summary(df, "t")["checks_untimed"]
    assert note.startswith("10 step record(s) of 1 run(s) predate the check phase's timing") and "whole step" in note
    table = tmp_path / "steps.csv"
    df.to_csv(table, index=False)
    report_main(table, tmp_path / "r.md", tmp_path / "r.html", tmp_path / "plots", "t")
    md = (tmp_path / "r.md").read_text()
    assert "- Step time compared: the wall-clock step less the instrument's own checks" in md
    assert f"**{note}.**" in md



def test_runs_that_lay_out_their_update_differently_are_labelled_by_that_layout() -> None:
    from hybridrl.report.aggregate import update_layout
    from hybridrl.report.plots import config_labels

    ids = ("sglang-moestep-aaaa1111", "sglang-moestep-bbbb2222", "sglang-moestep-cccc3333")
    runs = [headline_run(rid, "sglang") for rid in ids]
    layouts = [(2, "replicated", "host_read", False), (2, "split", "masked", False), (2, "split", "masked", "auto")]
    for run, (ep, batch, dispatch, keep) in zip(runs, layouts, strict=True):
        run["train_ep"], run["ep_batch"], run["ep_dispatch"], run["keep_base_on_gpu"] = ep, batch, dispatch, keep
    df = headline_study(*runs)
    assert config_labels(df) == {ids[0]: "EP 2", ids[1]: "EP 2, split batch, masked rows",
                                 ids[2]: "EP 2, split batch, masked rows, base kept where it fits"}
    assert df["keep_base_on_gpu"].dropna().unique().tolist() == ["False", "auto"]  # a word, not a number
    # nothing to name at the defaults, or for runs recorded before the keys
    assert update_layout(1, "replicated", "host_read", False) is None
    assert update_layout(None, None, None, None) is None
    assert update_layout(1, None, None, True) == "base kept"
