"""Placements: what happens to the engine and the trainer around each training phase."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from hybridrl import nvml
from hybridrl.engines.base import Engine, EngineError, SleepStages
from hybridrl.run import base_residency
from hybridrl.run.onload_beside_release import OnloadBeside, run_beside
from hybridrl.run.record import ENGINE_ASLEEP_OWN
from hybridrl.run.telemetry import MemorySampler, Timings
from hybridrl.study.run_config import RunConfig
from hybridrl.trainers.base import Trainer

ADAPTER_NAME = "policy"


class Placement:
    """split: the engine stays up on its own devices and hot-loads each new adapter."""

    name = "split"
    shares_gpus = False  # does the engine run on the trainer's GPUs?

    def __init__(self, engine: Engine, trainer: Trainer | None, sampler: MemorySampler,
                 run: RunConfig | None = None) -> None:
        self.engine, self.trainer, self.sampler, self.run = engine, trainer, sampler, run
        self.base_residency: dict[str, Any] | None = None  # keep_base_on_gpu auto: the decision and its figures
        self.readings: dict[str, Any] = {}  # this step's own readings (step_metrics)

    def step_metrics(self) -> dict[str, Any]:
        """The placement's readings since the last call (ENGINE_ASLEEP_OWN), then forget them."""
        out, self.readings = self.readings, {}
        return out

    def start_engine(self, adapter: Path | None) -> float:
        """The run's first engine start (with the newest adapter on a resume); returns its seconds."""
        if self.trainer and self.shares_gpus:
            self.trainer.offload()  # the engine sizes its memory from what it finds free
            if self.run is not None and self.run.keep_base_on_gpu == "auto":
                self.base_residency = base_residency.decide(self.sampler.memory_gb(),
                                                            self.run.gpu_memory_utilization)
                if not self.base_residency["kept"]:
                    self.trainer.release_base()
        self.sampler.set_phase("start")
        t0 = time.perf_counter()
        self.engine.start((ADAPTER_NAME, adapter) if adapter is not None else None)
        return time.perf_counter() - t0

    def before_train(self, t: Timings) -> None:
        pass

    def after_train(self, t: Timings, adapter: Path | None) -> None:
        if adapter is not None:
            self.sync_adapter(t, adapter)

    def sync_adapter(self, t: Timings, adapter: Path) -> None:
        with t.phase("update_weights", self.sampler):
            self.engine.load_adapter(ADAPTER_NAME, adapter)
            # Cached prefixes hold the old adapter's KV. vLLM versions that key cached blocks by adapter name alone
            # (ours stays "policy") would reuse them: split vLLM on the H200, without this flush, had a
            # trainer-vs-engine logprob gap of 0.026 against 0.007 colocated. A step's group still shares prefixes.
            self.engine.flush_cache()

    def onload_trainer(self, t: Timings) -> None:
        if self.trainer:
            with t.phase("trainer_onload", self.sampler):
                self.trainer.onload()

    def offload_trainer(self, t: Timings) -> None:
        if self.trainer:
            with t.phase("trainer_offload", self.sampler):
                self.trainer.offload()


class Colocate(Placement):
    """Engine and trainer share GPUs: the engine sleeps while the trainer runs, then wakes. With engine_sleep
    false both stay: the trainer comes onto the GPU once, at the first update, and the engine never sleeps."""

    name = "colocate"
    shares_gpus = True

    def __init__(self, engine: Engine, trainer: Trainer | None, sampler: MemorySampler,
                 run: RunConfig | None = None) -> None:
        super().__init__(engine, trainer, sampler, run)
        self.engine_sleeps = run is None or run.engine_sleep
        self.trainer_on_gpu = False  # engine_sleep false: onloaded at the first update, kept from then on
        # onload_beside_release: the trainer comes back while the engine's weights leave, where memory allows
        self.beside = OnloadBeside() if run is not None and run.onload_beside_release and trainer else None

    def start_engine(self, adapter: Path | None) -> float:
        self.trainer_on_gpu = False  # a start (the first, or one after the engine died) offloads the trainer
        return super().start_engine(adapter)

    def before_train(self, t: Timings) -> None:
        if not self.engine_sleeps:
            if not self.trainer_on_gpu:
                self.onload_trainer(t)
                self.trainer_on_gpu = True
            return
        stages = self.engine.sleep_stages() if self.beside is not None else None
        if stages is not None:
            self.release_beside_onload(t, stages)
            return
        with t.phase("sleep", self.sampler):
            self.engine.sleep()
        self.readings[ENGINE_ASLEEP_OWN] = self.asleep_own()
        self.onload_trainer(t)

    def release_beside_onload(self, t: Timings, stages: SleepStages) -> None:
        """The sleep in its parts, and the trainer's onload beside the weights' release where every GPU has room
        for it (OnloadBeside); else one after the other, as a plain sleep, and the onload measured for the next step.
        Beside it, the engine's whole asleep reading is not taken (NVML cannot tell it from the base arriving): its
        own reading, the trainer's processes left out, is taken once both are done."""
        assert self.beside is not None and self.trainer is not None
        with t.phase("sleep", self.sampler):
            stages.release_cache()
        if self.beside.decide(self.sampler.memory_gb()):
            with t.phase("release_onload", self.sampler):
                try:
                    seconds = run_beside(stages.release_weights, self.trainer.onload)
                except EngineError:
                    # the loop starts the engine again next, and it sizes its memory from what it finds free
                    self.trainer.offload()
                    raise
            self.readings[ENGINE_ASLEEP_OWN] = self.asleep_own()
            self.readings.update(self.beside.record(True, seconds))
            return
        with t.phase("sleep", self.sampler):
            stages.release_weights()
            stages.read_asleep()
        self.readings[ENGINE_ASLEEP_OWN] = self.asleep_own()
        before = self.sampler.memory_gb()
        self.onload_trainer(t)
        self.beside.measured(before, self.sampler.memory_gb())
        self.readings.update(self.beside.record(False))

    def asleep_own(self) -> float | None:
        """What the asleep engine itself still holds: NVML on its GPUs less what the trainer's processes hold there
        (and the controller, where the engine is not in it). The whole reading also moves with the offloaded
        trainer's residue (its optimizer state after the first update, its allocator's cache: 0.6 GB a GPU at the
        48-layer shape), which is no leak of the engine's. None without a trainer, or where the trainer runs in the
        engine's own process (the HF trainer beside in-process vLLM), whose memory cannot be told apart."""
        if self.trainer is None:
            return None
        others, controller = set(self.trainer.gpu_pids()), os.getpid()
        if self.engine.in_controller:
            if controller in others:
                return None
        else:
            others.add(controller)
        return nvml.used_less_gb(others, self.engine.gpus())

    def after_train(self, t: Timings, adapter: Path | None) -> None:
        if self.engine_sleeps:
            self.offload_trainer(t)  # before wake, so the engine gets its memory back
            with t.phase("wake", self.sampler):
                self.engine.wake()
        if adapter is not None:
            self.sync_adapter(t, adapter)


class Restart(Placement):
    """Stop the engine before training and start it again with the new adapter (one public benchmark's way)."""

    name = "restart"
    shares_gpus = True

    def before_train(self, t: Timings) -> None:
        with t.phase("restart", self.sampler):
            self.engine.stop()
        self.onload_trainer(t)

    def after_train(self, t: Timings, adapter: Path | None) -> None:
        # the engine sizes its KV cache from the free memory it finds: give it back what training
        # cached (on the H200 run, without this the restarted engine had 3.7% less KV capacity)
        self.offload_trainer(t)
        with t.phase("restart", self.sampler):
            self.engine.start((ADAPTER_NAME, adapter) if adapter is not None else None)


PLACEMENTS = {p.name: p for p in (Placement, Colocate, Restart)}


def make_placement(name: str, engine: Engine, trainer: Trainer | None, sampler: MemorySampler,
                   run: RunConfig | None = None) -> Placement:
    return PLACEMENTS[name](engine, trainer, sampler, run)
