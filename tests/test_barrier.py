"""The start barrier that keeps side-by-side runs from stepping while another run is still starting."""

import threading
from pathlib import Path

import pytest

from hybridrl.run.barrier import ENV, TIMEOUT_ENV, StartBarrier
from hybridrl.study.config import ConfigError


def test_from_env_reads_dir_and_parties_and_refuses_a_malformed_value(tmp_path: Path) -> None:
    assert StartBarrier.from_env({}) is None
    b = StartBarrier.from_env({ENV: f"{tmp_path}/a:b/p1:3", TIMEOUT_ENV: "5"})
    assert (b.directory, b.parties, b.timeout_s) == (tmp_path / "a:b" / "p1", 3, 5.0)
    for bad in (str(tmp_path), f"{tmp_path}:x", ":2", f"{tmp_path}:0"):
        with pytest.raises(ConfigError, match=ENV):
            StartBarrier.from_env({ENV: bad})


def _waiter(barrier: StartBarrier, run_id: str, done: dict) -> threading.Thread:
    t = threading.Thread(target=lambda: done.setdefault(run_id, barrier.wait(run_id, say=lambda _: None,
                                                                              poll_s=0.01)))
    t.start()
    return t


def test_no_run_passes_until_every_run_is_ready(tmp_path: Path) -> None:
    done: dict = {}
    threads = [_waiter(StartBarrier(tmp_path, 3), r, done) for r in ("a", "b")]
    for t in threads:
        t.join(0.3)
    assert done == {}  # two of three ready: both still wait
    StartBarrier(tmp_path, 3).wait("c", say=lambda _: None)  # the last one passes at once
    for t in threads:
        t.join(10)
    assert set(done) == {"a", "b"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ready", "b.ready", "c.ready"]


def test_a_run_that_fails_before_it_is_ready_releases_the_others(tmp_path: Path) -> None:
    done: dict = {}
    waiting = _waiter(StartBarrier(tmp_path, 2), "a", done)
    waiting.join(0.2)
    assert done == {}
    failed = StartBarrier(tmp_path, 2)
    failed.leave("b")  # its start raised: it never arrived
    waiting.join(10)
    assert "a" in done and (tmp_path / "b.gone").exists()


def test_leave_after_arriving_marks_nothing_more(tmp_path: Path) -> None:
    b = StartBarrier(tmp_path, 1)
    b.wait("a", say=lambda _: None)
    b.leave("a")
    assert [p.name for p in tmp_path.iterdir()] == ["a.ready"]


def test_a_timeout_goes_on_and_says_so(tmp_path: Path) -> None:
    said: list[str] = []
    StartBarrier(tmp_path, 2, timeout_s=0.1).wait("a", say=said.append, poll_s=0.01)
    assert "1 of 2 runs ready after 0 s; going on without the rest" in said[-1]
