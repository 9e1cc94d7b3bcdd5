"""Speed targets against a study's configurations: which apply, and met / missed / not settled from the interval."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from hybridrl.report import stats, targets
from hybridrl.study.config import ConfigError


def _config(config_id: str, steps: list[float], gpu: str = "NVIDIA H100 80GB HBM3", tokens: float = 32768,
            runs: int = 2) -> pd.DataFrame:
    rows = []
    for r in range(runs):
        for i, s in enumerate(steps, 1):
            rows.append({"run_id": f"{config_id}-r{r}", "config_id": config_id, "step": i, "time_unix": 100 * r + i,
                         "engine": "sglang", "placement": "colocate", "trainer": "hf", "model": "qwen3-0.6b-x",
                         "tp": 1, "gpu": gpu, "gpu_count": 1, "perf/gen_tokens": tokens,
                         "timing_s/step_compared": s + 0.01 * r, "warmup_steps": 2})
    return pd.DataFrame(rows)


STEP = targets.Target(name="0.6B step", metric="timing_s/step_compared", at_most=4.0,
                      where=targets.Where(placement="colocate", gpu="H100", gpu_count=1, model="0.6b",
                                          gen_tokens=32768))


def test_a_target_applies_only_where_every_field_matches() -> None:
    assert targets.applies(STEP.where, _config("a", [9, 9, 3, 3]))
    assert not targets.applies(STEP.where, _config("a", [9, 9, 3, 3], gpu="NVIDIA H200"))
    assert not targets.applies(STEP.where, _config("a", [9, 9, 3, 3], tokens=10000))  # stopped at EOS
    assert not targets.applies(targets.Where(engine="vllm"), _config("a", [9, 9, 3, 3]))


def test_gpu_count_is_what_each_run_held_not_the_machines() -> None:
    two = targets.Where(gpu_count=2)
    held = _config("a", [9, 9, 3, 3]).assign(gpu_count=4, **{"cost/gpus": 2.0})  # two of a four-GPU machine
    assert targets.applies(two, held)
    assert not targets.applies(two, held.assign(**{"cost/gpus": 4.0}))
    assert targets.applies(two, held.drop(columns="cost/gpus").assign(gpu_count=2))  # aggregated before cost/gpus


@pytest.mark.parametrize(("lo", "hi", "verdict"), [(3.0, 3.9, "met"), (4.1, 5.0, "missed"),
                                                    (3.8, 4.2, "not settled: its interval reaches past the bound"),
                                                    (float("nan"), float("nan"), "not settled: no interval")])
def test_the_verdict_comes_from_the_whole_interval(lo: float, hi: float, verdict: str) -> None:
    assert targets.judge(STEP, stats.Estimate(value=(lo + hi) / 2, lo=lo, hi=hi, n=2, n_runs=2)) == verdict
    floor = STEP.model_copy(update={"at_most": None, "at_least": 4.0})
    flipped = {"met": "missed", "missed": "met"}.get(verdict, verdict)
    assert targets.judge(floor, stats.Estimate(value=(lo + hi) / 2, lo=lo, hi=hi, n=2, n_runs=2)) == flipped
    # one run on a side: the interval holds step-to-step noise only, and a verdict says so
    one = targets.judge(STEP, stats.Estimate(value=(lo + hi) / 2, lo=lo, hi=hi, n=8, n_runs=1))
    assert one == (verdict + targets.ONE_RUN if verdict in ("met", "missed") else verdict)


def test_the_table_has_a_row_for_each_configuration_a_target_applies_to() -> None:
    df = pd.concat([_config("fast", [9, 9, 3.0, 3.1, 3.0, 3.2]), _config("slow", [9, 9, 5.0, 5.1, 5.2, 5.0]),
                    _config("h200", [9, 9, 3.0, 3.0, 3.0, 3.0], gpu="NVIDIA H200")], ignore_index=True)
    table = targets.table(df, {"fast": "fast", "slow": "slow"}, [STEP])
    assert [(r[1].text, r[4].text) for r in table.rows] == [("fast", "met"), ("slow", "missed")]
    assert targets.table(df[df["config_id"] == "h200"], {}, [STEP]) is None


def test_the_committed_targets_load_and_a_bad_file_gets_one_line(tmp_path: Path) -> None:
    assert {t.metric for t in targets.load()} == {"timing_s/step_compared", *targets.BENCH_METRICS}
    bad = tmp_path / "targets.yaml"
    bad.write_text("- {name: x, metric: m, at_most: 1, at_least: 2}\n")
    with pytest.raises(ConfigError, match="exactly one of at_most and at_least"):
        targets.load(bad)
    bad.write_text("- {name: x, metric: m, at_most: 1, where: {gpus: 2}}\n")
    with pytest.raises(ConfigError, match=r"targets.yaml: target 1: where.gpus: Extra inputs"):
        targets.load(bad)


def test_against_goes_with_the_peer_ratio_alone_and_the_steps_table_leaves_bench_targets_out(tmp_path: Path) -> None:
    bad = tmp_path / "targets.yaml"
    bad.write_text("- {name: x, metric: peer/step_ratio, at_most: 1}\n")
    with pytest.raises(ConfigError, match="`against` goes with metric peer/step_ratio"):
        targets.load(bad)
    bad.write_text("- {name: x, metric: timing_s/step_compared, against: trl-best, at_most: 1}\n")
    with pytest.raises(ConfigError, match="`against` goes with metric peer/step_ratio"):
        targets.load(bad)
    peer = targets.Target(name="peer", metric=targets.PEER_RATIO, against="trl-defaults", at_most=0.667)
    assert not peer.on_steps and STEP.on_steps
    df = _config("fast", [9, 9, 3.0, 3.1, 3.0, 3.2])
    assert targets.table(df, {"fast": "fast"}, [peer]) is None
    assert len(targets.table(df, {"fast": "fast"}, [peer, STEP]).rows) == 1
