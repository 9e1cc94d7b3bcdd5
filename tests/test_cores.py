"""A run's job cores split between its engine and its trainer: which cores, how many threads, and what each
process is told."""

from __future__ import annotations

import os

import pytest
import torch

from hybridrl.run.cores import (
    VLLM_BIND,
    CoreSplit,
    apply_trainer_threads,
    engine_env,
    engine_env_spec,
    job_cores,
    rank_threads,
    split_cores,
)
from hybridrl.study.run_config import RunConfig


def _run(**over) -> RunConfig:
    return RunConfig(model="tiny", **{"engine": "vllm", "placement": "split", "device": "cpu", **over})


@pytest.mark.parametrize(("environ", "affinity", "cores"), [
    ({}, {0, 1, 2, 3}, (0, 1, 2, 3)),  # nothing granted: what the process may run on
    ({"OMP_NUM_THREADS": "2"}, {0, 1, 2, 3}, (0, 1)),  # Snakemake's threads for the job
    ({"OMP_NUM_THREADS": "2"}, {7, 2, 5}, (2, 5)),  # a cpuset's cores, in order
    ({"OMP_NUM_THREADS": "8"}, {0, 1}, (0, 1)),  # never more than the process may use
    ({"OMP_NUM_THREADS": "0"}, {0, 1}, (0, 1)),
    ({"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "3", "OMP_NUM_THREADS": "1"}, set(range(8)), (0, 1, 2)),
])
def test_the_job_s_cores_are_its_affinity_as_far_as_it_was_granted(environ, affinity, cores) -> None:
    assert job_cores(environ, affinity) == cores


def test_job_cores_reads_this_process_s_affinity_by_default() -> None:
    assert set(job_cores({})) == os.sched_getaffinity(0)


def test_a_resident_cpu_engine_and_the_trainer_get_cores_of_their_own() -> None:
    two = split_cores(_run(), (0, 1))
    assert (two.engine, two.trainer, two.engine_pool, two.trainer_threads, two.apart) == ((0,), (1,), (0,), 1, True)
    assert engine_env(_run(), two) == {VLLM_BIND: "0"}
    six = split_cores(_run(overlap=1), (0, 1, 2, 3, 4, 5))
    assert (six.engine, six.trainer, six.engine_pool) == ((0, 1, 2), (3, 4, 5), (0, 1))  # one left for vLLM's scheduler
    assert engine_env(_run(engine="vllm-inprocess"), six) == {VLLM_BIND: "0,1"}


@pytest.mark.parametrize(("run", "cores"), [
    (_run(placement="restart"), (0, 1, 2, 3)),  # the engine is stopped while the trainer trains
    (_run(), (3,)),  # one core: nothing to split
    (_run(device="cuda"), (0, 1, 2, 3)),  # the engine runs on GPUs
])
def test_engine_and_trainer_share_the_cores_where_they_take_turns(run: RunConfig, cores: tuple[int, ...]) -> None:
    split = split_cores(run, cores)
    assert split.engine == split.trainer == split.job == cores and not split.apart
    assert split.trainer_threads == len(cores)


def test_only_a_cpu_vllm_engine_is_bound() -> None:
    restart = split_cores(_run(placement="restart"), (0, 1))
    assert engine_env(_run(placement="restart"), restart) == {VLLM_BIND: "0"}  # as vLLM's own binding on 2 cores
    gpu = _run(device="cuda")
    assert engine_env(gpu, split_cores(gpu, (0, 1, 2, 3))) == {}


def test_the_engine_spec_gains_the_binding_and_the_study_s_own_setting_wins() -> None:
    split = split_cores(_run(), (0, 1, 2, 3))
    spec = {"python": ".venvs/vllm-cpu/bin/python", "env": {"VLLM_CPU_KVCACHE_SPACE": "2"}}
    assert engine_env_spec(_run(), spec, split) == {"python": ".venvs/vllm-cpu/bin/python",
                                                    "env": {VLLM_BIND: "0", "VLLM_CPU_KVCACHE_SPACE": "2"}}
    assert engine_env_spec(_run(), {"env": {VLLM_BIND: "nobind"}}, split)["env"] == {VLLM_BIND: "nobind"}
    assert spec["env"] == {"VLLM_CPU_KVCACHE_SPACE": "2"}  # the study's spec is left as it was


def test_the_trainer_s_threads_follow_its_cores_on_cpu_only() -> None:
    before = torch.get_num_threads()
    split = CoreSplit((0, 1, 2, 3), (0, 1), (2, 3), "test")
    try:
        environ = {"OMP_NUM_THREADS": "4", "HOME": "/home/x"}
        assert apply_trainer_threads(_run(), split, environ) == 2 == torch.get_num_threads()
        assert environ["OMP_NUM_THREADS"] == environ["MKL_NUM_THREADS"] == "2" and environ["HOME"] == "/home/x"
        torch.set_num_threads(3)
        gpu_env = {"OMP_NUM_THREADS": "8"}
        assert apply_trainer_threads(_run(device="cuda"), split, gpu_env) == 3
        assert gpu_env == {"OMP_NUM_THREADS": "8"}
    finally:
        torch.set_num_threads(before)


def test_the_record_says_who_had_which_cores() -> None:
    record = split_cores(_run(), (0, 1)).record(torch_threads=1)
    assert record == {"job": [0, 1], "engine": [0], "engine_pool": [0], "trainer": [1], "trainer_threads": 1,
                      "apart": True, "reason": "split: the engine stays up beside the trainer", "torch_threads": 1}


@pytest.mark.parametrize(("threads", "ranks", "each"), [("4", 2, 2), ("1", 2, 1), ("5", 2, 2), ("x", 1, None)])
def test_trainer_ranks_share_its_threads(threads: str, ranks: int, each: int | None) -> None:
    assert rank_threads(threads, ranks) == (each or os.cpu_count())
