import json
import math

import pytest

from hybridrl.engines.base import Completion
from hybridrl.run.telemetry import MemorySampler, Timings, append_record, read_records, rollout_stats


def test_rollout_stats_counts_tokens_failures_and_percentiles():
    done = [Completion(token_ids=[1] * n, logprobs=[0.0] * n, ttft_s=t, itl_s=[0.01] * (n - 1), latency_s=t + 1)
            for n, t in ((10, 0.1), (20, 0.2), (30, 0.3))]
    failed = Completion(token_ids=[1, 2], error="HTTP 500")
    stats = rollout_stats(done + [failed], gen_s=2.0)
    assert stats["perf/gen_tokens"] == 60  # failed requests' partial tokens do not count
    assert stats["perf/throughput"] == pytest.approx(30.0)
    assert stats["errors/requests_failed"] == 1
    assert stats["perf/ttft_s_p50"] == pytest.approx(0.2)
    assert stats["perf/ttft_s_mean"] == pytest.approx(0.2)
    assert stats["perf/itl_ms_p99"] == pytest.approx(10.0)
    assert stats["perf/latency_s_p99"] == pytest.approx(1.298, abs=1e-3)
    assert stats["perf/tpot_ms_p50"] == pytest.approx(1000 / 19)  # (latency - ttft) / (n - 1)
    assert stats["response_length/mean"] == pytest.approx(20.0)


def test_itl_is_per_token_for_bursts():
    c = Completion()
    c.add_tokens([1], [0.0], now=0.10, sent_at=0.0)
    c.add_tokens([2, 3, 4, 5], [0.0] * 4, now=0.14, sent_at=0.0)  # 4 tokens after 40 ms
    assert c.ttft_s == pytest.approx(0.10)
    assert c.itl_s == pytest.approx([0.01] * 4)
    c.add_tokens([], [], now=0.5, sent_at=0.0)  # an event with no token changes nothing
    c.add_tokens([6], [0.0], now=0.16, sent_at=0.0)
    assert c.itl_s == pytest.approx([0.01] * 4 + [0.02])
    assert rollout_stats([c], gen_s=1.0)["perf/itl_ms_mean"] == pytest.approx(12.0)


def test_tokens_of_the_first_event_add_no_gap():
    c = Completion()
    c.add_tokens([1, 2, 3], [0.0] * 3, now=0.2, sent_at=0.0)
    assert c.ttft_s == pytest.approx(0.2) and c.itl_s == []


def test_tpot_per_request():
    c = Completion(token_ids=[1] * 11, ttft_s=0.2, latency_s=0.7)
    assert c.tpot_s == pytest.approx(0.05)  # (0.7 - 0.2) / (11 - 1)
    assert Completion(token_ids=[1], ttft_s=0.2, latency_s=0.2).tpot_s is None
    assert Completion(token_ids=[1, 2], ttft_s=0.2).tpot_s is None  # no latency: the stream never ended

    slow = Completion(token_ids=[1] * 3, ttft_s=0.1, latency_s=0.5)  # 200 ms a token
    stats = rollout_stats([c, slow, Completion(token_ids=[1], ttft_s=0.1, latency_s=0.1)], gen_s=1.0)
    assert stats["perf/tpot_ms_mean"] == pytest.approx(125.0)
    assert stats["perf/tpot_ms_p50"] == pytest.approx(125.0)
    assert stats["perf/tpot_ms_p99"] == pytest.approx(198.5)


def test_single_token_completions_give_no_tpot():
    stats = rollout_stats([Completion(token_ids=[1], ttft_s=0.1, latency_s=0.1)], gen_s=1.0)
    assert stats["perf/tpot_ms_mean"] is None and stats["perf/tpot_ms_p99"] is None
    assert stats["perf/itl_ms_mean"] is None


def test_rollout_stats_when_everything_failed():
    stats = rollout_stats([Completion(error="boom")], gen_s=1.0)
    assert stats["perf/gen_tokens"] == 0 and stats["perf/ttft_s_p50"] is None
    assert stats["perf/tpot_ms_mean"] is None


def test_timings_accumulate_and_fill_every_key():
    t = Timings()
    with t.phase("gen"):
        pass
    with t.phase("gen"):
        pass
    rec = t.record()
    assert rec["timing_s/gen"] >= 0 and rec["timing_s/sleep"] is None
    assert set(rec) >= {"timing_s/update_actor", "timing_s/update_weights", "timing_s/restart",
                        "host/cpu_busy_pct_gen", "host/cpu_busy_pct_update_actor"}


def test_host_cpu_load_is_recorded_for_rollout_and_training(tmp_path):
    from hybridrl.run.telemetry import host_cpu_jiffies

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 50 800 40 3 2 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    assert host_cpu_jiffies(stat) == (160, 1000)  # busy leaves out idle and iowait
    assert host_cpu_jiffies(tmp_path / "absent") is None
    # windows of 100,000 ticks: long enough for any number of CPUs this test may run on
    readings = iter([(100, 1000), (30100, 101000), (30100, 101000), (120100, 201000)])
    t = Timings(cpu_reader=lambda: next(readings))
    with t.phase("gen"):
        pass
    with t.phase("sleep"):  # not a phase whose load is recorded: reads nothing
        pass
    with t.phase("update_actor"):
        pass
    rec = t.record()
    assert rec["host/cpu_busy_pct_gen"] == 30.0 and rec["host/cpu_busy_pct_update_actor"] == 90.0
    assert Timings(cpu_reader=lambda: None).record()["host/cpu_busy_pct_gen"] is None


def test_host_cpu_load_needs_a_window_of_enough_ticks():
    """A phase of a few milliseconds (overlap's wait for a rollout that ran ahead) spans a tick or two of the
    host's CPU time: no share is read from it."""
    from hybridrl.run.telemetry import MIN_CPU_WINDOW_TICKS, busy_pct

    cpus = 32
    assert busy_pct((0, 0), (cpus, 2 * cpus), cpus=cpus) is None  # two ticks a CPU: 50% by chance
    enough = MIN_CPU_WINDOW_TICKS * cpus
    assert busy_pct((0, 0), (enough // 4, enough), cpus=cpus) == 25.0
    assert busy_pct((0, 0), (enough // 4, enough - 1), cpus=cpus) is None


def test_append_record_keeps_earlier_lines(tmp_path):
    path = tmp_path / "steps.jsonl"
    append_record(path, {"step": 1, "x": math.nan})
    append_record(path, {"step": 2})
    assert [r["step"] for r in read_records(path)] == [1, 2]
    assert not list(tmp_path.glob(".*tmp"))
    # a line is either wholly there or not at all
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_memory_sampler_without_gpu_reports_nothing():
    sampler = MemorySampler()
    if sampler.active:
        pytest.skip("a GPU is visible here")
    sampler.start().set_phase("gen")
    assert sampler.take() == {}
    sampler.close()


def test_a_damaged_record_file_is_named_with_its_line_not_a_json_traceback(tmp_path):
    from hybridrl.run.telemetry import RecordError

    path = tmp_path / "steps.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "timing_s/ge\n')
    with pytest.raises(RecordError, match=rf"^{path}:2: not a step record \(Unterminated string"):
        read_records(path)
    path.write_text('{"step": 1}\n\n[1, 2]\n')
    with pytest.raises(RecordError, match=rf"^{path}:3: not a step record \(a JSON list, not an object\); hybridrl "):
        read_records(path)
    path.write_text('{"step": 1}\n\n{"step": 2}\n')
    assert [r["step"] for r in read_records(path)] == [1, 2]
