"""Placements compared within one engine (report/placements.py): each arm against the engine's colocated arm."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_report import headline_run, headline_study
from test_report_conditions import T0, timed

from hybridrl.report import placements
from hybridrl.report.comparisons import placement_tables
from hybridrl.report.wording import violations


def _run(run_id: str, engine: str, placement: str, step_s: float, start: float, overlap: int = 0,
         gpu_count: int = 2, seed: int = 0) -> pd.DataFrame:
    """A run whose steps take about step_s seconds (a little noise, so intervals have width)."""
    run = timed(headline_run(run_id, engine, placement=placement, trainer="hf", seed=seed), start, step_s)
    jitter = np.random.default_rng(len(run_id) + seed).normal(0, 0.02 * step_s, len(run))
    return run.assign(**{"timing_s/step": step_s + jitter}, overlap=overlap, train_gpus=1, gpu_count=gpu_count,
                      gpu_memory_utilization=0.5)


def _study(overlap_s: float, split_s: float | None = None, rounds: int = 2, gpu_count: int = 2,
           colocate_share: float = 0.5) -> pd.DataFrame:
    """Per engine, colocate (10 s steps) against overlap (and split), interleaved round by round."""
    runs, t = [], T0
    for k in range(1, rounds + 1):
        suffix = "" if k == 1 else f"-r{k}"
        for engine in ("sglang", "vllm"):
            arms = [("colocate", 10.0, 0), ("split", overlap_s, 1)] + ([("split", split_s, 0)] if split_s else [])
            for placement, step_s, overlap in arms:
                arm = "overlap" if overlap else placement
                name = f"{engine}-{arm}-{hashlib.sha1(f'{engine}{arm}'.encode()).hexdigest()[:8]}{suffix}"
                run = _run(name, engine, placement, step_s, t, overlap, gpu_count, seed=k)
                if placement == "colocate":
                    run = run.assign(gpu_memory_utilization=colocate_share)
                runs.append(run)
                t += 200
    return headline_study(*runs)


def test_each_engine_sets_its_placements_beside_its_colocated_arm_with_intervals_over_runs() -> None:
    gs = placements.groups(_study(overlap_s=6.0))
    assert [g.engine for g in gs] == ["SGLang", "vLLM server"]
    for g in gs:
        base, overlap = g.arms
        assert (base.label, overlap.label) == ("colocate", "overlapped split (1 step stale)")
        assert base.ratios == (None, None, None) and base.n == (2, 16)
        step, per_gpu, gpu_s = overlap.ratios
        # overlap on two GPUs: steps about 0.6x as long, but twice the GPUs held
        assert step.value == pytest.approx(0.6, rel=0.05) and step.n_runs == 2 and step.excludes(1.0)
        assert per_gpu.value == pytest.approx(10.0 / 6.0 / 2, rel=0.05) and per_gpu.excludes(1.0)
        assert gpu_s.value == pytest.approx(1.2, rel=0.05) and gpu_s.excludes(1.0)
        assert overlap.recorded == "interleaved"
        said = dict(zip([m.name for m in placements.METRICS], overlap.conclusions, strict=True))
        assert said["Step time, checks excluded"].startswith(
            "Step time, checks excluded: overlapped split is faster than colocate, overlapped split / colocate 0.6")
        assert said["Tokens/s per GPU, checks excluded"].startswith(
            "Tokens/s per GPU, checks excluded: overlapped split is lower than colocate")
        assert said["GPU-seconds per step, checks excluded"].startswith(
            "GPU-seconds per step, checks excluded: overlapped split is higher than colocate")
        assert not g.caveats  # own GPUs, one engine share, interleaved, one commit


def test_arms_that_cannot_be_told_apart_are_worded_so_and_never_ranked() -> None:
    [g, _] = placements.groups(_study(overlap_s=10.0, gpu_count=1))
    _, overlap = g.arms
    assert overlap.label == "overlapped split (1 step stale), one shared GPU"
    step = overlap.ratios[0]
    assert step.contains(1.0) and math.isfinite(step.lo)
    assert "could not be told apart" in overlap.conclusions[0]
    assert not violations(" ".join(overlap.conclusions))
    # one GPU shared by engine and trainer: it costs one GPU, and the group says what the arm compares
    assert overlap.ratios[1].value == pytest.approx(1.0, rel=0.05)
    assert any(c.startswith("a split arm saw fewer GPUs than it asks for") for c in g.caveats)


def test_what_the_comparison_could_not_control_is_a_caveat() -> None:
    [g, _] = placements.groups(_study(overlap_s=6.0, colocate_share=0.8))
    assert any(c.startswith("the engine was given different shares of its GPU (0.5, 0.8)") for c in g.caveats)
    # every overlap run after every colocate run: a drift of the host falls on one arm only
    df = _study(overlap_s=6.0)
    late = df["config_id"].str.contains("overlap")
    df.loc[late, "time_unix"] += 10_000
    [g, _] = placements.groups(df)
    assert any(c.startswith("not interleaved: every overlapped split run was recorded after every colocate run")
               for c in g.caveats)
    # a replicate from another lease: the machine differs within an arm, not only between arms
    df = _study(overlap_s=6.0).assign(machine="aaaa1111")
    [g, _] = placements.groups(df)
    assert not any("machines" in c for c in g.caveats)
    df.loc[df["run_id"].str.endswith("-r2"), "machine"] = "bbbb2222"
    [g, _] = placements.groups(df)
    assert "recorded by different machines (boot ids): aaaa1111, bbbb2222" in g.caveats


def test_split_and_overlap_both_pair_and_nothing_pairs_across_engines_seeds_or_without_colocate() -> None:
    [g, _] = placements.groups(_study(overlap_s=6.0, split_s=8.0))
    assert [a.label for a in g.arms] == ["colocate", "overlapped split (1 step stale)", "split"]
    # and the overlap against the split that takes turns on the same GPUs
    [(est, said)] = g.against_split
    assert est.value == pytest.approx(0.75, rel=0.05) and est.excludes(1.0)
    assert said.startswith("Step time, checks excluded: overlapped split is faster than split, overlapped split / "
                           "split 0.7")
    assert not placements.groups(_study(overlap_s=6.0))[0].against_split  # no plain split to set it beside
    df = _study(overlap_s=6.0)
    assert not placements.groups(df[df["placement"] != "colocate"])  # nothing to compare against
    other_seed = df.assign(seed=np.where(df["placement"] == "colocate", 0, 1))
    assert not placements.groups(other_seed)  # another request set
    assert all(a.config_id.split("-")[0] == e for g, e in zip(placements.groups(df), ("sglang", "vllm"), strict=True)
               for a in g.arms)


def test_the_report_table_shows_values_ratios_and_sentences_per_engine() -> None:
    [sg, vl] = placement_tables(_study(overlap_s=6.0))
    assert sg["title"] == "SGLang: placements against colocate" and vl["title"].startswith("vLLM server")
    table = sg["table"]
    assert table.headers[0] == "placement" and "Step time, checks excluded / colocate [95% CI]" in table.headers
    base, overlap = table.rows
    assert [c.text for c in base][4:7] == ["–", "–", "–"] and base[-2].text == "2 × 16"
    assert overlap[4].text.startswith("0.6") and overlap[4].text.endswith("]")
    assert sg["n_comparisons"] == 3 and len(sg["conclusions"]) == 3


def test_the_placements_plot_is_drawn_only_where_an_engine_has_arms_to_compare(tmp_path: Path) -> None:
    from hybridrl.report.plots import plot_placements

    df = _study(overlap_s=6.0)
    assert plot_placements(df, tmp_path / "p.png") == tmp_path / "p.png" and (tmp_path / "p.png").stat().st_size
    assert plot_placements(df[df["placement"] == "colocate"], tmp_path / "q.png") is None


def test_an_overlapped_runs_last_step_is_left_out_of_the_steady_state_and_shown_apart() -> None:
    from hybridrl.report import stats
    from hybridrl.report.comparisons import summary
    from hybridrl.report.run_tables import warmup_table

    df = _study(overlap_s=6.0, rounds=1)
    # the last step has nothing rolling out ahead beside its training: it is short
    df.loc[(df["overlap"] == 1) & (df["step"] == 10), "timing_s/step"] = 1.0
    drained = stats.drain(df)
    assert set(df.loc[drained, "step"]) == {10} and set(df.loc[drained, "overlap"]) == {1}
    steady = stats.steady_state(df)
    assert (steady.loc[steady["overlap"] == 1, "step"].max(), steady.loc[steady["overlap"] == 0, "step"].max()) == (
        9, 10)  # a colocated run keeps its last step
    # runs aggregated before `overlap` was are known by their stale rollouts
    older = df.drop(columns=["overlap"]).assign(**{"rollout/staleness": np.where(df["overlap"] == 1, 1, 0)})
    assert stats.drain(older).equals(drained)
    said = summary(df, "t")
    assert (said["drain"], said["excluded_adapter"]) == (2, 0)
    labels = dict(zip(df["run_id"], df["run_id"], strict=True))
    rows = [(r[0].text, r[1].text) for r in warmup_table(df, labels).rows]
    assert sum(step == "10 (last: nothing ahead)" for _, step in rows) == 2 and len(rows) == 4 * 2 + 2


def test_run_labels_name_an_overlapped_split_apart_from_a_split() -> None:
    from hybridrl.report.plots import run_labels

    labels = set(run_labels(_study(overlap_s=6.0, split_s=8.0, rounds=1)).values())
    assert {"sglang · overlapped split", "sglang · split", "sglang · colocate"} <= labels


def test_the_engine_headline_pairs_a_split_with_a_split_and_an_overlapped_split_with_its_like() -> None:
    from hybridrl.report.headline import headlines

    pairs = sorted((h.title, h.sglang_run.split("-")[1], h.vllm_run.split("-")[1])
                   for h in headlines(_study(overlap_s=6.0, split_s=8.0, rounds=1)))
    assert pairs == [("colocate: SGLang vs vLLM server", "colocate", "colocate"),
                     ("overlapped split: SGLang vs vLLM server", "overlap", "overlap"),
                     ("split: SGLang vs vLLM server", "split", "split")]  # never a split against an overlapped one


def test_a_rollout_that_ran_ahead_keeps_its_length_but_not_the_readings_of_the_wait_for_it() -> None:
    """An overlapped step's gen phase is the wait for a rollout that ran during the last training: tables
    written before runs recorded null there held that wait's readings (a thread at 1,207% of a core on
    2026-11-26); they are masked as read, and the rollout's own length is tokens over throughput."""
    from hybridrl.report.aggregate import normalise
    from hybridrl.run.record import ROLLOUT_READINGS

    run = _run("sglang-overlap-abcdef12", "sglang", "split", 2.0, T0, overlap=1)
    stale = np.where(run["step"] > 1, 1, 0)
    run = run.assign(**{"rollout/staleness": stale, "timing_s/gen": np.where(stale, 0.002, 1.1),
                        "perf/gen_tokens": 11000.0, "perf/throughput": 10000.0,
                        "host/busiest_thread_cpu_pct_gen": 1207.0, "host/controller_cpu_pct_gen": 4.0,
                        "gpu/sm_clock_mhz_gen": 1980.0, "host/cpu_busy_pct_update_actor": 8.0})
    df = normalise(run)
    ahead, first = df[df["step"] > 1], df[df["step"] == 1]
    assert ahead[list(ROLLOUT_READINGS)].isna().all().all()
    assert first["host/busiest_thread_cpu_pct_gen"].item() == 1207.0  # rolled out inside its step: kept
    assert (ahead["host/cpu_busy_pct_update_actor"] == 8.0).all()  # training's readings are training's
    assert np.allclose(df["perf/rollout_s"], 1.1)  # the rollout's own time, waited for or run ahead


def test_a_run_without_a_trainer_recorded_as_stale_did_not_run_ahead() -> None:
    """Rollout-only runs (trainer: none) recorded staleness step - 1 until 2026-11-26 (the learning study's
    vocabulary runs): they rolled out inside every step, so their readings stay and their last step counts."""
    from hybridrl.report import stats
    from hybridrl.report.aggregate import normalise, ran_ahead

    run = _run("sglang-vocab-abcdef12", "sglang", "colocate", 2.0, T0).assign(trainer="none")
    run = run.assign(**{"rollout/staleness": run["step"] - 1, "host/busiest_thread_cpu_pct_gen": 100.0})
    df = normalise(run)
    assert not ran_ahead(df).any() and not stats.drain(df).any()
    assert (df["host/busiest_thread_cpu_pct_gen"] == 100.0).all()
