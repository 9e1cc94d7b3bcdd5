"""Controller side of the Megatron trainer: starts the torchrun process group once, sends one job per call.

Imports neither megatron nor torch.distributed; the workers do. Bad input (architecture, TP sizes, LoRA
rank) is rejected here, before any process starts.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hybridrl.run.cores import rank_threads
from hybridrl.run.record import STRINGS
from hybridrl.study.run_config import RunConfig
from hybridrl.trainers.base import Sample, TrainResult
from hybridrl.trainers.megatron.spec import MegatronSetupError, check_parallel, read_spec
from hybridrl.trainers.megatron.worker import POLL_MAX_S, pid_alive, write_json

_SRC = Path(__file__).resolve().parents[3]  # the directory holding the hybridrl package


class MegatronWorkerError(RuntimeError):
    """The worker process group failed; the message carries the worker's own error and log tail."""


# NCCL's communicator buffers stay on the GPU while the engine runs (offload cannot move them). On two
# H200s at TP 2 these cut the trainer's residual from 1.57 to 1.13 GiB (1.68 to 1.21 GB) at the same throughput
# (4,630 vs 4,637 tok/s); one channel of 256 KB gave 1.10 GiB but cost 28%.
# Megatron's groups stay lazily made, one communicator each: starting the world's at once (device_id) so that torch
# splits the groups from it left 1.55 GB (1.44 with NCCL_COMM_SPLIT_SHARE_RESOURCES=1) against 1.19 GB.
# Set either variable to override.
SMALL_NCCL_BUFFERS = {"NCCL_BUFFSIZE": str(1 << 20), "NCCL_MAX_NCHANNELS": "2"}


class MegatronTrainer:
    """GRPO + LoRA on megatron-core, run.train_tp x run.train_ep processes under torchrun.

    run: the run's config (the workers read lora, lr, weight_decay, clip_eps, kl_coef, grad_clip, seed, train_tp,
    train_ep, micro_batch, train_dtype; this side device and startup_timeout_s). work_dir: the run's directory;
    the job protocol files and worker.log go to work_dir/megatron (a temp dir if not given).
    offload_after_step: move weights and optimizer state to pinned CPU memory at the end of every step
    (colocate) without a separate offload() call. env: extra environment for the workers. megatron_permute: MoE
    tokens permuted by megatron's own dispatcher instead of hybridrl's gathers (trainer-bench's before-and-after).
    """

    def __init__(self, model_dir: str | Path, run: RunConfig, work_dir: str | Path | None = None, *,
                 device: str | None = None, env: dict[str, str] | None = None,
                 offload_after_step: bool = False, step_timeout_s: float = 3600.0,
                 resume_from: str | Path | None = None, megatron_permute: bool = False) -> None:
        self.model_dir = Path(model_dir)
        self.run = run
        self.device = device or ("cuda" if run.device == "cuda" else "cpu")
        self.tp, self.ep = run.train_tp, run.train_ep
        lora = run.lora
        spec = read_spec(self.model_dir)  # raises MegatronSetupError with the cause
        self.vocab_size = spec.vocab_size
        check_parallel(spec, self.tp, lora.rank, list(lora.target_modules), self.ep)
        if lora.dropout != 0.0:
            raise MegatronSetupError("lora.dropout must be 0 for the Megatron trainer")
        if self.device == "cuda":
            import torch

            if torch.cuda.device_count() < self.world:
                raise MegatronSetupError(f"train_tp={self.tp} x train_ep={self.ep} needs {self.world} visible GPUs, "
                                         f"found {torch.cuda.device_count()}")
        self.offload_after_step = offload_after_step
        self.step_timeout_s = step_timeout_s
        self.workdir = (Path(work_dir) / "megatron" if work_dir
                        else Path(tempfile.mkdtemp(prefix="hybridrl-megatron-")))
        self.workdir.mkdir(parents=True, exist_ok=True)
        for sub in ("jobs", "results"):
            (self.workdir / sub).mkdir(exist_ok=True)
            for stale in (self.workdir / sub).glob("*.json"):
                stale.unlink()
        for stale in [*self.workdir.glob("*.error-rank*.json"), self.workdir / "ready.json",
                      *self.workdir.glob("pid-rank*")]:
            stale.unlink(missing_ok=True)
        write_json(self.workdir / "config.json", {
            "model_dir": str(self.model_dir), "run": run.model_dump(mode="json"), "device": self.device,
            "controller_pid": os.getpid(), "resume_from": str(resume_from) if resume_from else None,
            "megatron_permute": megatron_permute})
        self.log_path = self.workdir / "worker.log"
        self.last_memory: dict[str, float] = {}
        self._seq = 0
        self._closed = False
        # the next step's update runs under torch.profiler in every worker: tables to PREFIX-rankK.txt
        self.profile_to: Path | None = None
        self._failed: str | None = None  # first failure; later calls report it instead of timing out
        self.proc = self._launch(env)
        atexit.register(self.close)
        try:
            info = self._wait(self.workdir / "ready.json", run.startup_timeout_s,
                              "startup", error_glob="startup.error-rank*.json")
        except BaseException:
            self.close()
            raise
        self.load_s = float(info.get("load_s", 0.0))
        # rank 0's GPU memory after the process groups were set up, then after the model loaded (empty off CUDA)
        self.start_memory: dict[str, dict[str, float]] = info.get("memory", {})
        self.experts_impl: str | None = info.get("experts_impl")
        self.moe_permute: str | None = info.get("moe_permute")  # gathers, megatron, or None (dense)
        # objects the workers keep out of Python's collections (worker.freeze_long_lived): after startup, then step 1
        self.gc_frozen: int | None = info.get("gc_frozen")
        self.rendezvous_port: int | None = info.get("rendezvous_port")

    @property
    def world(self) -> int:
        """The worker processes (and GPUs): one per TP x EP rank."""
        return self.tp * self.ep

    # -- process group ---------------------------------------------------------------------------------
    def _launch(self, extra_env: dict[str, str] | None) -> subprocess.Popen:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_SRC), env.get("PYTHONPATH", "")) if p)
        # torchrun pins OMP_NUM_THREADS=1 when unset; on CPU the ranks share the trainer's threads instead (the
        # controller's OMP_NUM_THREADS: hybridrl.run.cores sizes it to the trainer's cores)
        if self.device == "cpu":
            env["OMP_NUM_THREADS"] = str(rank_threads(env.get("OMP_NUM_THREADS"), self.world))
        else:
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.world)))
        env.setdefault("PYTHONWARNINGS", "ignore")
        env.update({k: v for k, v in SMALL_NCCL_BUFFERS.items() if k not in env})
        if extra_env:
            env.update(extra_env)
        # --standalone: a c10d store on localhost:0, a port the kernel picks free, so that trainers of jobs on one
        # node never meet on a fixed one (torchrun's default is 29500); the workers report it (rendezvous_port)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.world}",
               "-m", "hybridrl.trainers.megatron.worker", str(self.workdir)]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing to it
        try:
            # its own session, so close() can stop torchrun and everything it started as one group
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        finally:
            log.close()

    def _log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def _worker_error(self, pattern: str) -> str | None:
        for path in sorted(self.workdir.glob(pattern)) + sorted((self.workdir / "results").glob(pattern)):
            try:
                err = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            return f"{path.name}: {err.get('error')}\n{err.get('traceback', '')}"
        return None

    def _wait(self, path: Path, timeout_s: float, what: str, error_glob: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            if path.exists():
                return json.loads(path.read_text())
            err = self._worker_error(error_glob)
            if err is not None or self.proc.poll() is not None:
                # give a failing rank a moment to finish writing, then report its own words first
                time.sleep(0.2)
                err = self._worker_error(error_glob) or "(no error file; see the log)"
                self._kill()
                self._failed = f"megatron worker failed during {what}: {err.strip()}"
                raise MegatronWorkerError(f"{self._failed}\n--- {self.log_path} (tail) ---\n{self._log_tail()}")
            if time.monotonic() > deadline:
                self._kill()
                self._failed = f"megatron worker: no answer to {what} within {timeout_s:.0f} s; stopped it"
                raise MegatronWorkerError(f"{self._failed}. Log tail:\n{self._log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, POLL_MAX_S)

    def _job(self, op: str, timeout_s: float | None = None, **payload: Any) -> dict[str, Any]:
        if self._failed:
            raise MegatronWorkerError(f"the Megatron worker group is gone after an earlier failure: "
                                      f"{self._failed.splitlines()[0]}")
        if self._closed:
            raise MegatronWorkerError("the Megatron trainer is closed")
        self._seq += 1
        name = f"{self._seq:06d}"
        write_json(self.workdir / "jobs" / f"{name}.json", {"op": op, **payload})
        return self._wait(self.workdir / "results" / f"{name}.json", timeout_s or self.step_timeout_s,
                          f"job {name} ({op})", error_glob=f"{name}.error-rank*.json")

    # -- the Trainer protocol --------------------------------------------------------------------------
    def step(self, step: int, samples: list[Sample], out_dir: Path) -> TrainResult:
        if not samples:
            raise ValueError("step() needs at least one sample")
        for i, s in enumerate(samples):
            ids = s.prompt_ids + s.completion_ids
            # with TP > 1 an out-of-range id would silently embed as zeros, so refuse it here
            if not s.prompt_ids or not s.completion_ids or min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"sample {i}: needs a non-empty prompt and completion with token ids in "
                                 f"[0, {self.vocab_size})")
        out_dir = Path(out_dir)
        profile, self.profile_to = self.profile_to, None
        res = self._job("step", step=step, out_dir=str(out_dir), offload_after=self.offload_after_step,
                        samples=[asdict(s) for s in samples], profile_to=str(profile) if profile else None)
        # JSON's null is NaN here (no value, e.g. perf/mfu on CPU); flags such as train/keep_base_on_gpu stay bools
        # and string keys such as train/experts_impl strings or None (a dense model)
        metrics = {k: v if isinstance(v, bool | str) or k in STRINGS else math.nan if v is None else float(v)
                   for k, v in res["metrics"].items()}
        self.last_memory = {k: v for k, v in metrics.items() if k.startswith("mem/trainer_r")}
        self.gc_frozen = res.get("gc_frozen", self.gc_frozen)
        return TrainResult(out_dir, metrics)

    def offload(self) -> None:
        self.last_memory = self._job("offload").get("memory", {})

    def release_base(self) -> None:
        self.last_memory = self._job("release_base").get("memory", {})

    def onload(self) -> None:
        self._job("onload")

    def flush(self) -> float:
        return float(self._job("flush")["waited_s"])

    def resume(self, adapter_dir: Path) -> None:
        self._job("resume", adapter_dir=str(adapter_dir))

    def gpu_pids(self) -> list[int]:
        return self._rank_pids()

    def ports(self) -> dict[str, int]:
        return {"trainer_rendezvous": self.rendezvous_port} if self.rendezvous_port else {}

    def close(self) -> None:
        """Stop the whole process group: ask nicely, then SIGTERM, then SIGKILL. Safe to call twice."""
        if self._closed:
            return
        try:
            if self.proc.poll() is None:
                self._job("shutdown", timeout_s=60.0)
                self.proc.wait(timeout=30)
        except Exception:  # whatever happened, the processes must go
            pass
        finally:
            self._closed = True
            self._kill()
            atexit.unregister(self.close)

    def _rank_pids(self) -> list[int]:
        pids = []
        for f in sorted(self.workdir.glob("pid-rank*")):
            try:
                pid = int(f.read_text())
            except (OSError, ValueError):
                continue
            if _is_our_worker(pid, self.workdir):
                pids.append(pid)
        return pids

    def _kill(self) -> None:
        pids = self._rank_pids()
        # torchrun puts each rank in a session of its own, so stop the ranks by pid as well as the group
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = False
            if self.proc.poll() is None:
                alive = True
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, sig)
                    alive = True
                except ProcessLookupError:
                    pass
            if not alive:
                break
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
            if not any(pid_alive(p) for p in pids):
                break
            time.sleep(0.5)

    def __enter__(self) -> MegatronTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_our_worker(pid: int, workdir: Path) -> bool:
    """Only signal a pid that is still one of this trainer's ranks (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(workdir).encode() in cmdline and b"hybridrl.trainers.megatron.worker" in cmdline
