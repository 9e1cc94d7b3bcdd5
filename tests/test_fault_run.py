"""hybridrl fault-run against a stand-in run (tests/fixtures/fake_train.py): where it hits, and what it judges.
The real engines and trainer meet these faults in the GPU plan `faults` and, for the engine kill, in
tests/test_pipeline.py."""

import json
import os
import signal
import sys
from pathlib import Path

from hybridrl.cli import main
from hybridrl.tools.fault_run import fault_run

FAKE = Path(__file__).parent / "fixtures" / "fake_train.py"


def _cmd(run: Path, *flags: str) -> list[str]:
    return [sys.executable, str(FAKE), "--out", str(run), "--steps", "4", *flags]


def test_engine_kill_and_sigterm_land_where_asked_and_the_run_survives_both(tmp_path: Path) -> None:
    run = tmp_path / "run"
    report = fault_run(_cmd(run), run, kill_engine_at=2, term_at=3, grace_s=3)
    assert report.killed_in == "step 2 gen" and report.engine_killed
    assert report.termed_in == "step 3 update_actor"
    assert report.exit_codes == [143, 0]  # stopped by SIGTERM, then resumed to the end
    assert report.steps == [1, 2, 3, 4] and report.engine_restarts == 1
    assert report.leftover == [] and report.ok, report.problems


def test_with_overlap_the_engine_is_killed_in_the_rollout_running_ahead_of_its_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    report = fault_run(_cmd(run, "--overlap"), run, kill_engine_at=3, term_at=None, grace_s=3)
    # step 3's rollout runs while step 2 trains; its own `gen` would come too late to hit it
    assert report.killed_in == "step 3 rollout, running ahead in step 2 update_actor" and report.engine_killed
    assert report.steps == [1, 2, 3, 4] and report.engine_restarts == 1 and report.ok, report.problems


def test_a_restart_that_is_not_counted_fails(tmp_path: Path) -> None:
    run = tmp_path / "run"
    report = fault_run(_cmd(run, "--no-restart-count"), run, kill_engine_at=2, term_at=None, grace_s=3)
    assert not report.ok
    assert report.problems == ["the engine was killed but no step counted a restart (errors/engine_restarts)"]


def test_an_engine_left_behind_after_sigterm_fails_and_the_cli_says_so(tmp_path: Path, capsys) -> None:
    run, out = tmp_path / "run", tmp_path / "fault.json"
    try:
        code = main(["fault-run", "--term-at", "2", "--out", str(out), "--", *_cmd(run, "--orphan")])
    except SystemExit as exc:
        code = exc.code
    assert code == 1
    data = json.loads(out.read_text())
    assert not data["ok"] and data["leftover"]
    assert "processes of the run still alive" in capsys.readouterr().out
    for pid in data["leftover"]:
        os.kill(pid, signal.SIGKILL)


def test_a_step_never_reached_is_reported(tmp_path: Path) -> None:
    run = tmp_path / "run"
    report = fault_run(_cmd(run), run, kill_engine_at=9, term_at=None, grace_s=3)
    assert report.problems == ["the run never reached step 9's rollout with an engine to kill"]
