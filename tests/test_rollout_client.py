"""The rollout client's two paths (streamed and whole answers), the raw HTTP path, and the client-ceiling
benchmark against its fake engine. Functional checks only: every figure here is asserted for what it
counts, never for how fast it is (speeds belong in the benchmark's output, not in a test)."""

import json
import time

import pytest

from hybridrl import cli
from hybridrl.engines.base import Completion, stream_flags
from hybridrl.engines.client_ceiling import (
    TPOT_S,
    TTFT_S,
    FakeEngine,
    client_class,
    client_headroom_ok,
    fake_requests,
    measure,
    run_ceiling,
    settings,
    stream_chunks,
)
from hybridrl.engines.raw_http import post_all
from hybridrl.engines.server import free_port
from hybridrl.run.telemetry import Timings, rollout_stats


def test_stream_flags_pick_the_same_evenly_spread_share():
    flags = stream_flags(128, 0.125)
    assert sum(flags) == 16
    assert [i for i, f in enumerate(flags) if f] == list(range(7, 128, 8))  # one in eight, by position
    assert flags == stream_flags(128, 0.125)
    assert not any(stream_flags(10, 0.0)) and all(stream_flags(10, 1.0))
    assert sum(stream_flags(5, 0.5)) == 2


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("per_event", [1, 3])
@pytest.mark.parametrize("shared_pool", [False, True])
def test_client_reads_streamed_and_whole_answers_alike(fmt, per_event, shared_pool):
    requests = fake_requests(8, 7, 0.25)  # requests 3 and 7 streamed
    with FakeEngine(fmt, tokens_per_event=per_event) as server:
        client = client_class(fmt)(server, timeout_s=30, max_concurrency=4, shared_pool=shared_pool)
        out = client.generate(requests)
    assert [c.error for c in out] == [None] * 8
    assert all(len(c.token_ids) == 7 and len(c.logprobs) == 7 for c in out)
    assert [c.streamed for c in out] == [r.stream for r in requests]
    for c in out:
        assert c.finish_reason == "length" and c.latency_s > 0
        if c.streamed:  # events of `per_event` tokens; the last one may be shorter
            assert c.events == -(-7 // per_event) and c.ttft_s > 0
        else:  # one answer: no token timings, no events
            assert c.events == 0 and c.ttft_s != c.ttft_s and c.itl_s == []


def _connections(client) -> list:
    """The open connections of the client's kept one-connection clients (httpcore's pool, one a slot)."""
    return [conn for c in client._kept._clients for conn in c._transport._pool.connections]


def test_the_client_keeps_its_connections_from_one_rollout_to_the_next():
    requests = fake_requests(8, 5, 0.25)
    with FakeEngine("sglang", procs=2) as server:
        fresh = client_class("sglang")(server, timeout_s=30, max_concurrency=4)
        fresh.generate(requests)
        assert _connections(fresh) == []  # without keep_connections each rollout makes its own, as recorded before
        client = client_class("sglang")(server, timeout_s=30, max_concurrency=4, keep_connections=True)
        first = client.generate(requests)
        kept = _connections(client)
        second = client.generate(requests)
        assert len(kept) == 4 and _connections(client) == kept  # the same four, not four new ones
        server.restart()  # the server closed them: each is replaced, and no request fails
        third = client.generate(requests)
        assert len(_connections(client)) == 4 and not set(map(id, _connections(client))) & set(map(id, kept))
        client.close()
        assert _connections(client) == []
        fourth = client.generate(requests)  # closing only drops them: the next rollout opens new ones
    for out in (first, second, third, fourth):
        assert [c.error for c in out] == [None] * 8 and all(len(c.token_ids) == 5 for c in out)


def test_a_rollout_beside_a_running_one_gets_connections_of_its_own():
    import threading

    requests = fake_requests(6, 4, 0.5)
    with FakeEngine("vllm", event_interval_s=0.01) as server:
        client = client_class("vllm")(server, timeout_s=30, max_concurrency=3, keep_connections=True)
        results = {}
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, client.generate(requests)))
                   for k in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        client.close()
    assert sorted(results) == [0, 1]
    for out in results.values():
        assert [c.error for c in out] == [None] * 6 and all(len(c.token_ids) == 4 for c in out)


def test_an_interrupted_rollout_drops_its_connections_and_the_next_one_opens_new_ones():
    requests = fake_requests(6, 3, 0.0)
    with FakeEngine("sglang") as server:
        client = client_class("sglang")(server, timeout_s=30, max_concurrency=3, keep_connections=True)
        client.generate(requests)

        def interrupt() -> None:
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            client.collect(requests, interrupt)
        assert _connections(client) == []
        out = client.generate(requests)
    assert [c.error for c in out] == [None] * 6


def test_whole_and_streamed_answers_give_the_same_tokens():
    """The same fake answer read both ways: a non-streamed parse must not drop or repeat tokens."""
    chunks = stream_chunks("sglang", 5, 2)
    assert len(chunks) == 3 + 2  # three events, [DONE], the chunked end
    with FakeEngine("vllm") as server:
        client = client_class("vllm")(server, timeout_s=30, max_concurrency=2)
        whole, streamed = client.generate(fake_requests(2, 5, 0.5))
    assert whole.token_ids == streamed.token_ids and whole.logprobs == streamed.logprobs


def test_rollout_statistics_time_only_the_streamed_requests():
    streamed = Completion(token_ids=[1] * 5, ttft_s=0.1, itl_s=[0.01] * 4, latency_s=0.5, streamed=True, events=5)
    whole = Completion(token_ids=[1] * 5, latency_s=0.4)
    stats = rollout_stats([streamed, whole], gen_s=1.0)
    assert stats["perf/gen_tokens"] == 10 and stats["perf/throughput"] == pytest.approx(10.0)
    assert stats["perf/streamed_requests"] == 1 and stats["perf/events_per_token"] == pytest.approx(1.0)
    assert stats["perf/ttft_s_mean"] == pytest.approx(0.1)  # the whole answer has no TTFT to count
    assert stats["perf/latency_s_p50"] == pytest.approx(0.45)  # end-to-end latency counts every request
    assert rollout_stats([whole], gen_s=1.0)["perf/events_per_token"] is None


def test_the_engines_own_timing_covers_whole_answers_and_is_absent_without_it():
    timed = [Completion(token_ids=[1] * 5, latency_s=0.4, engine_ttft_s=t, engine_tpot_s=0.01) for t in (0.1, 0.3)]
    untimed = Completion(token_ids=[1] * 5, latency_s=0.4)
    stats = rollout_stats([*timed, untimed], gen_s=1.0)
    assert stats["perf/engine_timed_requests"] == 2 and stats["perf/engine_ttft_s_p50"] == pytest.approx(0.2)
    assert stats["perf/engine_tpot_ms_p50"] == pytest.approx(10.0)
    assert stats["perf/ttft_s_p50"] is None  # nothing streamed: the client timed no first token
    off = rollout_stats([untimed], gen_s=1.0)
    assert off["perf/engine_timed_requests"] == 0 and off["perf/engine_ttft_s_p50"] is None


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_the_client_reads_the_engines_timing_from_whole_answers_and_from_a_streams_last_event(fmt):
    """SGLang puts its stamps on a stream's last token event, vLLM on the usage event after it, which only a
    stream that asks for its usage gets (on the H200 every streamed request came back without either)."""
    with FakeEngine(fmt, tokens_per_event=3) as server:
        out = client_class(fmt)(server, timeout_s=30, max_concurrency=2).generate(fake_requests(2, 7, 0.5))
    assert [c.streamed for c in out] == [False, True]
    for c in out:
        assert c.error is None and len(c.token_ids) == 7 and c.finish_reason == "length"
        assert c.engine_ttft_s == pytest.approx(TTFT_S) and c.engine_tpot_s == pytest.approx(TPOT_S)
    assert out[1].events == 3  # the usage event adds no tokens and no event to the client's count


def test_controller_cpu_of_the_rollout_phase_is_recorded():
    ticks = iter([10.0, 10.5, 20.0, 20.0])  # 0.5 s of this process's CPU in the rollout, none in training
    t = Timings(cpu_reader=lambda: None, own_cpu=lambda: next(ticks))
    with t.phase("gen"):
        time.sleep(0.01)
    cpu = t.record()["host/controller_cpu_pct_gen"]
    assert cpu == pytest.approx(100 * 0.5 / t.s["gen"])
    with t.phase("update_actor"):
        pass
    assert "update_actor" not in t.own  # only the rollout's client load is recorded
    assert Timings().record()["host/controller_cpu_pct_gen"] is None  # no rollout, no reading


def test_raw_path_posts_whole_requests_and_names_failures():
    bodies = [{"prompt": [1], "max_tokens": 4, "stream": False}] * 3
    with FakeEngine("vllm") as server:
        answers = post_all(server.base_url, "/v1/completions", bodies, concurrency=2, timeout_s=30)
        parsed = [client_class("vllm")(server, 30, 1).completion(a, t) for t, a in answers]
    assert [len(c.token_ids) for c in parsed] == [4, 4, 4]
    [(_, refused)] = post_all(f"http://127.0.0.1:{free_port()}", "/v1/completions", bodies[:1], 1, 5)
    assert isinstance(refused, str) and "Connection" in refused


def test_engine_generate_raw_bypasses_the_rollout_client(tmp_path):
    from hybridrl.engines.vllm import VLLMServer
    from hybridrl.study.run_config import RunConfig

    eng = VLLMServer(tmp_path, RunConfig(model="m", device="cpu"), {}, tmp_path)
    with FakeEngine("vllm") as server:
        eng.server = server
        eng.stream = client_class("vllm")(server, timeout_s=30, max_concurrency=2)
        out = eng.generate_raw(fake_requests(3, 6, 1.0))  # asked streamed, sent whole all the same
    assert [(len(c.token_ids), c.streamed, c.error) for c in out] == [(6, False, None)] * 3


def test_control_calls_go_over_one_kept_connection_with_keep_connections(tmp_path):
    from hybridrl.engines.vllm import VLLMServer
    from hybridrl.study.run_config import RunConfig

    eng = VLLMServer(tmp_path, RunConfig(model="m", device="cpu", keep_connections=True), {}, tmp_path)
    with FakeEngine("vllm") as server:
        eng.server = server
        assert eng._post("/health", method="GET").text == "ok"
        kept = list(eng._control._transport._pool.connections)
        assert eng._post("/health", method="GET").text == "ok"
        assert len(kept) == 1 and list(eng._control._transport._pool.connections) == kept  # the same one
        eng.server = None  # the fake is not a ServerProcess: stop only what the engine opened
        eng.stop()
        assert eng._control is None
    plain = VLLMServer(tmp_path, RunConfig(model="m", device="cpu"), {}, tmp_path)
    with FakeEngine("vllm") as server:
        plain.server = server
        assert plain._post("/health", method="GET").text == "ok" and plain._control is None  # a client a call


def test_ceiling_benchmark_parses_every_event():
    r = measure("sglang", requests=8, tokens=16, concurrency=8, stream_fraction=1.0, seconds=0.0)
    assert r["batches"] == 1 and r["streamed_requests"] == 8
    assert r["events_s"] == pytest.approx(r["ceiling_tok_s"])  # one event per token, all of them counted
    r = measure("vllm", requests=8, tokens=16, concurrency=4, stream_fraction=0.0, seconds=0.0)
    assert r["events_s"] == 0 and r["ceiling_tok_s"] > 0


def test_ceiling_benchmark_refuses_answers_not_parsed_whole():
    from hybridrl.engines.client_ceiling import _check

    whole = Completion(token_ids=[1] * 4, logprobs=[0.0] * 4)
    _check([whole], 4)
    lost = Completion(token_ids=[1] * 3, logprobs=[0.0] * 3)  # one event's token lost on the way
    with pytest.raises(RuntimeError, match="fake request 1: 3 of 4 tokens parsed"):
        _check([whole, lost], 4)
    with pytest.raises(RuntimeError, match="fake request 0: HTTP 500"):
        _check([Completion(error="HTTP 500")], 4)


def test_client_headroom_flag():
    assert client_headroom_ok(7_000.0, 10_000.0) is True
    assert client_headroom_ok(8_000.0, 10_000.0) is False  # within 80% of the ceiling
    assert client_headroom_ok(None, 10_000.0) is None and client_headroom_ok(5.0, None) is None


def test_run_ceiling_only_for_http_engines():
    assert run_ceiling("vllm-inprocess", 8, 8, 8, 0.5, 1.0) is None
    assert run_ceiling("vllm", 8, 8, 8, 0.5, 0.0) is None  # 0 s: skipped
    assert run_ceiling("vllm", 4, 8, 4, 0.5, 0.01) > 0


def test_settings_skip_granularity_where_nothing_streams():
    assert settings([1.0, 0.0], [1, 20], False) == [(1.0, 1, False), (1.0, 20, False), (0.0, 1, False)]
    assert settings([0.0], [1, 20], True) == [(1.0, 1, True), (1.0, 20, True), (0.0, 1, False)]


def test_client_ceiling_command_writes_every_setting(tmp_path):
    out = tmp_path / "ceiling.json"
    cli.main(["client-ceiling", "--format", "vllm", "--requests", "4", "--tokens", "8", "--concurrency", "4",
              "--stream-fraction", "1", "0", "--tokens-per-event", "1", "--seconds", "0", "--out", str(out)])
    rows = json.loads(out.read_text())["settings"]
    assert [(r["stream_fraction"], r["client"]) for r in rows] == [
        (1.0, "old (one shared pool)"), (1.0, "new (a connection per slot)"), (0.0, "new (a connection per slot)")]
    assert all(r["ceiling_tok_s"] > 0 for r in rows)


def test_bench_measures_every_path_on_one_engine_start(tmp_path, monkeypatch):
    """bench's four paths, interleaved, against the fake engine standing in for a vLLM server."""
    import yaml

    from hybridrl.engines.vllm import VLLMServer
    from hybridrl.study import models
    from hybridrl.study.config import REPO, resolve
    from hybridrl.study.run_config import RunSpec
    from hybridrl.task import data
    from hybridrl.tools import engine_bench as bench

    data.write_synthetic(tmp_path / "data", 32, 4, seed=0)
    spec = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    cold = {k: v for k, v in spec["models"]["tiny-qwen3"].items() if k != "warm_start"}
    models.build_random(cold, tmp_path / "data" / "train.jsonl", tmp_path / "model")
    spec["defaults"].update({"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 5, "stream_fraction": 0.25})
    spec["runs"] = [{"placement": "split"}]
    [(run_id, run)] = resolve(spec).runs.items()
    starts = []

    class OnFakeEngine(VLLMServer):
        def start(self, adapter=None):
            starts.append(adapter)
            self.server = fake
            self.stream = self.stream_cls(fake, 30, self.run.max_concurrency)
            return 0.0

        def stop(self):
            self.server = None

        def flush_cache(self):
            pass

    envs = []
    monkeypatch.setattr(bench, "make_engine",
                        lambda run, model, env, logs: envs.append(env) or OnFakeEngine(model, run, env, logs))
    with FakeEngine("vllm") as fake:
        result = bench.run_bench(RunSpec(run_id=run_id, run=run, study="s"), tmp_path / "model", tmp_path / "data",
                                 tmp_path / "run", step=1, repeats=2, log_dir=tmp_path / "logs")
        chosen = bench.run_bench(RunSpec(run_id=run_id, run=run, study="s"), tmp_path / "model", tmp_path / "data",
                                 tmp_path / "run", step=1, repeats=2, log_dir=tmp_path / "logs",
                                 paths=("raw", "client"))
    assert [r["path"] for r in chosen["repeats"]] == ["raw", "client", "client", "raw"]
    assert set(chosen["tok_s_median"]) == {"raw", "client"}
    starts.pop()  # the chosen-paths bench's own start
    assert starts == [None]  # one engine start for every pass; step 1 rolls out the base model
    assert [(r["repeat"], r["path"]) for r in result["repeats"]] == [
        (0, "raw"), (0, "client"), (0, "whole"), (0, "stream_all"), (0, "old_client"),
        (1, "client"), (1, "whole"), (1, "stream_all"), (1, "old_client"), (1, "raw")]  # the order rotates
    streamed = {r["path"]: r["perf/streamed_requests"] for r in result["repeats"]}
    assert streamed == {"raw": 0, "client": 2, "whole": 0, "stream_all": 8, "old_client": 8}
    assert all(r["perf/gen_tokens"] == 8 * 5 and r["errors/requests_failed"] == 0 for r in result["repeats"])
    assert result["over_raw"]["raw"] == 1.0 and result["in_loop_over_raw"] is None  # no run recorded here
    # the engine on the cores its run gave it, so that the run's in-loop throughput compares with its raw one
    from hybridrl.run.cores import job_cores, split_cores

    assert result["cores"] == split_cores(run, job_cores()).record()
    assert envs[0]["env"] == {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, result["cores"]["engine_pool"]))}


@pytest.mark.parametrize("argv,said", [
    (["client-ceiling", "--seconds", "-1"], "argument --seconds: must be 0 seconds or more, got -1"),
    (["client-ceiling", "--stream-fraction", "1", "2"], "argument --stream-fraction: must be from 0 to 1, got 2"),
    (["client-ceiling", "--procs", "0"], "argument --procs: must be at least 1, got 0"),
    (["client-ceiling", "--tokens-per-event", "x"], "argument --tokens-per-event: 'x' is not a whole number"),
    (["bench-parse", "--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["bench", "--run-config", "c.json", "--model", "m", "--data", "d", "--run-dir", "r", "--out", "o.json",
      "--step", "0"], "argument --step: must be at least 1, got 0"),
    (["fault-run", "--term-at", "-1", "--", "true"], "argument --term-at: must be at least 1, got -1"),
])
def test_the_measuring_tools_refuse_counts_and_shares_that_measure_nothing(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
