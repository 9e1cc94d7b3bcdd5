"""`python -m hybridrl status`: one row per declared run, read from a results folder and the logs."""

import json
from pathlib import Path

import pytest

from hybridrl import cli
from hybridrl.report import status
from hybridrl.run.record import BOOLS
from hybridrl.study.config import load_study

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "config" / "smoke.yaml"  # three runs: split (3 steps), restart (3), overlapped split (4)


def _record(step: int, **gates: object) -> dict:
    base = {"step": step, "timing_s/step": 1.5 + step, "check/logprob_gap_tier": "pass",
            **dict.fromkeys(BOOLS, True)}
    return {**base, **gates}


def _write(run_dir: Path, records: list[dict], done: bool = False) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if done:
        (run_dir / "done.json").write_text("{}")


@pytest.fixture
def study_dirs(tmp_path: Path) -> tuple[list[str], Path]:
    """The smoke study's runs in four states: done, failed, running (no log yet), not started."""
    ids = list(load_study(SMOKE).runs)
    results, logs = tmp_path / "results", tmp_path / "logs" / "train"
    logs.mkdir(parents=True)
    _write(results / "runs" / ids[0], [_record(1), _record(2), _record(3)], done=True)
    (logs / f"{ids[0]}.log").write_text("step 3 done\n")
    # a gate that failed and one not judged (staleness): the row names both
    _write(results / "runs" / ids[1], [_record(1, **{"check/adapter_applied": None,
                                                     "check/kv_capacity_ok": False})])
    (logs / f"{ids[1]}.log").write_text("Traceback (most recent call last):\n  ...\nKeyError: 'answer'\n\n")
    _write(results / "runs" / ids[2], [_record(1, **{"check/logprob_gap_tier": "warn"}), _record(2)])
    return ids, tmp_path


def test_each_run_gets_its_steps_state_time_gates_and_log(study_dirs) -> None:
    ids, root = study_dirs
    rows = status.study_status(load_study(SMOKE), root / "results", root / "logs")
    assert [r.run_id for r in rows] == ids
    done, failed, running = rows
    assert (done.steps_done, done.steps_planned, done.state, done.step_s) == (3, 3, "done", 4.5)
    assert set(done.gates.values()) == {"ok"} and len(done.gates) == len(BOOLS) + 1
    assert done.log == str(root / "logs" / "train" / f"{ids[0]}.log") and done.error is None
    assert (failed.steps_done, failed.state, failed.error) == (1, "failed", "KeyError: 'answer'")
    assert failed.gates["kv capacity"] == "FAIL" and failed.gates["adapter"] == "–"
    assert (running.steps_done, running.steps_planned, running.state) == (2, 4, "running")
    assert running.gates["logprob gap"] == "ok"  # the last step's gates, not the first's


def test_a_run_with_neither_steps_nor_log_has_not_started(tmp_path: Path) -> None:
    row = status.run_status("r", 5, tmp_path / "runs" / "r", tmp_path / "r.log")
    assert (row.steps_done, row.state, row.step_s, row.gates) == (0, "not started", None, {})
    assert status._gates_text(row.gates) == "–"


@pytest.mark.parametrize(("last", "failed"), [
    ("hybridrl: RunFailed: r step 2: the trainer's and the engine's logprobs differ", True),
    ("hybridrl: config error: runs[0].model: 'x' is not defined", True),
    ("hybridrl.task.data.DataError: train.jsonl:3: no answer", True),
    ("hybridrl: warning: 2 of 8 answers hold no number", False),
    ("SIGTERM: stopping the engine; completed steps are kept and the run resumes", False),
    ("Errors counted: 0", False),
])
def test_a_log_ending_in_an_error_line_is_failed_and_a_warning_is_not(tmp_path: Path, last: str,
                                                                       failed: bool) -> None:
    log = tmp_path / "r.log"
    log.write_text(f"starting\n{last}\n")
    row = status.run_status("r", 5, tmp_path / "r", log)
    assert row.state == ("failed" if failed else "running")


def test_done_wins_over_an_error_line_of_an_earlier_attempt(tmp_path: Path) -> None:
    _write(tmp_path / "r", [_record(1)], done=True)
    log = tmp_path / "r.log"
    log.write_text("hybridrl: EngineError: the engine died\n")
    assert status.run_status("r", 1, tmp_path / "r", log).state == "done"


def test_every_gate_the_record_has_gets_a_short_name() -> None:
    assert set(status.GATE_NAMES) == {*BOOLS, "check/logprob_gap_tier"}


def test_cli_prints_aligned_text_off_a_tty_and_json_on_request(study_dirs, capsys) -> None:
    ids, root = study_dirs
    args = ["status", "--config", str(SMOKE), "--results", str(root / "results")]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "steps", "state", "last", "step", "(s)", "gates", "log"]
    assert lines[1].startswith(ids[0]) and " 3/3 " in lines[1] and f"all {len(BOOLS) + 1} ok" in lines[1]
    # the columns line up: every row's state starts where the header's does
    col = lines[0].index("state")
    assert [line[col:].split()[0] for line in (lines[1], lines[2], lines[4])] == ["done", "failed", "running"]
    assert "kv capacity FAIL" in lines[2] and lines[3] == "  error: KeyError: 'answer'"
    assert cli.main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["steps_done"], r["state"]) for r in rows] == [
        (ids[0], 3, "done"), (ids[1], 1, "failed"), (ids[2], 2, "running")]
    assert rows[0]["log"] == str(root / "logs" / "train" / f"{ids[0]}.log")


def test_a_torn_last_line_is_passed_over_not_fatal(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    _write(run_dir, [_record(1)])
    with open(run_dir / "steps.jsonl", "a") as f:
        f.write('{"step": 2, "timing')
    with pytest.warns(UserWarning, match=r"steps.jsonl:2: not a step record"):
        row = status.run_status("r", 3, run_dir, tmp_path / "r.log")
    assert (row.steps_done, row.state) == (1, "running")
