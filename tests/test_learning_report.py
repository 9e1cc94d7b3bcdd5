"""Time to accuracy and the learning plot, from a small step table."""

import pandas as pd

from hybridrl.report import learning, plots


def _table() -> pd.DataFrame:
    rows = []
    for rid, accs in (("a", [None, 0.2, 0.3, 0.6]), ("b", [None, 0.1, None, 0.2])):
        for step, acc in enumerate(accs, start=1):
            rows.append({"run_id": rid, "engine": rid, "placement": "colocate", "trainer": "hf", "model": "m", "tp": 1,
                         "step": step, "timing_s/step": 10.0 if rid == "a" else 5.0, "eval/accuracy": acc,
                         "reward/mean": 0.1 * step})
    return pd.DataFrame(rows)


def test_time_to_accuracy_uses_the_summed_step_times():
    df = _table()
    assert learning.targets(df) == [0.1, 0.2, 0.25, 0.5]  # 0.2: the best accuracy every run reached
    header, rows = learning.time_to_accuracy(df, {"a": "A", "b": "B"})
    assert header[1:3] == ["first eval (step: accuracy)", "best eval accuracy"]
    a, b = (dict(zip(header, r, strict=True)) for r in rows)
    assert a["first eval (step: accuracy)"] == "2: 20.0%" and a["best eval accuracy"] == "60.0%"
    assert a["time to accuracy ≥ 25.0%"] == "30.0 s (step 3)" and a["time to accuracy ≥ 50.0%"] == "40.0 s (step 4)"
    assert b["time to accuracy ≥ 20.0%"] == "20.0 s (step 4)" and b["time to accuracy ≥ 25.0%"] == "not reached"


def test_no_evals_no_table_and_no_plot(tmp_path):
    df = _table().drop(columns=["eval/accuracy"])
    assert learning.time_to_accuracy(df, {"a": "A", "b": "B"}) == ([], [])
    assert plots.plot_learning(df, tmp_path / "learning.png") is None
    assert plots.plot_learning(_table(), tmp_path / "learning.png").exists()


def _sharpening() -> pd.DataFrame:
    """Run s: sampled accuracy up, entropy down, greedy eval flat (a policy that sharpens); run f: flat entropy."""
    rows = []
    for rid in ("s", "f"):
        for step in range(1, 21):
            rows.append({"run_id": rid, "engine": rid, "placement": "colocate", "trainer": "hf", "model": "m",
                         "tp": 1, "step": step, "timing_s/step": 3.0,
                         "reward/accuracy": 0.3 + (0.01 * step if rid == "s" else 0.0) + 0.002 * (step % 3),
                         "eval/accuracy": 0.44 + 0.01 * (step % 2) if step % 5 == 0 else None,
                         "train/entropy": (1.2 - 0.02 * step if rid == "s" else 1.2) + 0.005 * (step % 4)})
    return pd.DataFrame(rows)


def test_learning_trends_say_which_readings_moved_from_their_intervals():
    header, rows = learning.trends(_sharpening(), {"s": "S", "f": "F"})
    assert header[:2] == ["run", "steps"] and len(rows) == 2
    by_run = {r[0]: dict(zip(header, r, strict=True)) for r in rows}
    s, f = by_run["S"], by_run["F"]
    assert s["steps"] == "1–20"
    assert s["sampled accuracy: first → last; trend"].split("; ")[1].startswith("grows +0.01")
    assert s["policy entropy (nats per token): first → last; trend"].startswith("1.18 → 0.8; falls -0.02")
    assert s["eval accuracy (greedy): first → last; trend"].split("; ")[1].startswith("no trend shown")
    assert f["policy entropy (nats per token): first → last; trend"].split("; ")[1].startswith("no trend shown")
    # no response lengths recorded: that column is left out rather than shown empty
    assert not any(h.startswith("response length") for h in header)


def test_no_eval_and_no_entropy_no_trend_table():
    df = _sharpening().drop(columns=["eval/accuracy", "train/entropy"])
    assert learning.trends(df, {"s": "S", "f": "F"}) == ([], [])
    two_steps = _sharpening()[lambda d: d["step"] <= 2].drop(columns=["eval/accuracy"])
    assert learning.trends(two_steps, {"s": "S", "f": "F"}) == ([], [])


def _replicated() -> pd.DataFrame:
    """Configuration x: three replicates (x, x-r2, x-r3); y: one run. Evals at steps 2 and 4."""
    rows = []
    runs = {"x-hf-m-aaaa1111": ([0.2, 0.4], 10.0), "x-hf-m-aaaa1111-r2": ([0.3, 0.5], 12.0),
            "x-hf-m-aaaa1111-r3": ([0.1, 0.2], 8.0), "y-hf-m-bbbb2222": ([0.3, 0.6], 5.0)}
    for rid, (accs, step_s) in runs.items():
        for step in range(1, 5):
            rows.append({"run_id": rid, "engine": rid[0], "placement": "colocate", "trainer": "hf", "model": "m",
                         "tp": 1, "step": step, "timing_s/step": step_s,
                         "eval/accuracy": accs[step // 2 - 1] if step % 2 == 0 else None, "reward/mean": 0.1 * step})
    return pd.DataFrame(rows)


def test_replicated_configurations_get_a_mean_curve_a_band_and_a_row_over_their_runs(tmp_path):
    df = _replicated()
    assert learning.replicated(df) == ["x-hf-m-aaaa1111"]  # y has one run: nothing to pool
    curve = learning.replicate_curve(learning.evals(df), "x-hf-m-aaaa1111", "eval/accuracy", "wall_s")
    assert curve["step"].tolist() == [2, 4] and curve["n_runs"].tolist() == [3, 3]
    assert curve["mean"].round(6).tolist() == [0.2, round((0.4 + 0.5 + 0.2) / 3, 6)]
    assert curve["lo"].tolist() == [0.1, 0.2] and curve["hi"].tolist() == [0.3, 0.5]
    assert curve["x"].tolist() == [20.0, 40.0]  # the runs' mean wall clock: (20 + 24 + 16) / 3
    header, rows = learning.time_to_accuracy_over_replicates(df, {"x-hf-m-aaaa1111": "X"})
    [row] = rows
    cells = dict(zip(header, row, strict=True))
    assert cells["runs"] == "3"
    # 0.2 is the best accuracy every run reached (y's and x-r3's best); x's three runs reach it at 20, 24 and 32 s
    assert cells["time to accuracy ≥ 20.0%: reached by; median [range]"] == "3 of 3; 24.0 s [20.0, 32.0]"
    assert cells["time to accuracy ≥ 50.0%: reached by; median [range]"] == "1 of 3; 48.0 s [48.0, 48.0]"
    assert learning.time_to_accuracy_over_replicates(_table(), {}) == ([], [])  # no replicates, no table
    assert plots.plot_learning(df, tmp_path / "learning.png").stat().st_size > 0
