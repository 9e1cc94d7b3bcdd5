"""The torchrun worker: one process per TP x EP rank, alive for the whole run, one job per request.

    torchrun --standalone --nproc-per-node TP*EP -m hybridrl.trainers.megatron.worker JOB_DIR

Protocol (all files in JOB_DIR, each written to a temp name and renamed, so a reader never sees half):
    config.json                  written by the controller: model_dir, run, device, controller_pid
    pid-rank<R>                  each rank's pid, so the controller can stop every process it caused
    ready.json                   TP rank 0, once the model is built
    jobs/<seq>.json              the controller: {"op": step|offload|onload|resume|shutdown, ...}
    results/<seq>.json           TP rank 0: {"ok": true, ...}
    results/<seq>.error-rank<R>.json, startup.error-rank<R>.json
                                 any rank that failed: {"ok": false, "error": ..., "traceback": ...}
Every rank reads the jobs itself, so no collective waits while the engine generates. A rank that fails
writes its error and exits non-zero; torchrun then stops the others.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hybridrl.atomic import write_text
from hybridrl.proc import stat_fields

RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj))


def check_rank_env(environ: dict[str, str] | os._Environ = os.environ) -> None:
    missing = [k for k in RANK_ENV if k not in environ]
    if missing:
        raise SystemExit(
            f"hybridrl megatron worker: {', '.join(missing)} not set. This process is one TP rank and must be "
            "started by torchrun (MegatronTrainer does that: torchrun --standalone --nproc-per-node TP "
            "-m hybridrl.trainers.megatron.worker JOB_DIR)")


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


# the longest sleep between two looks for a job or a result file: each side's wait adds up to this to every job, and
# at 50 ms an update's wall time came in 50 ms steps (48-layer benchmarks); a stat every 5 ms costs nothing
POLL_MAX_S = 0.005


def _wait_for_job(path: Path, controller_pid: int) -> dict[str, Any]:
    delay, last_check = 0.001, time.monotonic()
    while not path.exists():
        time.sleep(delay)
        delay = min(delay * 1.5, POLL_MAX_S)
        if time.monotonic() - last_check > 2.0:
            last_check = time.monotonic()
            # the controller died without saying goodbye: do not outlive it on the GPU
            if controller_pid and not pid_alive(controller_pid):
                raise SystemExit(f"controller pid {controller_pid} is gone; worker exiting")
    return json.loads(path.read_text())


def freeze_long_lived() -> int:
    """Collect the garbage, then keep every object alive now out of later collections; returns how many are kept out.

    A worker holds hundreds of thousands of objects (torch, megatron, the model's modules); Python's full
    collection walks them all (0.23 s for a tiny MoE model's worker on a CPU), and one such pass fell inside an
    early update: the second timed 48-layer Megatron update was 0.25 to 0.6 s slower than the others in every
    process of four leases, HF's never. Frozen objects are still freed by reference counting.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun ... -m hybridrl.trainers.megatron.worker JOB_DIR", file=sys.stderr)
        return 2
    check_rank_env()
    job_dir = Path(argv[0])
    rank = int(os.environ["RANK"])
    (job_dir / f"pid-rank{rank}").write_text(str(os.getpid()))
    cfg = json.loads((job_dir / "config.json").read_text())
    try:
        policy = _start(cfg, rank)
    except BaseException as exc:
        write_json(job_dir / f"startup.error-rank{rank}.json", _error(exc))
        raise
    policy.ready_info["gc_frozen"] = freeze_long_lived()
    # torchrun's rendezvous store, which --standalone lets the kernel pick: the run records it
    policy.ready_info["rendezvous_port"] = int(os.environ["MASTER_PORT"])
    if rank == 0:
        write_json(job_dir / "ready.json", {"ok": True, **policy.ready_info})
    seq, stepped = 1, False
    jobs, results = job_dir / "jobs", job_dir / "results"
    while True:
        job = _wait_for_job(jobs / f"{seq:06d}.json", int(cfg.get("controller_pid", 0)))
        try:
            result = _handle(policy, job)
            if job["op"] == "step" and not stepped:  # inside the first step's time: the optimizer's state is new
                result["gc_frozen"], stepped = freeze_long_lived(), True
        except BaseException as exc:
            write_json(results / f"{seq:06d}.error-rank{rank}.json", _error(exc))
            raise
        if rank == 0:
            write_json(results / f"{seq:06d}.json", {"ok": True, **result})
        if job["op"] == "shutdown":
            break
        seq += 1
    _shutdown()
    # skip interpreter teardown (seconds of module finalisers); everything is written and flushed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _error(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _start(cfg: dict[str, Any], rank: int) -> Any:
    import warnings

    warnings.filterwarnings("ignore", module=r"megatron\..*")
    import torch

    from hybridrl.study.run_config import RunConfig
    from hybridrl.trainers.megatron.policy import MegatronPolicy, gpu_memory_of, init_parallel

    t0 = time.perf_counter()
    run = RunConfig.model_validate(cfg["run"])
    if cfg["device"] == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    torch.manual_seed(run.seed)
    init_parallel(run.train_tp, device, run.train_ep)
    # the process's GPU memory before the model exists and before its first collective (NCCL makes a group's
    # communicator then): the CUDA context and NCCL's library state alone, which no offload can free
    at_init = gpu_memory_of(device)
    policy = MegatronPolicy(cfg["model_dir"], run, device, megatron_permute=bool(cfg.get("megatron_permute")))
    if cfg.get("resume_from"):
        policy.resume(Path(cfg["resume_from"]))
    policy.ready_info = {"load_s": time.perf_counter() - t0, "tp": policy.tp, "ep": policy.ep,
                         "lora_params": sum(p.numel() for p in policy.params) * policy.tp,
                         "experts_impl": policy.experts_impl, "moe_permute": policy.moe_permute,
                         "memory": {"init": at_init, "load": gpu_memory_of(device)}}
    if rank == 0:  # into worker.log: which MoE experts kernel this run trains with
        print(f"hybridrl megatron worker: tp {policy.tp}, ep {policy.ep}, device {device}, "
              f"experts {policy.experts_impl or 'dense'}", flush=True)
    return policy


def _handle(policy: Any, job: dict[str, Any]) -> dict[str, Any]:
    from hybridrl.trainers.base import Sample

    op = job["op"]
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    if op == "step":
        samples = [Sample(**s) for s in job["samples"]]
        if job.get("profile_to"):  # this update under torch.profiler, its table one a rank
            metrics = _profiled_step(policy, samples, job["profile_to"], job["step"])
        else:
            metrics = policy.step(samples)
        t1 = time.perf_counter()
        metrics["train/lora_norm"] = policy.save(Path(job["out_dir"]))
        metrics["timing_s/save_adapter"] = time.perf_counter() - t1
        if job.get("offload_after"):
            policy.offload()
            metrics.update(policy.gpu_memory())
        out["metrics"] = metrics
    elif op == "offload":
        policy.offload()
        out["memory"] = policy.gpu_memory()
    elif op == "release_base":
        policy.release_base()
        out["memory"] = policy.gpu_memory()
    elif op == "onload":
        policy.onload()
    elif op == "flush":
        out["waited_s"] = policy.flush()
    elif op == "resume":
        policy.resume(Path(job["adapter_dir"]))
    elif op == "shutdown":
        policy.state_writer.close()
    else:
        raise ValueError(f"unknown job op {op!r}")
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def _profiled_step(policy: Any, samples: list[Any], prefix: str, step: int) -> dict[str, Any]:
    """policy.step under torch.profiler; its operators' tables to PREFIX-rankK.txt."""
    import torch.distributed as dist

    from hybridrl.atomic import write_text
    from hybridrl.trainers.op_profile import profiled

    rank, ranks = dist.get_rank(), dist.get_world_size()
    metrics, table = profiled(lambda: policy.step(samples), policy.device.type == "cuda")
    write_text(Path(f"{prefix}-rank{rank}.txt"), f"megatron update (step {step}), rank {rank} of {ranks}, tp "
               f"{policy.tp}, ep {policy.ep}, {len(samples)} samples\n{table}\n")
    return metrics


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
