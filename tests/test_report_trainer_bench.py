"""A study's trainer benchmarks in its report and in `hybridrl targets`: a setting's processes pooled, the dense
update's target judged from their interval, and a record that cannot be read named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from hybridrl.report import targets, trainer_bench
from hybridrl.report.peer import BenchRecordError

REPO = Path(__file__).resolve().parents[1]
DENSE = targets.Target(name="dense update", metric=targets.TRAINER_UPDATE, at_most=1.0,
                       where=targets.Where(model="0.6b", vocab=151936, gen_tokens=32768))


def _bench(bench: Path, name: str, updates: list[float], vocab: int = 151936, trainer: str = "hf") -> None:
    bench.mkdir(parents=True, exist_ok=True)
    record = {"shape": "qwen3-0.6b", "vocab": vocab, "samples": 128, "completion": 256, "completion_tokens": 32768,
              "micro_batch": 32, "train_ep": 1, "device": "NVIDIA H200",
              trainer: {"update_s_all": updates, "mfu_median": 0.2, "peak_gb": 23.2}}
    (bench / f"{name}.json").write_text(json.dumps(record))
    (bench / f"{name}.slurm.json").write_text("{}")  # the job's record beside it is not a process


def _rows(bench: Path) -> dict[str, list[str]]:
    table = trainer_bench.table(bench, [DENSE])
    assert table is not None
    return {row[0].text: [c.text for c in row] for row in table.rows}


def test_a_settings_processes_are_pooled_and_the_target_judged_from_their_interval(tmp_path: Path) -> None:
    bench = tmp_path / "bench"
    _bench(bench, "trainer-qwen3-0.6b-hf-mb32-chunked-head", [0.86, 0.87, 0.88, 0.87, 0.86])
    _bench(bench, "trainer-qwen3-0.6b-hf-mb32-chunked-head-r2", [0.90, 0.91, 0.89, 0.90, 0.92])
    _bench(bench, "trainer-qwen3-0.6b-hf-mb32", [1.20, 1.22, 1.25, 1.21, 1.23])
    _bench(bench, "trainer-qwen3-0.6b-hf-mb32-r2", [0.95, 1.30, 1.02, 1.25, 0.97])
    rows = _rows(bench)
    assert set(rows) == {"qwen3-0.6b-hf-mb32-chunked-head", "qwen3-0.6b-hf-mb32"}
    fast, slow = rows["qwen3-0.6b-hf-mb32-chunked-head"], rows["qwen3-0.6b-hf-mb32"]
    assert fast[4] == "2" and fast[5] == "0.87, 0.90" and fast[-1] == "met"
    assert slow[-1] == "not settled: its interval reaches past the bound"  # one process under 1.0 s, one over
    _bench(bench, "trainer-qwen3-0.6b-hf-mb32-r2", [1.20, 1.30, 1.22, 1.25, 1.27])
    assert _rows(bench)["qwen3-0.6b-hf-mb32"][-1] == "missed"


def test_the_dense_target_leaves_other_vocabularies_and_every_run_alone(tmp_path: Path) -> None:
    bench = tmp_path / "bench"
    _bench(bench, "trainer-qwen3-0.6b-mb32", [0.8, 0.8, 0.8], vocab=768, trainer="megatron")  # no trainer in name
    (row,) = _rows(bench).values()
    assert row[0] == "qwen3-0.6b-mb32 · megatron" and row[2] == "768" and row[-3:] == ["–", "–", "–"]
    steps = pd.DataFrame([{"config_id": "a", "engine": "sglang", "placement": "colocate", "model": "qwen3-0.6b",
                           "gpu": "NVIDIA H200", "gpu_count": 1, "perf/gen_tokens": 32768}])
    assert not targets.applies(DENSE.where, steps)  # a run's steps do not name their vocabulary
    assert not trainer_bench.applies(targets.Where(engine="sglang"), {"shape": "qwen3-0.6b"})


def test_a_record_that_is_not_a_trainer_bench_is_named(tmp_path: Path) -> None:
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "trainer-qwen3-0.6b-hf-mb32.json").write_text('{"shape": "qwen3-0.6b", "hf": {"update_s_all": "x"}}')
    with pytest.raises(BenchRecordError, match=r"trainer-qwen3-0.6b-hf-mb32.json: not a readable trainer-bench"):
        trainer_bench.table(bench)
    assert trainer_bench.table(tmp_path / "none") is None


def test_the_targets_command_judges_a_study_of_benchmarks_alone(tmp_path: Path) -> None:
    _bench(tmp_path / "2026-01-01-h200-dense" / "bench", "trainer-qwen3-0.6b-hf-mb64", [0.84, 0.85, 0.83])
    out = subprocess.run([sys.executable, "-m", "hybridrl", "targets", "--reference", str(tmp_path)],
                         capture_output=True, text=True, cwd=REPO, check=True).stdout
    (line,) = [ln for ln in out.splitlines() if "dense update" in ln]
    assert line.startswith("2026-01-01-h200-dense | the dense update at Qwen's vocabulary")
    assert line.endswith("trainer/update_s ≤ 1 | met, one run a side: step-to-step noise only")  # one process
    assert "qwen3-0.6b-hf-mb64 | 0.84" in line
