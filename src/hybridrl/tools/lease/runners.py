"""Running one plan item: its `python -m hybridrl` command, environment, timeout, log and resume rule.

Every command runs under coreutils `timeout`, which puts itself and the command in a process group of their own and
signals that whole group when time is up: every process a run starts goes with it. An item whose result is already
there (a run's done.json, a benchmark's JSON) is skipped, so that a rerun of the study resumes. A dry run
(HYBRIDRL_DRY_RUN) only says what each item would run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from hybridrl.tools.lease.items import Bench, Ceiling, Fault, Item, Train, TrainerTool

CTL = Path("/tmp/ctl")  # the controller's wheels (run_reference.sh controller)
ENVS = Path("/tmp/envs")  # the engine and trainer overlays (gpu-env install): vllm/, trainer/, sglang/
PYTHON = "python3"  # the GPU machine's interpreter, as every command of the driver has called it


class ItemFailed(Exception):
    """An item that cannot start (its message already said): the rest of its lane does not run."""


def say(out: TextIO, message: str) -> None:
    """[HH:MM:SS] message: the driver's log lines."""
    out.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
    out.flush()


@dataclass(frozen=True)
class Site:
    """Where a study's items run: `repo` holds the code (src/, .gpu/src-REV/), `root` every study's folder
    (HYBRIDRL_REF_DIR), `ref` this study's folder ($root/<config name>)."""

    repo: Path
    root: Path
    ref: Path
    dry_run: bool = False

    @property
    def ctl_path(self) -> str:
        return f"{CTL}:{self.repo / 'src'}"


@dataclass(frozen=True)
class RunRef:
    """What the driver needs from a run's config file (cfg/<name>.json, the `run_config` rule's file)."""

    cfg: Path
    run_id: str
    model: str
    engine: str
    trainer: str

    @classmethod
    def read(cls, cfg: Path) -> RunRef:
        from hybridrl.study.config import read_run_spec  # the controller's wheels (pydantic): not for `plans`

        spec = read_run_spec(cfg)
        return cls(cfg, spec.run_id, spec.run.model, spec.run.engine, spec.run.trainer)

    def controller_path(self, site: Site) -> str:
        """The controller's PYTHONPATH for this run: in-process vLLM lives in the controller; Megatron's workers
        inherit it. Decided by the run's config, not its name."""
        path = site.ctl_path
        if self.engine == "vllm-inprocess":
            path = f"{ENVS / 'vllm'}:{path}"
        if self.trainer == "megatron":
            path = f"{ENVS / 'trainer'}:{path}"
        return path


def steps_in(run_dir: Path) -> int:
    """How many steps the run recorded; 0 before its first."""
    try:
        return (run_dir / "steps.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


def exit_code(returncode: int) -> int:
    """A process's exit status as bash reports it (128 + N for a process killed by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def barrier_release(env: Mapping[str, str], run_id: str) -> None:
    """A run that never reached the start barrier (already done, or died before the loop could say so) releases
    the runs waiting there."""
    from hybridrl.run.barrier import StartBarrier

    barrier = StartBarrier.from_env(dict(env))
    if barrier is not None:
        barrier.release(run_id)


def _child_env(env: Mapping[str, str], pythonpath: str, gpus: str | None) -> dict[str, str]:
    """The item's environment with its PYTHONPATH and GPUs; no GPUs = every GPU visible."""
    child = {**env, "PYTHONPATH": pythonpath}
    child.pop("CUDA_VISIBLE_DEVICES", None)
    if gpus:
        child["CUDA_VISIBLE_DEVICES"] = gpus
    return child


def _run(argv: list[str], env: Mapping[str, str], log: Path) -> int:
    with open(log, "wb") as f:
        done = subprocess.run(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              check=False)
    return exit_code(done.returncode)


def _train_argv(site: Site, run: RunRef, out: Path) -> list[str]:
    return [PYTHON, "-m", "hybridrl", "train", "--run-config", str(run.cfg), "--model",
            str(site.ref / "models" / run.model), "--data", str(site.ref / "data"), "--out", str(out), "--done",
            str(out / "done.json"), "--no-progress"]


def train(item: Train, gpus: str | None, site: Site, env: Mapping[str, str], out: TextIO) -> None:
    """One run; gpus None = every GPU visible (split)."""
    if site.dry_run:
        say(out, f"dry run: train {item.name} on GPU {gpus or 'all'}")
        if env.get("HYBRIDRL_START_BARRIER"):
            say(out, f"  meets the others at the start barrier {env['HYBRIDRL_START_BARRIER']}")
        return
    run = RunRef.read(site.ref / "cfg" / f"{item.name}.json")
    run_dir = site.ref / "runs" / run.run_id
    if (run_dir / "done.json").exists():  # a rerun of the study resumes
        say(out, f"train {item.name} already done")
        barrier_release(env, run.run_id)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    say(out, f"train {item.name} ({run.run_id}) on GPU {gpus or 'all'}")
    shutil.copyfile(run.cfg, run_dir / "config.json")
    timeout = env.get("HYBRIDRL_RUN_TIMEOUT_S") or "1800"
    rc = _run(["timeout", timeout, *_train_argv(site, run, run_dir)],
              _child_env(env, run.controller_path(site), gpus), run_dir / "train.log")
    barrier_release(env, run.run_id)
    say(out, f"train {item.name} exit {rc} ({steps_in(run_dir)} steps)")


def fault(item: Fault, gpus: str, site: Site, env: Mapping[str, str], out: TextIO) -> None:
    """One run through `hybridrl fault-run`, which hits it and starts it again; its judgement in
    bench/fault-NAME.json."""
    if site.dry_run:
        say(out, f"dry run: fault {item.name} on GPU {gpus}: engine kill in step {item.kill_at}, SIGTERM in step "
                 f"{item.term_at}")
        return
    result = site.ref / "bench" / f"fault-{item.name}.json"
    if result.exists():
        say(out, f"fault {item.name} already done")
        return
    run = RunRef.read(site.ref / "cfg" / f"{item.name}.json")
    run_dir = site.ref / "runs" / run.run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    result.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run.cfg, run_dir / "config.json")
    say(out, f"fault {item.name} ({run.run_id}) on GPU {gpus}")
    timeout = env.get("HYBRIDRL_RUN_TIMEOUT_S") or "1800"
    argv = ["timeout", timeout, PYTHON, "-m", "hybridrl", "fault-run", "--kill-engine-at", str(item.kill_at),
            "--term-at", str(item.term_at), "--out", str(result), "--", *_train_argv(site, run, run_dir)]
    rc = _run(argv, _child_env(env, run.controller_path(site), gpus), run_dir / "train.log")
    say(out, f"fault {item.name} exit {rc} ({steps_in(run_dir)} steps)")


def bench(item: Bench, gpus: str, site: Site, env: Mapping[str, str], out: TextIO) -> None:
    """The engine alone on step STEP's request set of that run, plus raw HTTP probes."""
    args = " ".join(item.args)
    if site.dry_run:
        say(out, f"dry run: bench {item.name} step {item.step} on GPU {gpus} {args}")
        return
    run = RunRef.read(site.ref / "cfg" / f"{item.name}.json")
    result = site.ref / "bench" / f"{item.name}.json"
    if result.exists():
        say(out, f"bench {item.name} already done")
        return
    say(out, f"bench {item.name} step {item.step} on GPU {gpus} {args}")
    argv = ["timeout", "600", PYTHON, "-m", "hybridrl", "bench", "--run-config", str(run.cfg), "--model",
            str(site.ref / "models" / run.model), "--data", str(site.ref / "data"), "--run-dir",
            str(site.ref / "runs" / run.run_id), "--step", str(item.step), "--repeats",
            env.get("HYBRIDRL_BENCH_REPEATS") or "3", "--probe", *item.args, "--out", str(result)]
    rc = _run(argv, _child_env(env, run.controller_path(site), gpus), site.ref / "bench" / f"{item.name}.log")
    say(out, f"bench {item.name} exit {rc}")


def ceiling(item: Ceiling, gpus: str | None, site: Site, env: Mapping[str, str], out: TextIO) -> None:
    """The rollout client's ceiling on this host; no GPU involved."""
    if site.dry_run:
        say(out, "dry run: client ceiling")
        return
    result = site.ref / "bench" / "client-ceiling.json"
    if result.exists():
        say(out, "client ceiling already measured")
        return
    say(out, "client ceiling")
    argv = [PYTHON, "-m", "hybridrl", "client-ceiling", "--out", str(result)]
    rc = _run(argv, {**env, "PYTHONPATH": site.ctl_path}, site.ref / "bench" / "client-ceiling.log")
    if rc:
        say(out, f"client ceiling exit {rc}")


def trainer_tool(item: TrainerTool, gpus: str, site: Site, env: Mapping[str, str], out: TextIO) -> None:
    """tbench/tprof: one trainer in a session of its own, killed whole afterwards: a benchmark killed by the host
    once left a worker holding the GPU under the next one (results/reference/2026-11-24-h200-trainer)."""
    what = f"{item.command} {item.shape} {item.trainer} mb {item.micro_batch}"
    what += "".join(f" {f}" for f in item.flags)
    if site.dry_run:
        say(out, f"dry run: {what} on GPU {gpus}")
        return
    # src-REV runs that commit's source (the last such flag wins); without one, the tree's
    src = site.repo / "src"
    for flag in item.snapshots:
        src = site.repo / ".gpu" / flag / "src"
    if not (src / "hybridrl" / "__init__.py").is_file():
        say(out, f"{item.result_name}: no hybridrl source at {src} (scripts/gpu/snapshot-src.sh)")
        raise ItemFailed(item.result_name)
    result = site.ref / "bench" / f"{item.result_name}.{item.ext}"
    if result.exists():
        say(out, f"{item.result_name} already done")
        return
    workdir = site.root / "trainer-bench"
    result.parent.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    say(out, f"{what} on GPU {gpus}")
    timeout = env.get("HYBRIDRL_TBENCH_TIMEOUT_S") or "900"
    argv = ["timeout", timeout, PYTHON, "-m", "hybridrl", item.command, "--shape", item.shape, "--trainer",
            item.trainer, "--micro-batch", str(item.micro_batch), *item.passed_flags, "--workdir", str(workdir),
            "--out", str(result)]
    child_env = _child_env(env, f"{ENVS / 'trainer'}:{CTL}:{src}", gpus)
    with open(site.ref / "bench" / f"{item.result_name}.log", "wb") as log:
        proc = subprocess.Popen(argv, env=child_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # its session's id is its pid: the group to kill
        rc = exit_code(proc.wait())
    with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing of it left
        os.killpg(proc.pid, signal.SIGKILL)
    say(out, f"{what} exit {rc}")


def run_item(item: Item, lane_gpus: str | None, site: Site, env: Mapping[str, str], out: TextIO) -> None:
    """One item; it runs on the lane's GPUs unless it names its own (train NAME GPUS)."""
    if isinstance(item, Train):
        train(item, item.gpus or lane_gpus, site, env, out)
    elif isinstance(item, Bench):
        bench(item, lane_gpus or "", site, env, out)
    elif isinstance(item, Fault):
        fault(item, lane_gpus or "", site, env, out)
    elif isinstance(item, Ceiling):
        ceiling(item, lane_gpus, site, env, out)
    elif isinstance(item, TrainerTool):
        trainer_tool(item, lane_gpus or "", site, env, out)
    else:
        raise TypeError(f"unknown plan item {item!r}")
