"""Which CPU cores of a run's job its engine and its trainer use, and how many threads each gets from them.

A CPU run's engine and trainer are two processes on one job's cores. Where the engine stays up while the trainer
trains (split, overlapped or not), the two must not take the same cores: vLLM's CPU worker binds its OpenMP pool
to cores and, after each batch, busy-polls its shared-memory queue there for a second before it idles, and a
trainer whose torch pool spans those cores waits at every parallel region for its thread there. On 2 cores beside
the resident vLLM CPU engine, the HF update took about 1.0 s with 2 threads and 0.06 s with 1. So the job's cores
are split: the engine takes the first half and binds its pool there, the trainer the rest and sizes its pool to
them. Where the engine is stopped before each update (restart), or the job has a single core, both use every core
in turn.

On CUDA nothing is split: the engine runs on its GPUs, and the trainer keeps the threads the job gives it.
The controller is not pinned to its cores (an engine it starts would inherit the mask); its thread counts are
what keeps it off the engine's cores, and the engine's binding keeps the engine off the trainer's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from hybridrl.engines.server import THREAD_CAPS
from hybridrl.study.cluster import grant_cpus, grant_in_env
from hybridrl.study.run_config import RunConfig

# vLLM's CPU build binds its worker's OpenMP threads to these cores ("0,1" or "0-3"; its default "auto" takes
# every core of the NUMA node the process may use, the trainer's included)
VLLM_BIND = "VLLM_CPU_OMP_THREADS_BIND"
VLLM_ENGINES = ("vllm", "vllm-inprocess")


@dataclass(frozen=True)
class CoreSplit:
    """The job's cores, and those the engine and the trainer use (the same ones where they take turns)."""

    job: tuple[int, ...]
    engine: tuple[int, ...]
    trainer: tuple[int, ...]
    reason: str

    @property
    def apart(self) -> bool:
        return not set(self.engine) & set(self.trainer)

    @property
    def trainer_threads(self) -> int:
        return len(self.trainer)

    @property
    def engine_pool(self) -> tuple[int, ...]:
        """The cores the engine's OpenMP pool binds to: all of its own but the last where it has more than one,
        which stays free for its scheduler process, as vLLM's automatic binding leaves one."""
        return self.engine[:-1] if len(self.engine) > 1 else self.engine

    def record(self, torch_threads: int | None = None) -> dict[str, Any]:
        """For provenance.json: the cores by role, the thread counts they give, and the threads torch uses in the
        recording process (where given)."""
        return {"job": list(self.job), "engine": list(self.engine), "engine_pool": list(self.engine_pool),
                "trainer": list(self.trainer), "trainer_threads": self.trainer_threads, "apart": self.apart,
                "reason": self.reason, "torch_threads": torch_threads}


def granted_count(environ: Mapping[str, str]) -> int | None:
    """How many cores the job was given: SLURM's CPUs per task, else the `threads` Snakemake gave the job (it sets
    OMP_NUM_THREADS to them); None where neither says."""
    granted = grant_cpus(grant_in_env(environ))
    if granted:
        return granted
    text = environ.get("OMP_NUM_THREADS", "")
    return int(text) if text.isdigit() and int(text) > 0 else None


def job_cores(environ: Mapping[str, str] = os.environ, affinity: Iterable[int] | None = None) -> tuple[int, ...]:
    """The cores this job may use: the process's affinity (SLURM's cpuset, taskset), its first N where the job was
    given fewer (a grant without a cpuset, or Snakemake's --cores below the machine's)."""
    cores = sorted(os.sched_getaffinity(0) if affinity is None else affinity)
    count = granted_count(environ)
    return tuple(cores[:count] if count else cores)


def split_cores(run: RunConfig, cores: tuple[int, ...]) -> CoreSplit:
    """Who uses which of the job's cores (the module's docstring says why)."""
    if run.device != "cpu":
        return CoreSplit(cores, cores, cores, "cuda: the engine runs on its GPUs; threads as the job sets them")
    if run.placement == "restart" or run.trainer == "none":
        return CoreSplit(cores, cores, cores, f"{run.placement}: the engine is stopped while the trainer trains")
    if len(cores) < 2:
        return CoreSplit(cores, cores, cores, "one core: engine and trainer share it")
    half = len(cores) // 2
    return CoreSplit(cores, cores[:half], cores[half:], f"{run.placement}: the engine stays up beside the trainer")


def engine_env(run: RunConfig, split: CoreSplit) -> dict[str, str]:
    """Environment that keeps a CPU engine on its cores; nothing on CUDA or for an engine without a CPU build."""
    if run.device != "cpu" or run.engine not in VLLM_ENGINES:
        return {}
    return {VLLM_BIND: ",".join(str(c) for c in split.engine_pool)}


def engine_env_spec(run: RunConfig, env_spec: Mapping[str, Any], split: CoreSplit) -> dict[str, Any]:
    """The engine's env spec (the study's engine_envs entry) with engine_env added; a variable the study sets
    itself wins."""
    return {**env_spec, "env": {**engine_env(run, split), **env_spec.get("env", {})}}


def rank_threads(threads: str | None, ranks: int) -> int:
    """Each of `ranks` processes' share of `threads` (the OMP_NUM_THREADS they would inherit; where unset, the
    machine's cores), at least one: ranks of one trainer on CPU share its cores rather than each taking all."""
    total = int(threads) if threads and threads.isdigit() else (os.cpu_count() or 1)
    return max(1, total // ranks)


def apply_trainer_threads(run: RunConfig, split: CoreSplit, environ: MutableMapping[str, str] = os.environ) -> int:
    """Size this process's torch pool, and the pools of the processes it starts (a rollout worker, torchrun), to the
    trainer's cores on CPU; returns the threads torch now uses. On CUDA the job's own settings stay."""
    import torch

    if run.device == "cpu":
        torch.set_num_threads(split.trainer_threads)
        environ.update(dict.fromkeys(THREAD_CAPS, str(split.trainer_threads)))
    return torch.get_num_threads()
