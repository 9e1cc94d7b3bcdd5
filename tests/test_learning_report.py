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
