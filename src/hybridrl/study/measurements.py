"""A study's measurements resolved to jobs: each one's result file, the run it reads and the GPUs it needs.

The Snakefile turns each into a job (workflow/rules/measure.smk); its result lands in results/bench/<name>.<ext>,
named as the committed studies name theirs: <run>.json (engine bench), client-ceiling.json, fault-<run>.json,
trainer-<shape>-<trainer>-mb<N>[-flag...][-rK].json, profile-....txt,
trl-<run>-<defaults|gc-on|gc-off>[-awake][-rK].json and start-<run>.json.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridrl.study.run_config import RunConfig
from hybridrl.study.study_config import (
    ClientCeiling,
    EngineBench,
    FaultRun,
    Measurement,
    PeerTrl,
    StartBench,
    TrainerBench,
)

BENCH_DIR = "results/bench"


@dataclass(frozen=True)
class MeasureJob:
    """One measurement job: `name` is its result's stem; `run_id` the run it replays or trains (None for the
    trainer tools and the client's ceiling); `gpus` what it needs on CUDA; `device` where it runs; `replicate`
    which process of a trainer tool's or TRL peer's `replicates` it is (1 for every other kind)."""

    name: str
    spec: EngineBench | ClientCeiling | TrainerBench | FaultRun | PeerTrl | StartBench
    run_id: str | None
    gpus: int
    device: str
    replicate: int = 1

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def output(self) -> str:
        return f"{BENCH_DIR}/{self.name}.{'txt' if self.kind == 'trainer_profile' else 'json'}"


def replicate_names(base: str, replicates: int) -> list[str]:
    """One result stem a process: base, then base-rK for process K > 1."""
    return [base + (f"-r{k}" if k > 1 else "") for k in range(1, replicates + 1)]


def trainer_tool_names(spec: TrainerBench) -> list[str]:
    """trainer-SHAPE-TRAINER-mbN[-FLAG...] (profile-... for a profile), -rK for process K > 1 of `replicates`;
    KEY=VALUE flags as KEY-VALUE (no '=' in a file name)."""
    prefix = "trainer" if spec.kind == "trainer_bench" else "profile"
    base = "-".join([f"{prefix}-{spec.shape}-{spec.trainer}-mb{spec.micro_batch}",
                     *(f.replace("=", "-") for f in spec.flags)])
    return replicate_names(base, spec.replicates)


def trainer_tool_gpus(spec: TrainerBench, where: str = "measurement") -> int:
    """The GPUs a trainer tool's job takes: one, or N for the flag ep=N (the Megatron trainer sharded by expert
    parallelism, trainer-bench --ep N)."""
    values = [f.removeprefix("ep=") for f in spec.flags if f.startswith("ep=")]
    if not values:
        return 1
    if len(values) > 1 or not values[0].isdigit() or int(values[0]) < 1:
        raise ValueError(f"{where}.flags: {', '.join(spec.flags)}: give ep=N once, N a whole number of GPUs")
    return int(values[0])


def _run_of(spec: EngineBench | FaultRun | PeerTrl | StartBench, names: Mapping[str, str], where: str) -> str:
    if spec.run not in names:
        raise ValueError(f"{where}.run: {spec.run!r} is not a run of this study (runs: {', '.join(names)})")
    return names[spec.run]


def resolve_measurements(specs: Sequence[Measurement], runs: Mapping[str, RunConfig],
                         names: Mapping[str, str], where: str = "measurements") -> dict[str, MeasureJob]:
    """{name: job} in the study's order; ValueError naming the entry for an unknown run or a name given twice."""
    jobs: dict[str, MeasureJob] = {}
    for i, spec in enumerate(specs):
        at = f"{where}[{i}]"
        if isinstance(spec, EngineBench):
            rid = _run_of(spec, names, at)
            new = [MeasureJob(spec.run, spec, rid, runs[rid].tp, runs[rid].device)]
        elif isinstance(spec, FaultRun):
            rid = _run_of(spec, names, at)
            run = runs[rid]
            gpus = run.tp + (run.train_gpus if run.placement == "split" else 0)
            new = [MeasureJob(f"fault-{spec.run}", spec, rid, gpus, run.device)]
        elif isinstance(spec, PeerTrl):
            rid = _run_of(spec, names, at)
            run = runs[rid]
            if run.device == "cuda" and run.tp != 1:
                raise ValueError(f"{at}.run: {spec.run} has tp {run.tp}; TRL's peer mirrors one-GPU runs")
            new = [MeasureJob(name, spec, rid, 1, run.device, k)
                   for k, name in enumerate(replicate_names(spec.result_name, spec.replicates), 1)]
        elif isinstance(spec, StartBench):
            rid = _run_of(spec, names, at)
            new = [MeasureJob(f"start-{spec.run}", spec, rid, runs[rid].tp, runs[rid].device)]
        elif isinstance(spec, ClientCeiling):
            new = [MeasureJob("client-ceiling", spec, None, 0, "cpu")]
        else:
            device = "cpu" if "device=cpu" in spec.flags else "cuda"
            gpus = trainer_tool_gpus(spec, at)
            new = [MeasureJob(name, spec, None, gpus, device, k)
                   for k, name in enumerate(trainer_tool_names(spec), 1)]
        for job in new:
            if job.name in jobs:
                raise ValueError(f"{at}: its result {job.output} is also another measurement's")
            jobs[job.name] = job
    return jobs


def fault_runs(jobs: Mapping[str, MeasureJob]) -> set[str]:
    """The runs trained only through their fault run."""
    return {job.run_id for job in jobs.values() if job.kind == "fault_run" and job.run_id}


@dataclass(frozen=True)
class Inputs:
    """Where a measurement job finds what it reads: the run's folder and config, the model and the data."""

    run_dir: str = ""
    run_config: str = ""
    model: str = ""
    data: str = ""
    workdir: str = "resources/trainer-bench"


def measure_argv(job: MeasureJob, at: Inputs) -> list[str]:
    """The `python -m hybridrl ...` arguments of one measurement job, its result written to job.output."""
    spec = job.spec
    if isinstance(spec, EngineBench):
        return ["bench", "--run-config", at.run_config, "--model", at.model, "--data", at.data, "--run-dir",
                at.run_dir, "--step", str(spec.step), "--repeats", str(spec.repeats), "--probe", *spec.args,
                "--out", job.output]
    if isinstance(spec, FaultRun):
        train = ["python", "-m", "hybridrl", "train", "--run-config", at.run_config, "--model", at.model, "--data",
                 at.data, "--out", at.run_dir, "--done", f"{at.run_dir}/done.json", "--no-progress"]
        return ["fault-run", "--kill-engine-at", str(spec.kill_engine_at), "--term-at", str(spec.term_at), "--out",
                job.output, "--", *train]
    if isinstance(spec, PeerTrl):
        gc = {None: "default", True: "on", False: "off"}[spec.gradient_checkpointing]
        return ["peer-trl", "--run-config", at.run_config, "--model", at.model, "--data", at.data,
                "--micro-batch", str(spec.micro_batch), "--gradient-checkpointing", gc,
                *([] if spec.vllm_sleep else ["--vllm-awake"]),
                *(["--steps", str(spec.steps)] if spec.steps else []), *(["--lr", repr(spec.lr)] if spec.lr else []),
                "--workdir", f"resources/trl/{job.name}", "--out", job.output]
    if isinstance(spec, StartBench):
        return ["start-bench", "--run-config", at.run_config, "--model", at.model, "--repeats", str(spec.repeats),
                "--log-dir", f"logs/start/{job.name}", "--out", job.output]
    if isinstance(spec, ClientCeiling):
        return ["client-ceiling", *spec.args, "--out", job.output]
    command = "trainer-bench" if spec.kind == "trainer_bench" else "trainer-profile"
    return [command, "--shape", spec.shape, "--trainer", spec.trainer, "--micro-batch", str(spec.micro_batch),
            *(f"--{flag}" for flag in spec.flags), "--workdir", at.workdir, "--out", job.output]
