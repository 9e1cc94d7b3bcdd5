"""The CI's one-node SLURM cluster (scripts/slurm-ci-cluster.sh), as the SLURM-executor tests use it: whether it is
up, its partition, and the environment and working directory a study is started from, as a user would."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")


def cluster_problem() -> str | None:
    """Why no study can go to the cluster here, or None."""
    for tool in ("sbatch", "squeue", "scontrol", "sinfo"):
        if not shutil.which(tool):
            return f"{tool} is not installed: run `bash scripts/slurm-ci-cluster.sh` (as root) first"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    if "UP" not in ping.stdout:
        return "slurmctld does not answer `scontrol ping`: run `bash scripts/slurm-ci-cluster.sh` (as root)"
    nodes = subprocess.run(["sinfo", "-h", "-o", "%T %G"], capture_output=True, text=True).stdout
    if not any(line.split()[0].rstrip("*") in ("idle", "mixed", "allocated") and "gpu:" in line
               for line in nodes.splitlines() if line.strip()):
        return f"no usable node with GPU GRES (sinfo: {nodes.strip()!r}): run scripts/slurm-ci-cluster.sh"
    return None


def required() -> bool:
    """CI sets HYBRIDRL_REQUIRE_SLURM=1: there a missing cluster fails the tests instead of skipping them."""
    return os.environ.get("HYBRIDRL_REQUIRE_SLURM") == "1"


def partition() -> str:
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True).stdout.split()
    return next((p.rstrip("*") for p in out if p.endswith("*")), out[0])


def slurm_env(**extra: str) -> dict[str, str]:
    """This environment without HYBRIDRL_* and SLURM_*, with the profile's account and partition; empty values
    unset a variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYBRIDRL_", "SLURM_"))}
    env.update(PATH=f"{SNAKEMAKE.parent}:{env['PATH']}", PYTHONPATH=str(REPO / "src"),
               HYBRIDRL_SLURM_ACCOUNT="ci", HYBRIDRL_SLURM_PARTITION=partition())
    env.update(extra)
    return {k: v for k, v in env.items() if v}


def study_dir(path: Path, **overlay: object) -> Path:
    """A study directory with ./slurm, so that `--profile slurm` is typed exactly as a user would, and an
    overlay.yaml whose top-level keys replace the smoke study's."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "slurm").symlink_to(REPO / "slurm")
    (path / "overlay.yaml").write_text(yaml.safe_dump(overlay))
    return path


def slurm_cmd(*extra: str) -> list[str]:
    """The smoke study (with the overlay) through the production profile and the CI override."""
    return [str(SNAKEMAKE), "--snakefile", str(REPO / "Snakefile"), "--profile", "slurm", "--profile", "slurm/ci",
            "--configfile", str(REPO / "config" / "smoke.yaml"), "overlay.yaml", *extra]
