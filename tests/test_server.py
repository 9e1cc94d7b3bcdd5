"""The process plumbing around engine servers, exercised with small real processes (no engine)."""

import os
import socket
import sys
import time

import httpx
import pytest

from hybridrl.engines import server
from hybridrl.engines.base import Completion, EngineError
from hybridrl.engines.server import ServerProcess, first_error_line, free_port, log_tail, port_in_use

# a tiny HTTP server that forks a grandchild, like engines that spawn workers
SERVE = """
import http.server, os, sys, time
port = int(sys.argv[1])
if os.fork() == 0:
    time.sleep(3600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _group_alive(pgid: int) -> bool:
    """Any process of the group that is not a zombie (an unreaped zombie holds no resources)."""
    for stat in os.listdir("/proc"):
        if not stat.isdigit():
            continue
        try:
            fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_start_health_and_stop_leaves_no_process(tmp_path):
    port = free_port()
    srv = ServerProcess("toy", [sys.executable, "-c", SERVE, str(port)], dict(os.environ), tmp_path / "s.log", port)
    srv.start()
    pgid = srv.proc.pid
    assert srv.wait_healthy(30) >= 0
    assert httpx.get(srv.base_url + "/health").text == "ok"
    srv.stop()
    deadline = time.monotonic() + 10  # the forked grandchild is not waited for: it is given time to be reaped
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group_alive(pgid)  # it went with the server
    assert not srv.alive()


def test_failed_start_reports_log_tail_and_cleans_up(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; print('CUDA out of memory: tried to allocate'); sys.exit(3)"]
    srv = ServerProcess("toy", cmd, dict(os.environ), tmp_path / "s.log", port)
    srv.start()
    with pytest.raises(EngineError, match=r"exited with code 3 while starting(.|\n)*CUDA out of memory"):
        srv.wait_healthy(30)
    assert srv.proc is None


def test_start_timeout_stops_the_server(tmp_path):
    port = free_port()
    srv = ServerProcess("toy", [sys.executable, "-c", "import time; print('loading'); time.sleep(60)"],
                        dict(os.environ), tmp_path / "s.log", port)
    srv.start()
    pgid = srv.proc.pid
    with pytest.raises(EngineError, match=r"not healthy after 2 s(.|\n)*loading"):
        srv.wait_healthy(2)
    assert not _group_alive(pgid)


HANGS_AFTER_FAILING = """
import sys, time
print("loading weights", flush=True)
print("(EngineCore pid=7) ERROR [core.py:1] EngineCore failed to start.", flush=True)
print("RuntimeError: Worker failed with error 'CUDA error: CUBLAS_STATUS_INTERNAL_ERROR'", flush=True)
time.sleep(120)  # its teardown hangs; the process never exits by itself
"""


def test_a_server_that_fails_to_start_but_hangs_is_stopped_after_a_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "FATAL_GRACE_S", 1.0)
    log = tmp_path / "s.log"
    # an earlier start of the same log: neither its marker nor its error belongs to this start
    log.write_text("EngineCore failed to start.\nOSError: the earlier start's error\n")
    srv = ServerProcess("toy", [sys.executable, "-c", HANGS_AFTER_FAILING], dict(os.environ), log, free_port(),
                        fatal_markers=("EngineCore failed to start",))
    srv.start()
    pgid = srv.proc.pid
    with pytest.raises(EngineError, match=r"failed while starting \('EngineCore failed to start' in its log\)"
                                          r"(.|\n)*first error: RuntimeError: Worker failed"):
        srv.wait_healthy(60)  # without the marker this would end in "not healthy after 60 s"
    assert not _group_alive(pgid)


def test_an_old_fatal_line_in_an_appended_log_does_not_stop_a_new_start(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "FATAL_GRACE_S", 0.0)
    log = tmp_path / "s.log"
    log.write_text("EngineCore failed to start.\n")
    port = free_port()
    srv = ServerProcess("toy", [sys.executable, "-c", SERVE, str(port)], dict(os.environ), log, port,
                        fatal_markers=("EngineCore failed to start",))
    srv.start()
    try:
        assert srv.wait_healthy(30) >= 0
    finally:
        srv.stop()


# an OpenAI-style completions stream whose token texts hold characters that str.splitlines() splits at
STREAM = r"""
import http.server, json, sys
port = int(sys.argv[1])
TEXTS = ["a\u0085b", "c\u2028d", "e\u2029f", "g"]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        for i, text in enumerate(TEXTS):
            choice = {"text": text, "finish_reason": "length" if i == len(TEXTS) - 1 else None,
                      "logprobs": {"tokens": [f"token_id:{100 + i}"], "token_logprobs": [-0.5 * i]}}
            event = json.dumps({"choices": [choice]}, ensure_ascii=False)  # as the engines send it
            self.wfile.write(f"data: {event}\r\n\r\n".encode()); self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_stream_events_are_split_at_line_feeds_only(tmp_path):
    from hybridrl.engines.base import Request, Sampling
    from hybridrl.engines.vllm import _VLLMClient

    port = free_port()
    srv = ServerProcess("toy", [sys.executable, "-c", STREAM, str(port)], dict(os.environ), tmp_path / "s.log", port)
    srv.start()
    try:
        srv.wait_healthy(30)
        stream = _VLLMClient(srv, timeout_s=30, max_concurrency=1)
        [out] = stream.generate([Request([1, 2], Sampling(max_new_tokens=4), stream=True)])
    finally:
        srv.stop()
    assert out.error is None
    assert out.token_ids == [100, 101, 102, 103]
    assert out.logprobs == [0.0, -0.5, -1.0, -1.5]
    assert out.finish_reason == "length"


def test_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_in_use(port)
        srv = ServerProcess("toy", [sys.executable, "-c", "pass"], dict(os.environ), tmp_path / "s.log", port)
        with pytest.raises(EngineError, match=f"port {port} on 127.0.0.1 is already in use"):
            srv.start()


def test_missing_executable_is_a_clear_error(tmp_path):
    srv = ServerProcess("toy", [str(tmp_path / "no-python")], dict(os.environ), tmp_path / "s.log", free_port())
    with pytest.raises(EngineError, match="cannot execute"):
        srv.start()


def test_log_tail(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("\n".join(f"line {i}" for i in range(100)))
    tail = log_tail(log, 3)
    assert tail == "line 97\nline 98\nline 99"
    assert "no log" in log_tail(tmp_path / "missing.log")


def test_engine_environment_drops_thread_caps_and_pythonpath(monkeypatch):
    from hybridrl.engines.server import engine_environ

    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # what Snakemake sets for a job with threads: 2
    monkeypatch.setenv("PYTHONPATH", "/controller/src")
    monkeypatch.setenv("HF_HOME", "/keep/me")
    env = engine_environ()
    assert "OMP_NUM_THREADS" not in env and "PYTHONPATH" not in env
    assert env["HF_HOME"] == "/keep/me"


def test_first_error_line_finds_the_root_cause_not_warnings(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text(
        "(APIServer) WARNING [utils.py:1] ulimit too low; can cause `OSError: [Errno 24] Too many open files`\n"
        "(Worker) ERROR [executor.py:9] Traceback (most recent call last):\n"
        "(Worker) ERROR [executor.py:9] AttributeError: module 'triton.language' has no attribute 'float32'\n"
        "(EngineCore) ERROR [core.py:1] RuntimeError: Worker failed with error\n")
    assert first_error_line(log).endswith("AttributeError: module 'triton.language' has no attribute 'float32'")
    log.write_text("INFO all fine\n")
    assert first_error_line(log) is None and first_error_line(tmp_path / "missing.log") is None


def test_first_error_line_reads_only_this_starts_part_of_an_appended_log(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("RuntimeError: an earlier start's shutdown noise\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("loading\nValueError: this start's root cause\n")
    assert first_error_line(log) == "RuntimeError: an earlier start's shutdown noise"
    assert first_error_line(log, start) == "ValueError: this start's root cause"


# -- ports: jobs on one node share its network namespace, so no two engines may meet on one ----------------------
class ToyEngine(server.HTTPEngine):
    """An HTTP engine whose server is SERVE, with an NCCL port of its own as SGLang has."""

    name = "toy"
    own_ports = ("nccl",)

    def command(self, port, adapter):
        return [sys.executable, "-c", SERVE, str(port)]

    def environment(self):
        return dict(os.environ)

    def generate(self, requests, progress=False, shared_pool=False):
        return [Completion() for _ in requests]  # the warm-up request, answered


def _toy(log_dir) -> ToyEngine:
    from hybridrl.study.run_config import RunConfig

    run = RunConfig.model_validate({"engine": "vllm", "placement": "split", "device": "cpu", "model": "m",
                                    "startup_timeout_s": 30})
    return ToyEngine(log_dir / "model", run, {}, log_dir)


def test_engines_started_side_by_side_take_distinct_ports_and_tell_each_start(tmp_path):
    told: list[dict[str, int]] = []
    a, b = _toy(tmp_path / "a"), _toy(tmp_path / "b")
    a.on_ports = b.on_ports = told.append
    try:
        a.start()
        b.start()  # while a's server listens and a holds its NCCL port's claim
        assert set(a.ports) == set(b.ports) == {"engine_http", "nccl"}
        assert len({*a.ports.values(), *b.ports.values()}) == 4
        assert told == [a.ports, b.ports]
        a.stop()
        a.start()  # every start takes ports afresh and says so
        assert len(told) == 3 and told[-1] == a.ports
        assert not set(a.ports.values()) & set(b.ports.values())
    finally:
        a.stop()
        b.stop()


SGLANG_LIKE = """
import http.server, sys, time
port, weights = int(sys.argv[1]), sys.argv[2]
def log(text):
    print(time.strftime("[%Y-%m-%d %H:%M:%S] ") + text, flush=True)
log("Load weight begin. avail mem=1 GB")
log(f"Load weight end. elapsed={weights} s, type=Toy")
log("Memory pool end. avail mem=1 GB")
log("Capture cuda graph end. elapsed=1.25 s, mem usage=0.1 GB")
log("INFO:     Uvicorn running on http://127.0.0.1")
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


class SGLangLike(ToyEngine):
    """Logs SGLang's start-up lines, its weights' seconds given at each start."""

    name = "sglang"
    weights = ["0.9", "0.3"]

    def command(self, port, adapter):
        return [sys.executable, "-c", SGLANG_LIKE, str(port), self.weights[len(self.start_parts)]]


def test_each_start_is_split_from_its_own_part_of_the_log_and_the_controllers_instants(tmp_path):
    engine = SGLangLike(tmp_path / "model", _toy(tmp_path).run, {}, tmp_path)
    try:
        engine.start()
        engine.stop()
        engine.start()  # appends to the same log
    finally:
        engine.stop()
    first, second = engine.start_parts
    assert (first["weights"], second["weights"]) == (0.9, 0.3)  # each start read from its own header on
    for split in (first, second):
        assert split["graphs"] == 1.25 and split["kv"] is not None and split["import"] is not None
        assert split["ready"] is not None and split["first_request"] is not None  # the controller's instants
        assert split["total"] >= split["first_request"] > 0
        found = sum(split[p] for p in ("import", "weights", "kv", "graphs", "ready", "first_request"))
        rest = split["total"] - found  # the stamps' one-second rounding may pass the whole by a second a part
        assert rest > -6 and split["unexplained"] == pytest.approx(max(rest, 0.0))
    assert (tmp_path / "engine.log").read_text().count("==== ") == 2


def test_free_ports_taken_at_once_differ():
    for _ in range(20):
        ports = server.free_ports(8)
        assert len(set(ports)) == 8


CLAIMER = """
import sys
from hybridrl.engines.server import PortClaims
claims = PortClaims(2)
print(*claims.ports, flush=True)
sys.stdin.read()
"""


def test_a_port_another_job_has_claimed_is_drawn_again_until_that_job_ends(tmp_path, monkeypatch):
    import subprocess
    from pathlib import Path

    src = str(Path(server.__file__).resolve().parents[2])
    other = subprocess.Popen([sys.executable, "-c", CLAIMER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": src})
    try:
        taken = [int(p) for p in other.stdout.readline().split()]
        assert len(taken) == 2
        real = server.free_ports
        draws = iter([[taken[0]], [taken[1]]])  # the kernel hands out the other job's ports first
        monkeypatch.setattr(server, "free_ports", lambda n: next(draws, None) or real(n))
        mine = server.PortClaims(1)
        assert mine.ports and mine.ports[0] not in taken
        mine.release()
    finally:
        other.stdin.close()
        other.wait(10)
    monkeypatch.setattr(server, "free_ports", lambda n: [taken[0]])
    held = server.PortClaims(1, draws=1)
    assert held.ports == [taken[0]]  # its claims ended with it
    with pytest.raises(EngineError, match="found no 1 free port"):
        server.PortClaims(1, draws=1)  # held here now: the one port drawn is never free
    held.release()
