import json
import math

import pytest

from hybridrl.engines.base import Completion
from hybridrl.telemetry import MemorySampler, Timings, append_record, read_records, rollout_stats


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
    assert stats["response_length/mean"] == pytest.approx(20.0)


def test_rollout_stats_when_everything_failed():
    stats = rollout_stats([Completion(error="boom")], gen_s=1.0)
    assert stats["perf/gen_tokens"] == 0 and stats["perf/ttft_s_p50"] is None


def test_timings_accumulate_and_fill_every_key():
    t = Timings()
    with t.phase("gen"):
        pass
    with t.phase("gen"):
        pass
    rec = t.record()
    assert rec["timing_s/gen"] >= 0 and rec["timing_s/sleep"] is None
    assert set(rec) >= {"timing_s/update_actor", "timing_s/update_weights", "timing_s/restart"}


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
