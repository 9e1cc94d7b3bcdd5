import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.settings.types import DeploymentMethod

sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from hybridrl.study import cluster  # noqa: E402
from hybridrl.study.config import ConfigError, dataset_name, resolve  # noqa: E402
from hybridrl.study.measurements import Inputs, fault_runs, measure_argv  # noqa: E402
from hybridrl.study.rule_params import (
    data_params,
    model_build_gpus,
    model_spec,
    run_spec_json,
)  # noqa: E402

# the file the study came from, for the message (several --configfile files merge into one config)
# (--configfile files are merged into Snakemake's overwrite_config too, so --config is read off the command line)
_SOURCE = ", ".join(
    str(f) for f in workflow.overwrite_configfiles or ["config/config.yaml"]
) + (" with --config" if {"--config", "-C"} & set(sys.argv) else "")
try:
    STUDY = resolve(config, source=_SOURCE)
except ConfigError as exc:
    # one line, as the Snakefile answers a broken default study (a WorkflowError adds a header and traceback line)
    raise SystemExit(f"hybridrl: config error: {exc}") from None

RUNS = STUDY.runs
DATASET = dataset_name(STUDY.data)
DATA_DIR = f"resources/data/{DATASET}"
DATA = data_params(STUDY.data)  # the `data` rule's arguments
MEASUREMENTS = STUDY.measurements
FAULT_RUNS = fault_runs(MEASUREMENTS)  # trained only through their fault run


def run_spec(wildcards) -> str:
    """The resolved run as JSON: a params change reruns exactly that run."""
    rid = wildcards.run_id
    if rid not in RUNS:
        raise WorkflowError(
            f"run {rid} is not in this study; known runs: {', '.join(RUNS)}"
        )
    return run_spec_json(STUDY, rid)


def run_model_spec(wildcards) -> str:
    return model_spec(STUDY.models[wildcards.model])


# RUNS lists the runs round by round (config.interleaved: A1 B1 C1 A2 B2 C2, or balanced). Where jobs wait for
# a free GPU or core, the scheduler starts the highest priority first, so replicates run interleaved across
# arms; measurements come after every run. A priority, unlike a dependency between runs, never makes one run
# rerun because another changed.
RUN_PRIORITY = {rid: len(RUNS) - i for i, rid in enumerate(RUNS)}


def run_priority(wildcards) -> int:
    return RUN_PRIORITY[wildcards.run_id]


def run_done(rid: str) -> str:
    """What says a run has finished: its done.json, or its fault run's judgement for a run trained only there."""
    if rid in FAULT_RUNS:
        return next(
            job.output
            for job in MEASUREMENTS.values()
            if job.kind == "fault_run" and job.run_id == rid
        )
    return f"results/runs/{rid}/done.json"


# The study's order on SLURM: every job's --nice is its rank (the model builds first, then the runs and
# measurements in the study's order: config.job_ranks); with node.sharing one_at_a_time each job has the node
# alone (--exclusive) and is a rule of its own (an array would give every task the first task's flags).
SHARING = STUDY.node.sharing
ONE_AT_A_TIME = SHARING == "one_at_a_time"


def run_sbatch(wildcards) -> str:
    return cluster.sbatch_order(STUDY.ranks[wildcards.run_id], ONE_AT_A_TIME)


def measure_sbatch(wildcards) -> str:
    return cluster.sbatch_order(STUDY.ranks[wildcards.name], ONE_AT_A_TIME)


MODEL_SBATCH = cluster.sbatch_order(0, ONE_AT_A_TIME)
# a run's time limit from the study, where it sets one; otherwise the profile's runtime
RUN_LIMITS = (
    {"runtime": lambda wildcards, attempt: STUDY.run_minutes * attempt}
    if STUDY.run_minutes
    else {}
)


def run_model(wildcards) -> str:
    return f"resources/models/{RUNS[wildcards.run_id].model}"


# --- resources, deployment and containers (SLURM: slurm/config.v8+.yaml, docs/cluster.md) ---
# The logic is in hybridrl.study.cluster, where it is unit-tested; these wrappers take wildcards.
FAKE_GPUS = (
    os.environ.get(cluster.ENV_FAKE_GPUS) == "1"
)  # CI only: fake GRES, see scripts/slurm-ci-cluster.sh
SDM_APPTAINER = (
    DeploymentMethod.APPTAINER in workflow.deployment_settings.deployment_method
)
try:
    DEPLOY = cluster.deployment(SDM_APPTAINER, os.environ)
except ValueError as exc:
    raise WorkflowError(str(exc)) from None
CONTAINER_RUNS = {
    rid
    for rid, run in RUNS.items()
    if DEPLOY == "apptainer" and cluster.uses_container(run)
}
APPTAINER = cluster.apptainer_binary()
SRC = os.path.relpath(
    Path(workflow.basedir) / "src"
)  # the checkout's code, also inside an image
# Threads of a CPU run: --cores where given (local), else one. A SLURM job step re-reads this file
# with --cores all, so there the job's grant decides, keeping the step's srun within the allocation.
GRANT = cluster.job_grant(os.environ) if workflow.remote_exec else None
CORES = cluster.grant_cpus(GRANT) or workflow.resource_settings.cores or 1


def run_gpus(wildcards) -> int:
    """Inference TP plus, for split, the trainer's own GPUs; CPU runs ask for none."""
    return cluster.job_gpus(RUNS[wildcards.run_id], fake=FAKE_GPUS)


def run_gpu_model(wildcards) -> str:
    """`--gpus=<model>:<n>` when HYBRIDRL_SLURM_GPU_MODEL is set; never on CPU jobs, which the plugin
    would otherwise give one GPU."""
    return os.environ.get(cluster.ENV_GPU_MODEL, "") if run_gpus(wildcards) else ""


def run_threads(wildcards) -> int:
    """CPU runs take the whole machine, so two runs never share cores and skew each other's timings."""
    return cluster.job_threads(RUNS[wildcards.run_id], CORES)


def image_of(run_id: str) -> str | None:
    if run_id not in CONTAINER_RUNS:
        return None
    return f"resources/containers/{cluster.backend(RUNS[run_id].engine)}.sif"


def run_image(wildcards) -> list[str]:
    """The image and its digest as inputs, so the DAG builds the image before the run and a new
    image reruns it; nothing for runs without a container."""
    image = image_of(wildcards.run_id)
    return [image, f"{image}.json"] if image else []


def run_container(wildcards) -> str | None:
    # Without apptainer, only a dry run gets this far in the main process (workflow/rules/cluster.smk
    # stops a real one): leaving the image out lets the listing finish. A job step always names it.
    if APPTAINER or not workflow.is_main_process:
        return image_of(wildcards.run_id)
    return None


def run_prelude(wildcards) -> str:
    return prelude(wildcards.run_id)


def prelude(
    rid: str | None,
    trainer: str | None = None,
    engine: str | None = None,
    peer: bool = False,
) -> str:
    """Shell before a job: inside an image, the checkout's code first on PYTHONPATH and the image's digest for
    provenance; with the wheelhouse deployment, the backend's environment first on PATH; with the overlay
    deployment, the controller's overlays first on PYTHONPATH, after a wait for them where the job runs an engine
    or Megatron (a model build or an HF trainer benchmark needs only the base image). `engine` replaces the run's
    (TRL's peer runs vLLM in its own process whatever engine the run it mirrors uses); `peer` adds TRL's overlay.
    """
    run = RUNS[rid] if rid else None
    image = image_of(rid) if rid else None
    if image:
        return (
            f"export PYTHONPATH={SRC}${{PYTHONPATH:+:$PYTHONPATH}}; "
            f"export HYBRIDRL_IMAGE_DIGEST=$(python -m hybridrl.study.cluster digest {image}.json); "
        )
    if DEPLOY == "venv" and run and run.device == "cuda":
        venv = cluster.venv_python(
            Path(workflow.basedir), cluster.backend(run.engine)
        ).parent
        return (
            f"export PATH={venv}:$PATH PYTHONPATH={SRC}${{PYTHONPATH:+:$PYTHONPATH}}; "
        )
    if DEPLOY == "overlay":
        root = os.environ.get(cluster.ENV_OVERLAYS, cluster.DEFAULT_OVERLAYS)
        trainer = trainer or (run.trainer if run else "")
        engine = engine or (run.engine if run else "")
        paths = cluster.controller_overlays(engine, trainer, root, peer)
        wait = (
            f"python -m hybridrl.study.cluster await-overlays {root} && "
            if run or trainer == "megatron"
            else ""
        )
        return f"{wait}export PYTHONPATH={':'.join([*paths, SRC])}${{PYTHONPATH:+:$PYTHONPATH}}; "
    return ""


# Train rules by job shape, with their run ids: the SLURM plugin gives all tasks of an array the
# first task's resources, so runs that need different GPU counts must not share a rule.
TRAIN_RULES = cluster.shapes(
    {rid: run for rid, run in RUNS.items() if rid not in FAULT_RUNS}, fake=FAKE_GPUS
)
if ONE_AT_A_TIME:
    TRAIN_RULES = cluster.one_rule_a_job(TRAIN_RULES)
