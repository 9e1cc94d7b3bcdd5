"""The colocated placement's reading of what an asleep engine itself holds: the trainer's processes left out, and
the controller's where the engine is not in it."""

from __future__ import annotations

import os
from typing import Any

import pytest

from hybridrl.run import placement
from hybridrl.run.placement import Colocate
from hybridrl.run.telemetry import Timings


class Trainer:
    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def gpu_pids(self) -> list[int]:
        return self.pids

    def onload(self) -> None:
        pass


class Engine:
    def __init__(self, in_controller: bool) -> None:
        self.in_controller = in_controller

    def sleep(self) -> None:
        pass

    def gpus(self) -> list[int]:
        return [2, 3]


class Sampler:
    def set_phase(self, phase: str) -> None:
        pass


def _asleep(monkeypatch: pytest.MonkeyPatch, engine: Engine, trainer: Trainer | None) -> tuple[Any, list]:
    asked: list = []
    monkeypatch.setattr(placement.nvml, "used_less_gb", lambda pids, gpus: asked.append((pids, gpus)) or 4.5)
    p = Colocate(engine, trainer, Sampler())  # type: ignore[arg-type]
    p.before_train(Timings())
    return p.step_metrics(), asked


def test_a_server_engine_s_reading_leaves_out_the_trainer_and_the_controller(monkeypatch):
    readings, asked = _asleep(monkeypatch, Engine(in_controller=False), Trainer([101, 102]))
    assert readings == {"mem/engine_asleep_own_gb": 4.5}
    assert asked == [({101, 102, os.getpid()}, [2, 3])]  # on the engine's GPUs only


def test_an_in_process_engine_keeps_the_controller_s_memory_as_its_own(monkeypatch):
    readings, asked = _asleep(monkeypatch, Engine(in_controller=True), Trainer([101, 102]))
    assert readings == {"mem/engine_asleep_own_gb": 4.5} and asked == [({101, 102}, [2, 3])]


def test_a_trainer_in_the_engine_s_own_process_cannot_be_told_apart(monkeypatch):
    readings, asked = _asleep(monkeypatch, Engine(in_controller=True), Trainer([os.getpid()]))
    assert readings == {"mem/engine_asleep_own_gb": None} and asked == []
    assert _asleep(monkeypatch, Engine(in_controller=False), None)[0] == {"mem/engine_asleep_own_gb": None}
