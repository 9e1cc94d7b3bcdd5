"""What Snakemake itself prints for a bad day: a broken study file, a SLURM profile without an account
or partition, a GSM8K download that fails. Each runs the real workflow in a scratch copy (a dry run, or
the data rule alone: a few seconds)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")


@pytest.fixture
def workflow_copy(tmp_path) -> Path:
    for name in ("workflow", "config", "slurm", "containers"):
        shutil.copytree(REPO / name, tmp_path / name)
    shutil.copy(REPO / "Snakefile", tmp_path)
    (tmp_path / "src").symlink_to(REPO / "src")
    return tmp_path


def _snakemake(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDRL_SLURM_")}
    environ.update(PATH=f"{SNAKEMAKE.parent}:{os.environ['PATH']}", PYTHONPATH=str(REPO / "src"), **env)
    return subprocess.run([str(SNAKEMAKE), *args], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=300)


def test_broken_default_study_is_one_line(workflow_copy):
    study = workflow_copy / "config" / "config.yaml"
    lines = study.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  source:"))
    lines[at] = "  source: [1, 2"  # an unclosed flow sequence, broken by the next key's colon
    study.write_text("\n".join(lines) + "\n")
    out = _snakemake(workflow_copy, "-n")
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.startswith(f"hybridrl: config error: config/config.yaml:{at + 2}:9: not valid YAML: "
                                 "expected ',' or ']', but got ':'")
    assert out.stderr.count("\n") == 1, out.stderr


def test_slurm_dry_run_warns_without_account_and_partition(workflow_copy):
    out = _snakemake(workflow_copy, "--profile", "slurm", "-n")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "hybridrl (dry run; a real run stops here): no SLURM account: set HYBRIDRL_SLURM_ACCOUNT" in text
    assert "hybridrl (dry run; a real run stops here): no SLURM partition: set HYBRIDRL_SLURM_PARTITION" in text
    given = _snakemake(workflow_copy, "--profile", "slurm", "-n", HYBRIDRL_SLURM_ACCOUNT="acct",
                       HYBRIDRL_SLURM_PARTITION="gpu")
    assert given.returncode == 0 and "no SLURM" not in given.stdout + given.stderr


def test_failed_download_shows_its_cause_on_the_console(workflow_copy):
    study = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    study["data"] = {"source": "gsm8k"}
    (workflow_copy / "gsm8k.yaml").write_text(yaml.safe_dump(study))
    # port 9 (discard) on the loopback: refused at once, and no network is needed
    out = _snakemake(workflow_copy, "resources/data/gsm8k/train.jsonl", "--cores", "1", "--configfile", "gsm8k.yaml",
                     HYBRIDRL_GSM8K_URL="http://127.0.0.1:9/{split}.jsonl")
    assert out.returncode != 0
    console = out.stdout + out.stderr
    assert "GSM8K train: download failed from http://127.0.0.1:9/train.jsonl" in console, console[-3000:]
    assert "download failed" in (workflow_copy / "logs" / "data" / "gsm8k.log").read_text()


def test_make_smoke_refuses_a_broken_study_in_one_line_before_snakemake(workflow_copy):
    study = workflow_copy / "config" / "smoke.yaml"
    lines = study.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("study:"))
    lines[at] = "study: [smoke"  # unclosed: the next key's colon breaks it
    study.write_text("\n".join(lines) + "\n")
    shutil.copy(REPO / "Makefile", workflow_copy)
    # -o setup: the environments are this one's (make test built them); only the smoke's own recipe runs
    environ = {**os.environ, "PATH": f"{SNAKEMAKE.parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(["make", "-o", "setup", "smoke", f"STUDY={study}"], cwd=workflow_copy, env=environ,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    said = [line for line in out.stderr.splitlines() if line.startswith("hybridrl:")]
    assert said and said[0].startswith(f"hybridrl: config error: {study}:{at + 2}:"), out.stderr
    assert "snakemake" not in out.stdout.split("validate", 1)[1]  # it stopped before Snakemake ran


def test_a_study_key_snakemake_cannot_take_is_one_line_naming_the_file(workflow_copy):
    study = workflow_copy / "config" / "smoke.yaml"
    text = study.read_text()
    assert "\n  steps: 3\n" in text
    study.write_text(text.replace("\n  steps: 3\n", "\n  steps: 3.0\n", 1))
    out = _snakemake(workflow_copy, "-n", "--cores", "1", "--configfile", "config/smoke.yaml")
    assert out.returncode == 1
    said = [line for line in out.stderr.splitlines() if line.startswith("hybridrl:")]
    assert said == [f"hybridrl: config error: {study}: defaults.steps: 3.0 is not of type 'integer'"], \
        out.stderr[-2000:]


def test_a_bad_value_given_with_config_says_so(workflow_copy):
    out = _snakemake(workflow_copy, "-n", "--cores", "1", "--configfile", "config/smoke.yaml", "--config", "data=5")
    said = [line for line in out.stderr.splitlines() if line.startswith("hybridrl:")]
    assert out.returncode == 1 and said == [
        f"hybridrl: config error: {workflow_copy / 'config' / 'smoke.yaml'} with --config: data: 5 is not of type "
        "'object'"], out.stderr[-2000:]
