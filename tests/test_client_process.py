"""The rollout client in a worker process (rollout_process): the same answers as in the controller's thread, the
engine's death and the worker's death each named, and the worker ended with the engine."""

import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from hybridrl.engines.base import EngineError
from hybridrl.engines.client_ceiling import FakeEngine, client_class, fake_requests
from hybridrl.engines.client_process import ClientProcess
from hybridrl.engines.vllm import VLLMServer
from hybridrl.study.run_config import RunConfig


def _fields(c):
    return c.error, c.token_ids, c.logprobs, c.finish_reason, c.streamed, c.events, c.engine_ttft_s


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_the_worker_returns_what_the_thread_returns(fmt):
    requests = fake_requests(8, 7, 0.25)  # two streamed, six whole
    worker = ClientProcess()
    try:
        with FakeEngine(fmt, tokens_per_event=2) as server:
            client = client_class(fmt)(server, timeout_s=30, max_concurrency=4)
            here = client.collect(requests)
            there = worker.collect(client, requests)
            again = worker.collect(client, requests)  # the same worker serves the next batch
    finally:
        worker.close()
    assert [_fields(c) for c in there] == [_fields(c) for c in here] == [_fields(c) for c in again]
    assert [c.error for c in there] == [None] * 8 and sum(c.streamed for c in there) == 2
    assert all(c.latency_s > 0 for c in there)
    assert all(c.ttft_s > 0 for c in there if c.streamed)  # timed in the worker, on its own clock


def _engine(tmp_path: Path, fake: FakeEngine, **over) -> VLLMServer:
    """A vLLM server engine whose client points at the fake engine, as start() would leave it."""
    run = RunConfig.model_validate({"engine": "vllm", "model": "m", "max_concurrency": 4, **over})
    engine = VLLMServer(tmp_path, run, {}, tmp_path)
    engine.server = fake
    engine.stream = client_class("vllm")(fake, timeout_s=30, max_concurrency=4)
    return engine


def test_the_engine_sends_its_rollouts_through_the_worker_only_when_asked(tmp_path):
    requests = fake_requests(4, 5, 0.5)
    with FakeEngine("vllm") as fake:
        plain, moved = _engine(tmp_path, fake), _engine(tmp_path, fake, rollout_process=True)
        assert plain._client_process is None
        out = moved.generate(requests)
        assert moved._client_process._pool is not None  # the worker ran them
        assert [_fields(c) for c in out] == [_fields(c) for c in plain.generate(requests)]
        moved._client_process.close()


def test_an_engine_that_died_during_a_moved_rollout_is_named(tmp_path):
    with FakeEngine("vllm") as fake:
        engine = _engine(tmp_path, fake, rollout_process=True)
        fake.log_path = tmp_path / "engine.log"
        fake.log_path.write_text("the engine's last words\n")
        for p in fake._procs:
            p.kill()
            p.wait()
        fake._sock.close()  # connections are refused, as by a dead server's port
        with pytest.raises(EngineError, match="(?s)fake-engine died during the rollout.*the engine's last words"):
            engine.generate(fake_requests(2, 3, 0.0))
        engine._client_process.close()


def test_a_worker_that_dies_mid_batch_is_an_engine_error_and_the_next_batch_gets_a_new_one():
    worker = ClientProcess()
    with FakeEngine("vllm", event_interval_s=0.05) as server:  # each answer takes 20 x 0.05 s
        client = client_class("vllm")(server, timeout_s=30, max_concurrency=2)
        errors: list[BaseException] = []

        def batch() -> None:
            try:
                worker.collect(client, fake_requests(2, 20, 0.0))
            except EngineError as exc:
                errors.append(exc)

        t = threading.Thread(target=batch)
        t.start()
        while worker._pool is None or not worker._pool._processes:
            time.sleep(0.01)
        time.sleep(0.2)
        for proc in list(worker._pool._processes.values()):
            proc.kill()
        t.join(timeout=30)
        assert len(errors) == 1 and "rollout client's process (rollout_process) died" in str(errors[0])
        out = worker.collect(client, fake_requests(1, 2, 0.0))
        assert out[0].error is None and len(out[0].token_ids) == 2
    worker.close()


class _FakeServerProcess:
    """ServerProcess's part that start() and stop() use, over the fake engine instead of a real server."""

    def __init__(self, name, cmd, env, log_path, port, fatal_markers=()) -> None:
        self.name, self.log_path, self.log_start = name, log_path, 0
        self.spawned_at = datetime.now()
        self._fake = FakeEngine("vllm")

    def log_since_start(self) -> str:
        return ""  # the fake engine writes no log: every part of its start reads as unknown

    def start(self) -> None:
        self._fake.__enter__()

    def wait_healthy(self, timeout_s: float, health_path: str = "/health") -> float:
        return 0.0

    @property
    def base_url(self) -> str:
        return self._fake.base_url

    def alive(self) -> bool:
        return self._fake.alive()

    def stop(self, grace_s: float = 20.0) -> None:
        self._fake.__exit__(None, None, None)


def test_the_worker_starts_with_the_engines_warm_up_and_ends_with_the_engine(tmp_path, monkeypatch):
    from hybridrl.engines import server

    monkeypatch.setattr(server, "ServerProcess", _FakeServerProcess)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 4096, "dtype": "bfloat16"}')
    run = RunConfig.model_validate({"engine": "vllm", "model": "m", "max_concurrency": 4, "rollout_process": True})
    engine = VLLMServer(model, run, {}, tmp_path)
    engine.start()
    try:
        assert engine._client_process._pool is not None  # the warm-up request went through the worker
        assert engine.generate(fake_requests(2, 3, 0.5))[1].streamed
    finally:
        engine.stop()
    assert engine._client_process._pool is None and engine.server is None
