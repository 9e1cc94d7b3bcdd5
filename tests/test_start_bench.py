"""start-bench: a run's engine started through hybridrl against its own command line, alternated, the cold start of
each path kept apart. The engines here are stand-ins (a tiny HTTP server for the command line); the orchestration,
timing, process cleanup and result are what is tested."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hybridrl.study.run_config import RunConfig
from hybridrl.tools import start_bench

SERVER = textwrap.dedent("""
    import http.server, sys, time
    time.sleep(float(sys.argv[2]))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


class FakeEngine:
    """What start-bench calls of an engine class: start/stop for hybridrl's path, command/environment for the
    command line's."""

    def __init__(self, name: str, delay_s: float, log: list[str]) -> None:
        self.name, self.delay_s, self.log = name, delay_s, log

    def start(self) -> float:
        self.log.append("start")
        time.sleep(self.delay_s)
        return self.delay_s

    def stop(self) -> None:
        self.log.append("stop")

    def command(self, port: int, adapter: object) -> list[str]:
        return [sys.executable, "-c", SERVER, str(port), "0.3"]

    def environment(self) -> dict[str, str]:
        return dict(os.environ)


def test_the_paths_alternate_a_b_b_a_and_each_cold_start_is_left_out_of_the_median(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch):
    calls: list[str] = []
    made: list[str] = []

    def make(run: RunConfig, model_dir: Path, env_spec: dict, log_dir: Path) -> FakeEngine:
        made.append(run.engine)
        return FakeEngine(run.engine, 0.05, calls)

    monkeypatch.setattr(start_bench, "make_engine", make)
    run = RunConfig(engine="vllm-inprocess", device="cpu", model="m", placement="colocate", trainer="hf")
    out = tmp_path / "start.json"
    report = start_bench.main("r", run, tmp_path / "model", {}, out, tmp_path / "logs", repeats=2, timeout_s=30)
    assert made == ["vllm-inprocess", "vllm"]  # in-process vLLM is held against the vLLM server's command line
    assert [s["path"] for s in report["starts"]] == ["hybridrl", "cli", "cli", "hybridrl"]
    assert calls == ["start", "stop", "start", "stop"]  # hybridrl's engine is stopped after each start
    cli = [s["start_s"] for s in report["starts"] if s["path"] == "cli"]
    assert all(0.3 <= s < 10 for s in cli)  # the server answers after its 0.3 s
    assert report["cli_s_median"] == cli[1] and report["over_cli"] == pytest.approx(
        report["hybridrl_s_median"] / cli[1])
    assert json.loads(out.read_text())["starts"][1]["command"][0] == sys.executable


def test_a_command_line_that_dies_before_it_answers_is_named(tmp_path: Path):
    with pytest.raises(RuntimeError, match="exited with code 3 before it answered"):
        start_bench.start_cli([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), 1,
                              tmp_path / "engine.log", timeout_s=30)


def test_the_command_lines_whole_process_group_is_stopped(tmp_path: Path):
    """A server that forks a worker: both are gone once the start is timed."""
    pid_file = tmp_path / "child.pid"
    script = SERVER.replace("time.sleep(float(sys.argv[2]))",
                            "import subprocess; p = subprocess.Popen([sys.executable, '-c', 'import time; "
                            f"time.sleep(600)']); open({str(pid_file)!r}, 'w').write(str(p.pid))")
    port = start_bench.free_port()
    start_bench.start_cli([sys.executable, "-c", script, str(port), "0"], dict(os.environ), port,
                          tmp_path / "engine.log", timeout_s=30)
    child = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the command line's worker {child} outlived its start")


def test_in_process_vllm_s_command_line_runs_on_the_path_it_was_imported_from(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    """A server's environment drops the controller's PYTHONPATH for its own overlay; in-process vLLM has none but
    the controller's, so its command line keeps it (on the lease, vLLM was found only there)."""
    specs: list[dict] = []
    monkeypatch.setattr(start_bench, "make_engine", lambda run, m, spec, d: specs.append(spec) or run.engine)
    monkeypatch.setenv("PYTHONPATH", "/tmp/envs/vllm:src")
    inprocess = RunConfig(engine="vllm-inprocess", device="cpu", model="m", placement="colocate", trainer="hf")
    assert start_bench.cli_engine(inprocess, tmp_path, {"python": "python3"}, tmp_path) == "vllm"
    assert specs[-1] == {"python": "python3", "env": {"PYTHONPATH": "/tmp/envs/vllm:src"}}
    server = inprocess.model_copy(update={"engine": "vllm"})
    start_bench.cli_engine(server, tmp_path, {"python": "p", "env": {"PYTHONPATH": "/o"}}, tmp_path)
    assert specs[-1] == {"python": "p", "env": {"PYTHONPATH": "/o"}}  # a server keeps its own


def test_a_failed_start_keeps_the_starts_before_it_beside_the_output(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    class Dying(FakeEngine):
        def command(self, port: int, adapter: object) -> list[str]:
            return [sys.executable, "-c", "raise SystemExit(1)"]

    monkeypatch.setattr(start_bench, "make_engine", lambda run, m, spec, d: Dying(run.engine, 0.01, []))
    run = RunConfig(engine="vllm", device="cpu", model="m", placement="colocate", trainer="hf")
    out = tmp_path / "start.json"
    with pytest.raises(RuntimeError, match="exited with code 1"):
        start_bench.main("r", run, tmp_path / "model", {}, out, tmp_path / "logs", repeats=2, timeout_s=30)
    assert not out.exists()
    kept = json.loads((tmp_path / "start.partial.json").read_text())
    assert [s["path"] for s in kept["starts"]] == ["hybridrl"] and "exited with code 1" in kept["error"]


def _record(bench: Path, starts: list[tuple[str, float]]) -> None:
    bench.mkdir(exist_ok=True)
    (bench / "start-x.json").write_text(json.dumps({
        "run_id": "x-1", "engine": "vllm-inprocess", "cli_engine": "vllm",
        "starts": [{"i": i, "path": p, "start_s": s} for i, (p, s) in enumerate(starts, 1)]}))
    (bench / "start-x.slurm.json").write_text("{}")  # the job record beside it is no start-bench record


def test_the_reports_table_keeps_first_starts_apart_and_judges_only_with_an_interval(tmp_path: Path) -> None:
    from hybridrl.report import start_bench as section
    from hybridrl.report import targets

    bound = targets.Target(name="1.3x", metric=targets.START_OVER_CLI, at_most=1.3)
    _record(tmp_path, [("hybridrl", 50.0), ("cli", 150.0), ("cli", 70.0), ("hybridrl", 35.0)])
    row = section.table(tmp_path, [bound]).rows[0]
    assert [c.text for c in row[1:6]] == ["50.00", "150.0", "35.00", "70.00", "0.50x (1 start a side, no interval)"]
    assert [c.text for c in row[6:]] == ["1.3x", "start/over_cli ≤ 1.3", "not settled: no interval"]
    later = [("hybridrl", 60.0 + i) if i % 2 else ("cli", 20.0 + i) for i in range(8)]
    _record(tmp_path, [("hybridrl", 50.0), ("cli", 150.0), *later])
    assert section.table(tmp_path, [bound]).rows[0][8].text == "missed"  # 3x its command line, every start
    _record(tmp_path, [("hybridrl", 50.0), ("hybridrl", 40.0)])
    with pytest.raises(ValueError, match="start-x.json: a path without a start"):
        section.table(tmp_path, [bound])
    assert section.table(tmp_path / "none", [bound]) is None
