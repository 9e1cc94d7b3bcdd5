"""The SLURM/container glue without a cluster: job shapes, GPU counts, the checks before submission,
and the record of what a job was granted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridrl.study import cluster
from hybridrl.study.config import resolve
from hybridrl.study.run_config import RunConfig

REPO = Path(__file__).resolve().parents[1]
SCONTROL_LINE = (
    "JobId=19 ArrayJobId=18 ArrayTaskId=1 JobName=ffeb3b3c UserId=root(0) Account=ci QOS=(null) "
    "JobState=RUNNING Requeue=1 Restarts=0 TimeLimit=00:20:00 Partition=gpu NodeList=vm NumNodes=1 "
    "NumCPUs=1 CPUs/Task=1 TRES=cpu=1,mem=3001M,node=1,billing=1 MinMemoryNode=3001M "
    "Comment=rule_train_gpu2_wildcards_x TresPerJob=gres:gpu:2"
)


def _runs(name: str) -> dict:
    return resolve(yaml.safe_load((REPO / "config" / name).read_text())).runs


def test_gpu_study_gets_one_rule_per_gpu_count():
    runs = _runs("config.yaml")
    rules = cluster.shapes(runs)
    assert sorted(rules) == ["train_gpu1", "train_gpu2"]
    for rid in rules["train_gpu2"]:
        assert runs[rid].placement == "split" and cluster.job_gpus(runs[rid]) == 2
    assert sum(len(ids) for ids in rules.values()) == len(runs)


def test_cpu_runs_ask_for_no_gpu_unless_faked():
    runs = _runs("smoke.yaml")
    assert cluster.shapes(runs) == {"train_cpu": sorted(runs)}
    assert all(cluster.job_gpus(r) == 0 for r in runs.values())
    faked = {r.placement: cluster.job_gpus(r, fake=True) for r in runs.values()}
    assert faked == {"split": 2, "restart": 1}
    assert sorted(cluster.shapes(runs, fake=True)) == ["train_cpu_gpu1", "train_cpu_gpu2"]


def test_gpu_count_is_tp_plus_trainer_gpus_for_split():
    run = RunConfig(model="m", device="cuda", tp=2, train_gpus=3, placement="split")
    assert cluster.job_gpus(run) == 5
    assert cluster.job_gpus(run.model_copy(update={"placement": "colocate"})) == 2


def test_backends():
    assert cluster.backend("vllm-inprocess") == "vllm"
    assert cluster.backend("sglang") == "sglang"
    with pytest.raises(ValueError):
        cluster.backend("trtllm")


@pytest.mark.parametrize("argv,dry", [
    (["snakemake", "--profile", "slurm", "-n"], True),
    (["snakemake", "-np"], True),
    (["snakemake", "--dry-run"], True),
    (["snakemake", "--profile", "slurm"], False),
    (["snakemake", "--configfile", "config/smoke.yaml", "-p"], False),
])
def test_dry_run_detection(argv, dry):
    assert cluster.dry_run_requested(argv) is dry


def test_gpu_limit():
    assert cluster.check_gpu_limit({"a": 2, "b": 1}, 8) == []
    assert cluster.check_gpu_limit({"a": 2}, None) == []
    (problem,) = cluster.check_gpu_limit({"a": 2, "b": 1}, 1)
    assert "run a needs 2 GPUs" in problem and "gpu=1" in problem


@pytest.mark.parametrize("account", [None, "", "None", "$HYBRIDRL_SLURM_ACCOUNT"])
def test_missing_account_is_named(account):
    problems = cluster.check_job_resources({"slurm_account": account, "slurm_partition": "gpu", "runtime": 20})
    assert len(problems) == 1 and cluster.ENV_ACCOUNT in problems[0] and "2.8.0" in problems[0]


def test_missing_and_unknown_partition():
    base = {"slurm_account": "ci", "runtime": 20}
    (missing,) = cluster.check_job_resources(base)
    assert cluster.ENV_PARTITION in missing
    (unknown,) = cluster.check_job_resources({**base, "slurm_partition": "gpux"}, ["gpu", "cpu"])
    assert "'gpux' does not exist" in unknown and "cpu, gpu" in unknown
    assert cluster.check_job_resources({**base, "slurm_partition": "gpu"}, ["gpu"]) == []


def test_problems_are_grouped_by_message():
    lines = cluster.group_problems({"train_gpu1": ["x", "y"], "train_gpu2": ["x"], "model": []})
    assert lines == ["x (jobs of: train_gpu1, train_gpu2)", "y (jobs of: train_gpu1)"]


def test_apptainer_check():
    def absent(_):
        return None

    assert cluster.check_apptainer([], True, which=absent) == []
    (problem,) = cluster.check_apptainer(["r1"], True, which=absent)
    assert "apptainer" in problem and "HYBRIDRL_DEPLOY=venv" in problem
    assert cluster.check_apptainer(["r1"], True, which=lambda b: f"/usr/bin/{b}") == []


def test_deployment_choice():
    assert cluster.deployment(True, {}) == "apptainer"
    assert cluster.deployment(False, {}) == "host"
    assert cluster.deployment(True, {"HYBRIDRL_DEPLOY": "venv"}) == "venv"
    with pytest.raises(ValueError):
        cluster.deployment(True, {"HYBRIDRL_DEPLOY": "docker"})


def test_venv_check(tmp_path):
    (problem,) = cluster.check_venvs(tmp_path, ["vllm"])
    assert "wheelhouse.sh install vllm" in problem
    python = cluster.venv_python(tmp_path, "vllm")
    python.parent.mkdir(parents=True)
    python.touch()
    assert cluster.check_venvs(tmp_path, ["vllm"]) == []


def test_status_source_without_accounting():
    conf = {"AccountingStorageType": "accounting_storage/none", "MinJobAge": "600 sec"}
    assert cluster.check_status_source(conf, "squeue", 40) == []
    assert "squeue" in cluster.check_status_source(conf, "sacct", 40)[0]
    assert "MinJobAge=300s" in cluster.check_status_source({**conf, "MinJobAge": "300 sec"}, "squeue", 120)[0]
    assert cluster.check_status_source({"AccountingStorageType": "accounting_storage/slurmdbd"}, "sacct", 40) == []


def test_scontrol_fields():
    fields = cluster.parse_scontrol(SCONTROL_LINE)
    assert fields["TresPerJob"] == "gres:gpu:2" and fields["TimeLimit"] == "00:20:00"
    assert fields["CPUs/Task"] == "1" and fields["TRES"] == "cpu=1,mem=3001M,node=1,billing=1"
    assert "JobState" not in fields


def test_grant_is_read_once_and_handed_on():
    calls = []

    def scontrol(cmd, **_):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, SCONTROL_LINE + "\n", "")

    env = {"SLURM_JOB_ID": "19", "SLURM_CPUS_PER_TASK": "1", "SLURM_GPUS": "2", "HOME": "/root"}
    grant = cluster.job_grant(env, run=scontrol)
    assert grant["SLURM_GPUS"] == "2" and "HOME" not in grant
    if calls:  # scontrol is only asked where it is installed
        assert grant["scontrol"]["TresPerJob"] == "gres:gpu:2"
    # a nested process (the plugin strips SLURM_*) still sees the grant, without asking again
    nested = {cluster.GRANT_ENV: env[cluster.GRANT_ENV]}
    assert cluster.job_grant(nested, run=scontrol) == grant and len(calls) <= 1
    assert cluster.grant_cpus(grant) == 1
    assert cluster.job_grant({}) is None


def test_a_job_records_the_gpus_slurm_gave_it_by_nvml_and_none_where_it_gave_none(monkeypatch):
    from test_nvml import _fake_pynvml

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml({0: 0, 1: 0}, {}))
    [gpu] = cluster.granted_gpus({"CUDA_VISIBLE_DEVICES": "1"})
    assert gpu["uuid"].startswith("GPU-1") and gpu["index"] == 1 and gpu["pci_bus_id"] == "00000000:02:00.0"
    assert cluster.granted_gpus({}) == []  # a job without GPUs: SLURM sets no CUDA_VISIBLE_DEVICES


def test_record_job_appends_each_job_and_requeue(tmp_path):
    out = tmp_path / "slurm.json"
    assert cluster.record_job(out, {}) is None and not out.exists()
    first = {cluster.GRANT_ENV: json.dumps({"SLURM_JOB_ID": "7"}), "HYBRIDRL_IMAGE_DIGEST": "sha256:ab"}
    cluster.record_job(out, dict(first))
    cluster.record_job(out, dict(first))  # the same job again: no duplicate
    cluster.record_job(out, {cluster.GRANT_ENV: json.dumps({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"})})
    cluster.record_job(out, {cluster.GRANT_ENV: json.dumps({"SLURM_JOB_ID": "9"})})
    jobs = json.loads(out.read_text())["jobs"]
    keys = [(j["SLURM_JOB_ID"], j.get("SLURM_RESTART_COUNT", "0")) for j in jobs]
    assert keys == [("7", "0"), ("7", "1"), ("9", "0")]
    assert jobs[0]["image_digest"] == "sha256:ab"


def test_profile_is_where_snakemake_looks():
    # `--profile slurm` resolves ./slurm/<config.vN+.yaml>, never profiles/slurm
    profile = yaml.safe_load((REPO / "slurm" / "config.v8+.yaml").read_text())
    assert profile["executor"] == "slurm" and profile["software-deployment-method"] == "apptainer"
    assert "slurm_account" in profile["default-resources"]
    assert "attempt" in profile["default-resources"]["runtime"] and "attempt" in profile["default-resources"]["mem_mb"]
    assert (REPO / "slurm" / "ci" / "config.v8+.yaml").exists()


def test_profile_defaults_are_judged_for_a_dry_run():
    # what `snakemake --profile slurm` hands the Snakefile with HYBRIDRL_SLURM_ACCOUNT/PARTITION unset
    unset = ["tmpdir=system_tmpdir", "mem_mb=128000 * attempt", "slurm_account=None", "slurm_partition=None",
             "runtime=240 * attempt"]
    problems = cluster.check_profile_defaults(unset)
    assert len(problems) == 2
    assert cluster.ENV_ACCOUNT in problems[0] and cluster.ENV_PARTITION in problems[1]
    given = [a.replace("=None", "=x") for a in unset]
    assert cluster.check_profile_defaults(given) == []
    (unknown,) = cluster.check_profile_defaults(given, lambda: ["gpu"])
    assert "'x' does not exist" in unknown
    # no SLURM profile: nothing to judge
    assert cluster.check_profile_defaults(None) == []
    assert cluster.check_profile_defaults(["mem_mb=1000"]) == []
