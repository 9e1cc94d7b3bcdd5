"""onload_beside_release: the trainer's onload beside the release of the engine's weights. The decision from
measured memory, the two running at once (and their errors), the colocated placement's calls in order, SGLang's
two release calls, the config's refusals and the floor of the phase."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from hybridrl.engines import sglang
from hybridrl.engines.base import EngineError, SleepStages
from hybridrl.engines.sglang import SGLangServer
from hybridrl.report import floors
from hybridrl.report.aggregate import release_arm
from hybridrl.report.comparisons import MOVES
from hybridrl.run.onload_beside_release import DONE, NEED, ONLOAD_S, RELEASE_S, OnloadBeside, run_beside
from hybridrl.run.placement import Colocate
from hybridrl.run.telemetry import Timings
from hybridrl.study.config import ConfigError, resolve
from hybridrl.study.run_config import RunConfig

REPO = Path(__file__).resolve().parents[1]


# -- the decision ------------------------------------------------------------------------------------------------
def test_nothing_runs_beside_before_an_onload_was_measured_or_without_a_reading() -> None:
    beside = OnloadBeside(margin_gb=2.0)
    assert not beside.decide({0: (10.0, 80.0)})
    beside.measured({0: (10.0, 80.0)}, {0: (40.0, 80.0)})
    assert not beside.decide({})  # no NVML: the safe side


def test_the_onload_runs_beside_where_every_gpu_holds_the_most_the_last_one_took_and_the_margin() -> None:
    beside = OnloadBeside(margin_gb=2.0)
    beside.measured({0: (31.0, 80.0), 1: (31.0, 80.0)}, {0: (61.0, 80.0), 1: (60.0, 80.0)})
    assert beside.need_gb == {0: 30.0, 1: 29.0}
    assert beside.decide({0: (48.0, 80.0), 1: (48.0, 80.0)})  # 32 GB free on each: the most taken (30) + 2
    # GPU 1 took 29 GB then, but a rank still freeing memory as it was read shows less: held to the most, 32 GB
    assert not beside.decide({0: (48.0, 80.0), 1: (48.5, 80.0)})
    assert not beside.decide({0: (40.0, 80.0)})  # GPU 1 gave no reading: no room is assumed
    assert beside.record(True, (0.5, 0.6)) == {DONE: True, NEED: 30.0, RELEASE_S: 0.5, ONLOAD_S: 0.6}
    assert beside.record(False) == {DONE: False, NEED: 30.0, RELEASE_S: None, ONLOAD_S: None}


# -- the two at once ---------------------------------------------------------------------------------------------
def test_the_release_and_the_onload_run_at_the_same_time() -> None:
    both = threading.Barrier(2, timeout=5)  # broken unless the two are inside it together
    run_beside(both.wait, both.wait)
    release_s, onload_s = run_beside(lambda: time.sleep(1.0), lambda: None)
    assert release_s >= 1.0 > onload_s  # each side's own seconds


def test_a_failed_release_is_the_error_named_and_is_waited_for_first() -> None:
    finished = threading.Event()

    def release() -> None:
        time.sleep(0.2)
        finished.set()
        raise EngineError("sglang: /release_memory_occupation: connection refused")

    def onload() -> None:
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(EngineError, match="release_memory_occupation") as raised:
        run_beside(release, onload)
    assert finished.is_set() and isinstance(raised.value.__cause__, RuntimeError)  # the onload's error kept
    with pytest.raises(RuntimeError, match="out of memory"):
        run_beside(lambda: None, onload)
    with pytest.raises(EngineError, match="connection refused"):
        run_beside(release, lambda: None)


# -- the placement -----------------------------------------------------------------------------------------------
class StagedEngine:
    """A scripted engine whose sleep comes in two calls; what it was asked, in order."""

    in_controller = False
    dies = False

    def __init__(self, calls: list[str], barrier: threading.Barrier | None = None) -> None:
        self.calls, self.barrier = calls, barrier

    def sleep(self) -> None:
        self.calls.append("sleep")

    def sleep_stages(self) -> SleepStages:
        return SleepStages(lambda: self.calls.append("release cache"), self._weights,
                           lambda: self.calls.append("read asleep"))

    def _weights(self) -> None:
        self.calls.append("release weights")
        if self.dies:
            raise EngineError("sglang: /release_memory_occupation: the server is gone")
        if self.barrier is not None:
            self.barrier.wait()

    def gpus(self) -> list[int]:
        return [0]


class Trainer:
    def __init__(self, calls: list[str], barrier: threading.Barrier | None = None) -> None:
        self.calls, self.barrier = calls, barrier

    def onload(self) -> None:
        self.calls.append("onload")
        if self.barrier is not None:
            self.barrier.wait()

    def offload(self) -> None:
        self.calls.append("offload")

    def gpu_pids(self) -> list[int]:
        return [12345]


class Sampler:
    """NVML as the placement reads it: the next readings in turn."""

    def __init__(self, readings: list[dict[int, tuple[float, float]]]) -> None:
        self.readings = readings

    def memory_gb(self) -> dict[int, tuple[float, float]]:
        return self.readings.pop(0)

    def set_phase(self, phase: str) -> None:
        pass


def _run(**over: Any) -> RunConfig:
    return RunConfig.model_validate({"engine": "sglang", "placement": "colocate", "device": "cuda", "model": "m",
                                     "sglang_release": "all", "onload_beside_release": True, **over})


def _colocate(engine: StagedEngine, trainer: Trainer, sampler: Sampler, monkeypatch: pytest.MonkeyPatch,
              **over: Any) -> Colocate:
    monkeypatch.setattr("hybridrl.run.placement.nvml.used_less_gb", lambda pids, gpus: 1.0)
    return Colocate(engine, trainer, sampler, _run(**over))  # type: ignore[arg-type]


def test_the_first_step_runs_one_after_the_other_and_measures_the_onload(monkeypatch) -> None:
    calls: list[str] = []
    # after the KV cache's release (decided on: nothing measured yet), before the onload, after it
    sampler = Sampler([{0: (31.0, 80.0)}, {0: (1.0, 80.0)}, {0: (31.5, 80.0)}])
    p = _colocate(StagedEngine(calls), Trainer(calls), sampler, monkeypatch)
    t = Timings()
    p.before_train(t)
    assert calls == ["release cache", "release weights", "read asleep", "onload"]
    assert "release_onload" not in t.s and {"sleep", "trainer_onload"} <= set(t.s)
    readings = p.step_metrics()
    assert readings[DONE] is False and readings[NEED] == 30.5 and readings["mem/engine_asleep_own_gb"] == 1.0


def test_a_later_step_with_room_runs_the_onload_beside_the_weights_release(monkeypatch) -> None:
    calls: list[str] = []
    both = threading.Barrier(2, timeout=5)  # the onload and the weights' release must meet inside it
    sampler = Sampler([{0: (31.0, 80.0)}, {0: (1.0, 80.0)}, {0: (31.5, 80.0)}, {0: (31.0, 80.0)}])
    p = _colocate(StagedEngine(calls), Trainer(calls), sampler, monkeypatch)
    p.before_train(Timings())
    p.step_metrics()
    p.engine.barrier = p.trainer.barrier = both
    calls.clear()
    t = Timings()
    p.before_train(t)  # 49 GB free after the KV cache's release: 30.5 + 2 fit
    # no whole asleep reading beside the base arriving: only the engine's own, after both
    assert calls[0] == "release cache" and sorted(calls[1:]) == ["onload", "release weights"]
    assert "trainer_onload" not in t.s and t.s["release_onload"] > 0
    readings = p.step_metrics()
    assert readings[DONE] is True and readings[RELEASE_S] is not None and readings[ONLOAD_S] is not None


def test_a_step_without_room_goes_back_to_one_after_the_other(monkeypatch) -> None:
    calls: list[str] = []
    sampler = Sampler([{0: (31.0, 80.0)}, {0: (1.0, 80.0)}, {0: (31.5, 80.0)},
                       {0: (50.0, 80.0)}, {0: (20.0, 80.0)}, {0: (50.5, 80.0)}])  # 30 GB free: 32.5 needed
    p = _colocate(StagedEngine(calls), Trainer(calls), sampler, monkeypatch)
    for _ in range(2):
        p.before_train(Timings())
    assert calls[4:] == ["release cache", "release weights", "read asleep", "onload"]
    assert p.step_metrics()[DONE] is False


def test_an_engine_that_dies_beside_the_onload_gets_the_trainer_offloaded_before_its_restart(monkeypatch) -> None:
    calls: list[str] = []
    sampler = Sampler([{0: (31.0, 80.0)}, {0: (1.0, 80.0)}, {0: (31.5, 80.0)}, {0: (31.0, 80.0)}])
    p = _colocate(StagedEngine(calls), Trainer(calls), sampler, monkeypatch)
    p.before_train(Timings())
    p.engine.dies = True
    calls.clear()
    with pytest.raises(EngineError, match="the server is gone"):
        p.before_train(Timings())  # the loop restarts the engine next: it must find the trainer's memory free
    assert calls[-1] == "offload" and "onload" in calls


def test_without_the_key_the_engine_sleeps_in_one_call(monkeypatch) -> None:
    calls: list[str] = []
    p = _colocate(StagedEngine(calls), Trainer(calls), Sampler([]), monkeypatch, onload_beside_release=False)
    p.before_train(Timings())
    assert calls == ["sleep", "onload"] and DONE not in p.step_metrics()


# -- SGLang's two calls ------------------------------------------------------------------------------------------
def test_sglang_releases_its_kv_cache_first_then_its_weights(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    posted: list[tuple[str, Any]] = []
    monkeypatch.setattr(sglang, "asleep_readings", lambda gpus: {"mem/engine_asleep_gb": 3.0})
    eng = SGLangServer(model_dir, _run(), {}, tmp_path)
    monkeypatch.setattr(eng, "_post", lambda path, body=None, **kw: posted.append((path, body)))
    stages = eng.sleep_stages()
    stages.release_cache()
    assert posted == [("/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})]
    stages.release_weights()
    assert posted[1] == ("/release_memory_occupation", {"tags": ["weights"]})
    assert "mem/engine_asleep_gb" not in eng.step_metrics()  # read apart, where nothing else moves
    stages.read_asleep()
    assert eng.step_metrics()["mem/engine_asleep_gb"] == 3.0
    kv_only = SGLangServer(model_dir, _run(sglang_release="kv_cache", onload_beside_release=False), {}, tmp_path)
    assert kv_only.sleep_stages() is None  # its weights stay: nothing to release beside the onload


# -- the config --------------------------------------------------------------------------------------------------
@pytest.fixture
def study() -> dict:
    raw = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    raw.pop("measurements")
    raw["runs"] = [{**raw["runs"][0], "engine": "sglang", "device": "cuda", "placement": "colocate",
                    "sglang_release": "all", "trainer": "hf"}]
    return raw


@pytest.mark.parametrize(("over", "message"), [
    ({"placement": "split"}, r"only a colocated engine that sleeps releases anything \(placement split"),
    ({"engine_sleep": False}, r"only a colocated engine that sleeps .*engine_sleep False"),
    ({"engine": "vllm"}, r"only SGLang releasing its weights .*\(engine vllm\)"),
    ({"sglang_release": "kv_cache"}, r"only SGLang .*\(engine sglang, sglang_release kv_cache\)"),
    ({"trainer": "none"}, r"trainer none has no onload"),
    ({"keep_base_on_gpu": True}, r"keep_base_on_gpu true keeps the frozen base on the GPU"),
])
def test_the_key_is_refused_where_nothing_would_run_beside(study, over, message) -> None:
    study["runs"][0].update(onload_beside_release=True, **over)
    with pytest.raises(ConfigError, match=r"runs\[0\]\.onload_beside_release: " + message):
        resolve(study)


def test_the_key_gives_a_run_of_its_own_and_keeps_ids_at_its_default(study) -> None:
    plain = resolve(copy.deepcopy(study)).runs
    study["runs"][0]["onload_beside_release"] = False
    assert list(resolve(copy.deepcopy(study)).runs) == list(plain)
    for base in (False, "auto"):
        study["runs"][0].update(onload_beside_release=True, keep_base_on_gpu=base)
        (run,) = resolve(copy.deepcopy(study)).runs.values()
        assert run.onload_beside_release and set(resolve(copy.deepcopy(study)).runs) != set(plain)


# -- the floor ---------------------------------------------------------------------------------------------------
def _inputs() -> floors.RunInputs:
    shape = floors.floor_model.shape_of({"vocab_size": 100, "hidden_size": 8, "intermediate_size": 16,
                                         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                         "head_dim": 4, "tie_word_embeddings": True})
    config = {"tp": 1, "train_tp": 1, "engine": "sglang", "sglang_release": "all", "keep_base_on_gpu": False,
              "lora": {"rank": 2, "target_modules": ["q_proj"]}}
    return floors.RunInputs("r", config, "NVIDIA H200", floors.gpu_specs.spec("NVIDIA H200"), shape, "test",
                            {"h2d_gb_s": 20.0, "d2h_gb_s": 10.0}, Path("/nonexistent"))


def test_the_phase_s_floor_is_the_longer_of_its_two_copies_and_the_sleep_keeps_none() -> None:
    inputs, row = _inputs(), pd.Series({"step": 2, DONE: True, "train/keep_base_on_gpu": False})
    out = floors.phase_floor(inputs, "timing_s/sleep", pd.Series({"step": 2, DONE: False}))
    onload = floors.phase_floor(inputs, "timing_s/trainer_onload", row)
    both = floors.phase_floor(inputs, "timing_s/release_onload", row)
    # the weights out at 10 GB/s take longer than the base and LoRA state in at 20 GB/s
    assert out.seconds > onload.seconds and both.seconds == pytest.approx(out.seconds)
    assert both.basis.startswith("the longer of ") and "device→host" in both.basis and "host→device" in both.basis
    assert floors.phase_floor(inputs, "timing_s/sleep", row).seconds == 0.0  # only the KV cache left in it


def test_the_report_keeps_the_arm_apart_from_a_release_that_moves_its_weights_in_its_sleep() -> None:
    beside = release_arm("sglang", "colocate", "all", None, True, True, True)
    assert beside == "full release, onload beside" != release_arm("sglang", "colocate", "all", None, True, True, False)
    assert MOVES[beside] != MOVES["full release"]  # a sleep/wake table of its own
