"""SLURM and container glue for the Snakemake rules: a run's backend image, its job shape, the checks
that must pass before anything is submitted, and the record of what SLURM granted each job.

`python -m hybridrl.study.cluster record-job OUT` runs inside the job (and inside its container, where
`scontrol` is absent), so the grant is read from the SLURM_* environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridrl import nvml
from hybridrl.atomic import write_text

if TYPE_CHECKING:  # only types here: this glue also runs inside images, before any run
    from hybridrl.study.measurements import MeasureJob
    from hybridrl.study.run_config import RunConfig

# One image per serving stack: the in-process vLLM baseline runs in the vLLM image.
BACKENDS = {"sglang": "sglang", "vllm": "vllm", "vllm-inprocess": "vllm"}
# TRL's peer (measurement peer_trl) runs vLLM inside its trainer's process: its overlays and image are these
PEER_ENGINE = "vllm-inprocess"
# Where scripts/wheelhouse.sh installs the per-backend environments (the deployment without Apptainer).
VENV_DIR = ".venvs"
# Threads of a GPU run's job: the controller, the NVML sampler and the engine's CPU side.
GPU_RUN_THREADS = 8
# The SLURM grant as the job sees it; SLURM_JOB_START_TIME/END_TIME exist from Slurm 23.02 on.
JOB_ENV = (
    "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT", "SLURM_JOB_ACCOUNT",
    "SLURM_JOB_PARTITION", "SLURM_JOB_QOS", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_CPUS_PER_TASK",
    "SLURM_CPUS_ON_NODE", "SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_GPUS", "SLURM_GPUS_ON_NODE",
    "SLURM_JOB_GPUS", "SLURM_TRES_PER_TASK", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_START_TIME", "SLURM_JOB_END_TIME",
    "SLURM_CLUSTER_NAME",
)
# From `scontrol show job -o`: the request as SLURM took it (TresPerJob shows --gpus).
SCONTROL_KEYS = (
    "JobId", "ArrayJobId", "ArrayTaskId", "Account", "Partition", "QOS", "TimeLimit", "NumNodes", "NumCPUs",
    "CPUs/Task", "MinMemoryNode", "MinMemoryCPU", "TRES", "TresPerJob", "TresPerNode", "Requeue", "Restarts",
    "NodeList", "SubmitTime", "StartTime", "Comment", "Nice", "OverSubscribe",
)
GRANT_ENV = "HYBRIDRL_SLURM_GRANT"
# What the profile reads from the environment; named in messages so the fix is obvious.
ENV_ACCOUNT = "HYBRIDRL_SLURM_ACCOUNT"
ENV_PARTITION = "HYBRIDRL_SLURM_PARTITION"
ENV_GPU_MODEL = "HYBRIDRL_SLURM_GPU_MODEL"
ENV_DEPLOY = "HYBRIDRL_DEPLOY"
ENV_FAKE_GPUS = "HYBRIDRL_SLURM_FAKE_GPUS"
# The overlay deployment (the leased GPU machine): shared/gpu/gpu-env installs one site-packages overlay per
# stack under this folder and touches READY once every part has arrived; jobs wait for it.
ENV_OVERLAYS = "HYBRIDRL_OVERLAYS"
DEFAULT_OVERLAYS = "/tmp/envs"
OVERLAYS_READY = ".ready"
PROFILE = "slurm/config.v8+.yaml"


def backend(engine: str) -> str:
    try:
        return BACKENDS[engine]
    except KeyError:
        raise ValueError(f"engine {engine!r} has no container backend; known: {', '.join(BACKENDS)}") from None


def needs_gpus(run: RunConfig) -> int:
    """GPUs a run needs on CUDA: the engine's TP plus, for split, the trainer's own GPUs."""
    return run.tp + (run.train_gpus if run.placement == "split" else 0)


def job_gpus(run: RunConfig, fake: bool = False) -> int:
    """GPUs to request from SLURM. CPU runs ask for none, unless `fake` (CI with fake GRES) asks them
    to request what they would need on CUDA, so that --gpus is exercised for real."""
    if run.device == "cuda" or fake:
        return needs_gpus(run)
    return 0


def uses_container(run: RunConfig) -> bool:
    """The images carry the CUDA stacks; CPU runs use the CPU engine environment from the config."""
    return run.device == "cuda"


def job_threads(run: RunConfig, cores: int) -> int:
    """CPU runs take all cores they are given, so that two runs never share cores and skew timings."""
    return cores if run.device == "cpu" else GPU_RUN_THREADS


def rule_name(gpus: int, device: str) -> str:
    """The train rule of a job shape: train_gpu<N> for CUDA runs, train_cpu for CPU runs
    (train_cpu_gpu<N> when fake GRES make CPU runs ask for GPUs)."""
    if device == "cuda":
        return f"train_gpu{gpus}"
    return f"train_cpu_gpu{gpus}" if gpus else "train_cpu"


def shapes(runs: Mapping[str, RunConfig], fake: bool = False) -> dict[str, list[str]]:
    """Rule name -> run ids, one rule per job shape.

    The SLURM plugin submits the ready jobs of one rule as one array and gives every task the first
    task's resources, so runs with different GPU counts must never share a rule. Threads follow the
    device, so (GPUs, device) fixes the shape; the name must not depend on --cores, which differs
    between the submitting process and the job step that re-reads the Snakefile.
    """
    out: dict[str, list[str]] = {}
    for rid, run in sorted(runs.items()):
        out.setdefault(rule_name(job_gpus(run, fake), run.device), []).append(rid)
    return out


def one_rule_a_job(shapes: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """Each job a rule of its own (RULE_1, RULE_2, ...): no job array, so that every job keeps its own sbatch
    flags (an array gives every task the first task's, its --nice included)."""
    return {f"{rule}_{i}": [name] for rule, names in shapes.items() for i, name in enumerate(names, 1)}


# --nice a rank apart: more than the 1 a job's later submission costs it under priority/basic, so that the
# study's order wins over the order in which Snakemake happens to submit a batch of ready jobs
NICE_STEP = 1000


def sbatch_order(rank: int, one_at_a_time: bool) -> str:
    """The sbatch flags of a study that runs one job at a time: --exclusive (the node alone for each job) and
    --nice=RANK * NICE_STEP, so that of the jobs waiting for the node the lowest rank starts first (a singleton
    dependency would serialise them too, but releases them in submission order, whatever their priority). Nothing
    where jobs may run side by side: there the order within an array is Snakemake's."""
    return f"--nice={rank * NICE_STEP} --exclusive" if one_at_a_time else ""


def measure_gpus(job: MeasureJob, fake: bool = False) -> int:
    """GPUs a measurement job asks SLURM for: as a run's, CPU jobs none unless `fake` (CI with fake GRES)."""
    return job.gpus if job.device == "cuda" or fake else 0


def measure_threads(job: MeasureJob, cores: int) -> int:
    return GPU_RUN_THREADS if job.device == "cuda" else cores


def measure_shapes(jobs: Mapping[str, MeasureJob], fake: bool = False) -> dict[str, list[str]]:
    """Rule name -> measurement names, one rule per kind and job shape (engine_bench_gpu1, client_ceiling_cpu,
    ...), for the same reason as `shapes`."""
    out: dict[str, list[str]] = {}
    for name, job in jobs.items():
        gpus = measure_gpus(job, fake)
        out.setdefault(f"{job.kind}_{f'gpu{gpus}' if gpus else 'cpu'}", []).append(name)
    return out


def dry_run_requested(argv: Iterable[str]) -> bool:
    """Snakemake parses the Snakefile before it picks the executor, so a Snakefile cannot ask whether
    this is a dry run; the command line can (-n, -np, --dry-run, --dryrun)."""
    for arg in argv:
        if arg in ("--dry-run", "--dryrun"):
            return True
        if re.fullmatch(r"-[A-Za-z]*n[A-Za-z]*", arg):
            return True
    return False


def apptainer_binary(which: Callable[[str], str | None] = shutil.which) -> str | None:
    return which("apptainer") or which("singularity")


def deployment(sdm_apptainer: bool, environ: Mapping[str, str]) -> str:
    """How GPU runs get their software: `apptainer` (one image per backend, the default under
    --sdm apptainer), `venv` (per-backend environments from the offline wheelhouse), `overlay` (gpu-env's
    site-packages overlays under HYBRIDRL_OVERLAYS, the leased GPU machine) or `host` (whatever `python` is on
    PATH, e.g. a GPU box set up by hand). HYBRIDRL_DEPLOY=venv|overlay|host overrides."""
    choice = environ.get(ENV_DEPLOY, "").strip().lower()
    if choice and choice not in DEPLOYMENTS:
        raise ValueError(f"{ENV_DEPLOY}={choice!r}: expected {', '.join(DEPLOYMENTS)}")
    if choice:
        return choice
    return "apptainer" if sdm_apptainer else "host"


DEPLOYMENTS = ("apptainer", "venv", "overlay", "host")


def controller_overlays(engine: str, trainer: str, root: str, peer: bool = False) -> list[str]:
    """The overlays a job's controller needs before its own code: in-process vLLM lives in the controller, and
    Megatron's torchrun workers inherit the controller's path; TRL's peer adds its own set (TRL, datasets and what
    they need beyond the image). HTTP engines get theirs from the study's engine_envs, so the controller's own
    stack (transformers, the HF trainer) stays the base image's."""
    sets = (["vllm"] if engine == "vllm-inprocess" else []) + (["trainer"] if trainer == "megatron" else [])
    sets += ["peer"] if peer else []
    return [f"{root}/{name}" for name in sets]


def await_overlays(root: Path, timeout_s: float, poll_s: float = 1.0, sleep: Callable[[float], None] = time.sleep,
                   ) -> None:
    """Wait until gpu-env has installed every overlay (ROOT/.ready): on a lease the study starts while the parts
    still travel. SystemExit with one line once timeout_s has passed."""
    waited = 0.0
    while not (root / OVERLAYS_READY).exists():
        if waited >= timeout_s:
            raise SystemExit(f"hybridrl: the overlays under {root} were not installed within {timeout_s:.0f} s (no "
                             f"{root / OVERLAYS_READY}): the lease's last transfer call runs `gpu-env install` and "
                             "touches it (docs/gpu.md)")
        sleep(poll_s)
        waited += poll_s


def venv_python(root: Path, backend_name: str) -> Path:
    return root / VENV_DIR / f"gpu-{backend_name}" / "bin" / "python"


def check_apptainer(container_runs: Iterable[str], sdm_apptainer: bool,
                    which: Callable[[str], str | None] = shutil.which) -> list[str]:
    runs = sorted(container_runs)
    if not runs:
        return []
    if not sdm_apptainer:
        return [f"{ENV_DEPLOY}=apptainer needs --sdm apptainer (slurm/config.v8+.yaml sets it)"]
    if apptainer_binary(which):
        return []
    return [
        "--sdm apptainer was asked for (slurm/config.v8+.yaml sets it), but neither `apptainer` nor "
        f"`singularity` is on PATH, and {len(runs)} GPU run(s) need their backend's image ({runs[0]}, ...). "
        "Install Apptainer on the login and compute nodes, or deploy without containers: "
        "`bash scripts/wheelhouse.sh download` on the login node, `bash scripts/wheelhouse.sh install`, "
        f"then `{ENV_DEPLOY}=venv snakemake --profile slurm` (docs/cluster.md)."
    ]


def check_venvs(root: Path, backends_needed: Iterable[str]) -> list[str]:
    missing = sorted(b for b in set(backends_needed) if not venv_python(root, b).exists())
    return [
        f"{ENV_DEPLOY}=venv: no environment for backend {b} ({venv_python(root, b)}); build the wheelhouse on "
        "the login node (`bash scripts/wheelhouse.sh download`) and install it (`bash scripts/wheelhouse.sh "
        f"install {b}`)"
        for b in missing
    ]


def check_gpu_limit(gpus: Mapping[str, int], limit: int | None, source: str = PROFILE) -> list[str]:
    """Every run must fit the GPUs the profile allows one job (`resources: gpu`, scope local)."""
    if limit is None:
        return []
    too_big = {rid: n for rid, n in gpus.items() if n > limit}
    return [
        f"run {rid} needs {n} GPUs (engine tp + trainer GPUs for split) but the profile allows gpu={limit} per job "
        f"({source}: `resources: gpu: {limit}`, or --resources gpu=N); lower its tp/train_gpus or raise the limit"
        for rid, n in sorted(too_big.items())
    ]


def check_gpu_profile(limit: int | None, scope: str | None, gpu_jobs: int, source: str = PROFILE) -> list[str]:
    """A study with GPU jobs needs the profile's GPU settings: `resources: gpu` (the most one job may ask for) and
    scope local (a per-job pool: SLURM, not Snakemake, decides how many run at once)."""
    if not gpu_jobs:
        return []
    problems = []
    if limit is None:
        problems.append(f"the profile has no `resources: gpu` (the most GPUs one job may ask for, e.g. `gpu: 8`), "
                        f"and {gpu_jobs} job(s) ask for GPUs: add it as {source} has it")
    if scope != "local":
        problems.append(f"the profile's GPUs are not a per-job pool (`set-resource-scopes: gpu: local` is missing; "
                        f"scope {scope or 'global'}): Snakemake would hold GPU jobs back itself instead of SLURM; "
                        f"add it as {source} has it")
    return problems


def check_controller(run: Callable[..., Any] = subprocess.run) -> list[str]:
    """The SLURM controller must answer before anything is submitted; on the leased GPU machine the kit starts it."""
    try:
        out = run(["scontrol", "ping"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        answer = f"{type(exc).__name__}: {exc}"
    else:
        if "UP" in out.stdout:
            return []
        answer = (out.stdout + out.stderr).strip().splitlines()[-1:] or ["no answer"]
        answer = answer[0]
    return [f"no SLURM controller answers `scontrol ping` ({answer}): start one (on the leased GPU machine, "
            "`bash shared/gpu/slurm/slurm-lease start DEBDIR`, which `scripts/gpu/lease.sh start` runs), or check "
            "SLURM_CONF"]


def _missing(value: Any) -> bool:
    # an unset variable in a profile value stays literally "$NAME"; YAML null arrives as None or "None"
    return value is None or str(value).strip() in ("", "None") or "$" in str(value)


def check_job_resources(resources: Mapping[str, Any], partitions: Iterable[str] | None = None) -> list[str]:
    """Account, partition and time limit of a job that would go to sbatch."""
    problems = []
    if _missing(resources.get("slurm_account")):
        problems.append(
            f"no SLURM account: set {ENV_ACCOUNT} (e.g. `export {ENV_ACCOUNT}=myproject`) or slurm_account "
            f"under default-resources in {PROFILE}. An account is always passed, because the executor "
            "plugin's account guessing is broken in 2.8.0."
        )
    partition = resources.get("slurm_partition")
    if _missing(partition):
        problems.append(
            f"no SLURM partition: set {ENV_PARTITION} (e.g. `export {ENV_PARTITION}=gpu`) or slurm_partition "
            f"under default-resources in {PROFILE}."
        )
    elif partitions is not None:
        known = sorted(set(partitions))
        if str(partition) not in known:
            problems.append(f"partition {partition!r} does not exist on this cluster; sinfo lists: "
                            f"{', '.join(known) or 'none'} (set {ENV_PARTITION})")
    if _missing(resources.get("runtime")):
        problems.append(f"no time limit: set runtime (minutes) under default-resources in {PROFILE}")
    return problems


def check_profile_defaults(default_resources: Iterable[str] | None,
                           partitions: Callable[[], list[str] | None] | None = None) -> list[str]:
    """Account, partition and time limit as the profile's default-resources give them (`key=value`), for
    a dry run: Snakemake calls `onstart`, where a real run checks each job's resources, only when it
    runs. Nothing without a slurm_* key, i.e. without a SLURM profile."""
    values = dict(arg.split("=", 1) for arg in default_resources or () if "=" in arg)
    if not any(key.startswith("slurm_") for key in values):
        return []
    return check_job_resources(values, partitions() if partitions else None)


def group_problems(by_rule: Mapping[str, Iterable[str]]) -> list[str]:
    """One line per problem, naming the rules it hits, instead of one line per job."""
    rules: dict[str, list[str]] = {}
    for rule, problems in by_rule.items():
        for problem in problems:
            rules.setdefault(problem, [])
            if rule not in rules[problem]:
                rules[problem].append(rule)
    return [f"{problem} (jobs of: {', '.join(sorted(names))})" for problem, names in rules.items()]


def cluster_partitions(run: Callable[..., Any] = subprocess.run) -> list[str] | None:
    """Partition names from sinfo; None where SLURM's client tools are absent or do not answer."""
    if not shutil.which("sinfo"):
        return None
    try:
        out = run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def slurm_config(run: Callable[..., Any] = subprocess.run) -> dict[str, str]:
    if not shutil.which("scontrol"):
        return {}
    try:
        out = run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    conf = {}
    for line in out.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            conf[key.strip()] = value.strip()
    return conf


def check_status_source(conf: Mapping[str, str], status_command: str | None, first_check_s: int) -> list[str]:
    """Without slurmdbd only squeue knows job states, and only for MinJobAge seconds after a job ends."""
    if not conf or "none" not in conf.get("AccountingStorageType", "").lower():
        return []
    match = re.match(r"(\d+)", conf.get("MinJobAge", ""))
    min_age = int(match.group(1)) if match else None
    if status_command == "sacct":
        return ["this cluster has no SLURM accounting (AccountingStorageType=none), so sacct cannot report "
                "job states; set `slurm-status-command: squeue` in the profile"]
    # the plugin itself switches from squeue to sacct below this MinJobAge, and sacct would then fail
    if min_age is not None and min_age < 3 * first_check_s:
        return [f"this cluster has no SLURM accounting and MinJobAge={min_age}s: squeue forgets finished jobs "
                f"before Snakemake looks (needs >= {3 * first_check_s}s); ask for a longer MinJobAge or lower "
                "slurm-init-seconds-before-status-checks"]
    return []


def parse_scontrol(line: str) -> dict[str, str]:
    """The fields of `scontrol show job -o` that say what a job asked for and got."""
    fields = dict(re.findall(r"(\S+?)=(\S*)", line))
    return {key: fields[key] for key in SCONTROL_KEYS if key in fields}


def capture_grant(environ: Mapping[str, str], run: Callable[..., Any] = subprocess.run) -> dict[str, Any]:
    grant: dict[str, Any] = {key: environ[key] for key in JOB_ENV if key in environ}
    if shutil.which("scontrol"):
        try:
            out = run(["scontrol", "show", "job", "-o", environ["SLURM_JOB_ID"]],
                      capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                grant["scontrol"] = parse_scontrol(out.stdout.splitlines()[0])
        except (OSError, subprocess.TimeoutExpired):
            pass
    return grant


def job_grant(environ: MutableMapping[str, str], run: Callable[..., Any] = subprocess.run) -> dict[str, Any] | None:
    """What SLURM granted the current job, or None outside SLURM.

    Read once, by the job step's first Snakemake process: it still has the batch environment and
    scontrol. It hands the grant on in HYBRIDRL_SLURM_GRANT, because the plugin strips SLURM_* from
    the nested srun and the container has no scontrol.
    """
    if GRANT_ENV in environ:
        return parse_grant(environ[GRANT_ENV])
    if "SLURM_JOB_ID" not in environ:
        return None
    grant = capture_grant(environ, run)
    environ[GRANT_ENV] = json.dumps(grant, sort_keys=True)
    return grant


def granted_gpus(environ: Mapping[str, str]) -> list[dict[str, Any]]:
    """The GPUs this job may use (CUDA_VISIBLE_DEVICES, as SLURM set it), each with its NVML index, UUID, name and
    PCI bus id; empty where SLURM set none or NVML is absent."""
    return nvml.visible_gpus(environ)[0] if environ.get("CUDA_VISIBLE_DEVICES") else []


def parse_grant(text: str) -> dict[str, Any]:
    """The grant as job_grant handed it on in HYBRIDRL_SLURM_GRANT; ValueError naming the variable where it is not."""
    try:
        grant = json.loads(text)
    except ValueError:
        grant = None
    if not isinstance(grant, dict):
        raise ValueError(f"{GRANT_ENV} is not the JSON object of a SLURM grant (record-job writes one): {text[:200]!r}")
    return grant


def grant_in_env(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The current job's grant as far as the environment tells it, without scontrol and without changing it: the
    SLURM_* variables where they are set, over the grant handed on in HYBRIDRL_SLURM_GRANT (a job step's inner
    srun has lost most of SLURM_*); None outside SLURM."""
    handed = parse_grant(environ[GRANT_ENV]) if GRANT_ENV in environ else None
    if handed is None and "SLURM_JOB_ID" not in environ:
        return None
    return {**(handed or {}), **{key: environ[key] for key in JOB_ENV if key in environ}}


def grant_cpus(grant: Mapping[str, Any] | None) -> int | None:
    if not grant:
        return None
    value = grant.get("SLURM_CPUS_PER_TASK") or grant.get("scontrol", {}).get("CPUs/Task")
    return int(value) if value and str(value).isdigit() else None


def _write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def record_job(out: Path, environ: MutableMapping[str, str], sharing: str | None = None) -> dict[str, Any] | None:
    """Append this job's grant to OUT (one entry per job id and requeue), with the image's digest and whether the
    study let jobs share the node."""
    record = job_grant(environ)
    if record is None:
        return None
    record = dict(record)
    if environ.get("HYBRIDRL_IMAGE_DIGEST"):
        record["image_digest"] = environ["HYBRIDRL_IMAGE_DIGEST"]
    if sharing:
        record["node_sharing"] = sharing
    record["gpus"] = granted_gpus(environ)
    record["node"] = environ.get("SLURMD_NODENAME") or os.uname().nodename
    history = json.loads(out.read_text()) if out.exists() else {"jobs": []}
    key = (record.get("SLURM_JOB_ID"), record.get("SLURM_RESTART_COUNT", "0"))
    if all((j.get("SLURM_JOB_ID"), j.get("SLURM_RESTART_COUNT", "0")) != key for j in history["jobs"]):
        history["jobs"].append(record)
    _write_json(out, history)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridrl.study.cluster", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("record-job", help="append the SLURM grant of this job to a JSON file (no-op outside SLURM)")
    s.add_argument("out", type=Path)
    s.add_argument("--sharing", help="the study's node.sharing, recorded beside the grant")
    s = sub.add_parser("await-overlays", help="wait until gpu-env has installed the overlays (ROOT/.ready)")
    s.add_argument("root", type=Path)
    s.add_argument("--timeout-s", type=float, default=900.0)
    s = sub.add_parser("digest", help="print the image digest from a digest file written by scripts/build-container.sh")
    s.add_argument("file", type=Path)
    args = p.parse_args(argv)
    if args.command == "digest":
        print(json.loads(args.file.read_text())["digest"])
        return 0
    if args.command == "await-overlays":
        await_overlays(args.root, args.timeout_s)
        return 0
    record = record_job(args.out, os.environ, args.sharing)
    if record is not None:
        print(f"hybridrl: slurm job {record.get('SLURM_JOB_ID')} (restart {record.get('SLURM_RESTART_COUNT', '0')})"
              f" recorded in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
