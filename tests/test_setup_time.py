"""Set-up against measured time: each run's engine start and its parts beside its warm-up and measured steps."""

from __future__ import annotations

import pandas as pd
import pytest

from hybridrl.report import figures, setup_time


def _run(rid: str, start: float | None, step_s: list[float], parts: dict[str, float] | None = None) -> pd.DataFrame:
    rows = [{"run_id": rid, "config_id": "c", "step": i, "time_unix": 1000.0 + i + (100 if rid == "b" else 0),
             "timing_s/step": s, "warmup_steps": 2, "engine": "sglang", "placement": "colocate", "trainer": "hf",
             "model": "m", "tp": 1} for i, s in enumerate(step_s, 1)]
    first = rows[0]
    first["timing_s/engine_start"] = start
    for part, seconds in (parts or {}).items():
        first[f"timing_s/engine_start_{part}"] = seconds
    return pd.DataFrame(rows)


def test_each_run_shows_its_start_and_parts_beside_its_warmup_and_measured_steps() -> None:
    df = pd.concat([_run("a", 90.0, [5.0, 3.0, 2.0, 2.0, 2.0], {"import": 60.0, "unexplained": 1.5}),
                    _run("b", 30.0, [4.0, 2.0, 2.0, 2.0, 2.0])], ignore_index=True)
    table = setup_time.setup_table(df, {"a": "first", "b": "second"})
    assert table.headers == ["run", "engine start (s)", "… process and import", "… unexplained (no log line)",
                             "warm-up steps (s)", "measured steps (s)", "set-up's share"]
    assert [[c.text for c in row] for row in table.rows] == [
        ["first", "90.00", "60.00", "1.50", "8.00", "6.00", "87%"],   # 90 / (90 + 8 + 6)
        ["second", "30.00", "–", "–", "6.00", "6.00", "71%"],         # 30 / (30 + 6 + 6): no parts recorded
    ]


def test_the_trainers_build_and_the_hosts_measurements_count_as_set_up_where_recorded() -> None:
    a = _run("a", 90.0, [5.0, 3.0, 2.0, 2.0, 2.0])
    a.loc[0, ["timing_s/trainer_build", "timing_s/host_measure"]] = [40.0, 6.0]
    df = pd.concat([a, _run("b", 30.0, [4.0, 2.0, 2.0, 2.0, 2.0])], ignore_index=True)
    table = setup_time.setup_table(df, {"a": "first", "b": "older"})
    assert table.headers[:4] == ["run", "trainer build (s)", "host measured (s)", "engine start (s)"]
    assert [[c.text for c in row] for row in table.rows] == [
        ["first", "40.00", "6.00", "90.00", "8.00", "6.00", "91%"],  # (40 + 6 + 90) / (136 + 8 + 6)
        ["older", "–", "–", "30.00", "6.00", "6.00", "71%"],         # recorded its start alone
    ]


def test_a_study_whose_runs_recorded_no_start_has_no_table_and_no_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    df = _run("a", None, [5.0, 3.0, 2.0])
    assert setup_time.setup_table(df, {"a": "only"}) is None
    monkeypatch.setattr(figures, "_table", lambda study: df)
    with pytest.raises(ValueError, match="no run recorded its engine's start"):
        figures.setup_table("results/reference/none")


def test_the_figure_writes_the_table_on_lines_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    df = _run("a", 10.0, [1.0, 1.0, 1.0])
    monkeypatch.setattr(figures, "_table", lambda study: df)
    text = figures.setup_table("results/reference/x")
    lines = text.strip("\n").split("\n")
    assert text.startswith("\n") and text.endswith("\n")
    assert lines[1].startswith("| --- |") and len(lines) == 3
    assert lines[2].split(" | ")[1:] == ["10.00", "2.00", "1.00", "77% |"]


def test_a_trl_peer_is_compared_on_its_steps_after_warmup(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """peer_median and peer_ratio: TRL's steps 1-2 are warm-up, as a run's; hybridrl's side is its compared step."""
    import json

    peer = tmp_path / "trl.json"
    peer.write_text(json.dumps({"steps": [{"step": i, "step_s": s} for i, s in enumerate([60.0, 40.0, 8.0, 8.0,
                                                                                        8.0, 8.0], 1)]}))
    ours = pd.concat([_run(r, 10.0, [9.0, 9.0, 2.0, 2.0, 2.0, 2.0]) for r in ("a", "b")], ignore_index=True)
    ours["timing_s/step_compared"] = ours["timing_s/step"]
    monkeypatch.setattr(figures, "_table", lambda study: ours)
    monkeypatch.setattr(figures, "REPO", tmp_path.parent)
    figures._json.cache_clear()
    assert figures.peer_median(f"{tmp_path.name}/trl.json") == "8.00 [8.00, 8.00]"  # warm-up's 60 and 40 left out
    assert figures.peer_ratio("s", "c", f"{tmp_path.name}/trl.json") == "0.2500x [0.2500, 0.2500]"
    peer.write_text(json.dumps({"steps": [{"step": 1, "step_s": 60.0}]}))
    figures._json.cache_clear()
    with pytest.raises(ValueError, match="no 'step_s' after step 2"):
        figures.peer_median(f"{tmp_path.name}/trl.json")
