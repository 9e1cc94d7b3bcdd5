"""provenance.json names who ran a run and where (executor, SLURM job, node, GPUs by UUID) and every port it took;
steps.csv carries them onto every step."""

from __future__ import annotations

import json
import socket
import sys
import types
from pathlib import Path

import pytest
from test_nvml import _fake_pynvml

from hybridrl.report.aggregate import gather, provenance_fields
from hybridrl.run.provenance import RunProvenance, scheduler_info
from hybridrl.study import cluster

UUID0, UUID1 = "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd", "GPU-10000000-aaaa-bbbb-cccc-dddddddddddd"


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    fake = _fake_pynvml({0: 0, 1: 0}, {})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_a_slurm_job_names_its_job_array_task_node_and_the_gpus_it_was_given(driver: types.ModuleType) -> None:
    env = {"SLURM_JOB_ID": "23", "SLURM_ARRAY_JOB_ID": "21", "SLURM_ARRAY_TASK_ID": "2", "SLURM_RESTART_COUNT": "1",
           "SLURMD_NODENAME": "gpu-node-7", "CUDA_VISIBLE_DEVICES": "1"}
    sched = scheduler_info("cuda", env)
    assert sched["executor"] == "slurm" and sched["node"] == "gpu-node-7"
    assert (sched["slurm_job_id"], sched["slurm_array_job_id"], sched["slurm_array_task_id"]) == ("23", "21", "2")
    assert sched["slurm_restart_count"] == "1"
    assert sched["gpus"] == [{"index": 1, "uuid": UUID1, "name": "H200", "pci_bus_id": "00000000:02:00.0"}]
    assert sched["gpus_reason"] is None
    assert provenance_fields({"scheduler": sched})["slurm_job_id"] == "21_2"  # as scontrol and scancel name it


def test_a_job_step_without_slurm_variables_reads_the_grant_handed_on(driver: types.ModuleType) -> None:
    """The job-step plugin strips SLURM_* from the inner srun: the grant comes in HYBRIDRL_SLURM_GRANT."""
    grant = {"SLURM_JOB_ID": "31", "SLURM_GPUS": "2", "scontrol": {"JobId": "31"}}
    sched = scheduler_info("cuda", {cluster.GRANT_ENV: json.dumps(grant), "CUDA_VISIBLE_DEVICES": "0,1"})
    assert sched["executor"] == "slurm" and sched["slurm_job_id"] == "31" and sched["slurm_array_job_id"] is None
    assert sched["node"] == socket.gethostname()  # no SLURMD_NODENAME: the host's name
    assert [g["uuid"] for g in sched["gpus"]] == [UUID0, UUID1]
    assert provenance_fields({"scheduler": sched})["gpu_uuids"] == f"{UUID0},{UUID1}"
    # where both are there, the job's own variables win over the grant (a requeue's restart count)
    both = scheduler_info("cuda", {cluster.GRANT_ENV: json.dumps(grant), "SLURM_JOB_ID": "31",
                                   "SLURM_RESTART_COUNT": "2"})
    assert both["slurm_restart_count"] == "2"


def test_a_local_run_names_the_host_and_every_gpu_it_can_see(driver: types.ModuleType) -> None:
    sched = scheduler_info("cuda", {})
    assert sched["executor"] == "local" and sched["slurm_job_id"] is None and sched["node"] == socket.gethostname()
    assert [g["index"] for g in sched["gpus"]] == [0, 1]  # CUDA_VISIBLE_DEVICES unset: every GPU is visible
    assert provenance_fields({"scheduler": sched})["executor"] == "local"


def test_gpus_named_by_uuid_are_found_and_what_nvml_lacks_is_the_reason(driver: types.ModuleType) -> None:
    sched = scheduler_info("cuda", {"CUDA_VISIBLE_DEVICES": "GPU-10000000,MIG-4f2e"})
    assert [g["index"] for g in sched["gpus"]] == [1]  # a UUID's start names it, as CUDA takes it
    assert "MIG-4f2e" in sched["gpus_reason"] and "GPU-1" not in sched["gpus_reason"]
    empty = scheduler_info("cuda", {"CUDA_VISIBLE_DEVICES": ""})
    assert empty["gpus"] == [] and "no GPU is visible" in empty["gpus_reason"]


def test_a_cpu_run_or_a_machine_without_nvml_lists_no_gpu_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                       driver: types.ModuleType) -> None:
    cpu = scheduler_info("cpu", {"CUDA_VISIBLE_DEVICES": "0"})
    assert cpu["gpus"] == [] and cpu["gpus_reason"] == "device cpu: the run uses no GPU"
    monkeypatch.setitem(sys.modules, "pynvml", types.ModuleType("pynvml"))  # no nvmlInit: no driver to ask
    bare = scheduler_info("cuda", {})
    assert bare["gpus"] == [] and "no NVML" in bare["gpus_reason"]
    assert provenance_fields({"scheduler": bare})["gpu_uuids"] is None


def test_a_grant_that_is_not_json_is_named() -> None:
    with pytest.raises(ValueError, match=f"{cluster.GRANT_ENV} is not the JSON object of a SLURM grant"):
        scheduler_info("cpu", {cluster.GRANT_ENV: "[1, 2"})
    with pytest.raises(ValueError, match=cluster.GRANT_ENV):
        cluster.job_grant({cluster.GRANT_ENV: '"23"'})


def test_the_ports_record_is_written_again_only_for_a_new_port(tmp_path: Path) -> None:
    path = tmp_path / "provenance.json"
    prov = RunProvenance(path)
    prov.add_ports({"engine_http": 41000, "nccl": 41001})  # the first start comes before the first writing
    assert not path.exists()
    prov.write({"schema": 1})
    assert json.loads(path.read_text())["ports"] == {"engine_http": [41000], "nccl": [41001], "trainer_rendezvous": []}
    path.write_text("{}")  # a marker: a port already known must not write the file again
    prov.add_ports({"engine_http": 41000, "trainer_rendezvous": None})
    assert path.read_text() == "{}"
    prov.add_ports({"trainer_rendezvous": 29731})
    assert json.loads(path.read_text()) == {"schema": 1, "ports": {"engine_http": [41000], "nccl": [41001],
                                                                   "trainer_rendezvous": [29731]}}
    # a resumed run starts from its earlier attempt's ports
    assert RunProvenance(path).ports["trainer_rendezvous"] == [29731]
    path.write_text('{"ports": ')  # torn: nothing to keep
    assert RunProvenance(path).ports == {"engine_http": [], "nccl": [], "trainer_rendezvous": []}
    with pytest.raises(ValueError, match="unknown port kind 'http'; known: engine_http, nccl, trainer_rendezvous"):
        prov.add_ports({"http": 1})


def _steps(run_dir: Path, n: int) -> None:
    run_dir.mkdir(parents=True)
    rows = [{"run_id": run_dir.name, "step": s, "engine": "vllm", "placement": "split", "time_unix": 1.0e9 + s}
            for s in range(1, n + 1)]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_every_step_row_says_who_ran_it_and_older_runs_say_nothing(tmp_path: Path) -> None:
    sched = {"executor": "slurm", "slurm_job_id": "23", "slurm_array_job_id": None, "node": "gpu-node-7",
             "gpus": [{"index": 0, "uuid": UUID0, "name": "H200"}], "gpus_reason": None}
    _steps(tmp_path / "new", 3)
    (tmp_path / "new" / "provenance.json").write_text(json.dumps({"scheduler": sched, "git": {}}))
    _steps(tmp_path / "old", 2)
    (tmp_path / "old" / "provenance.json").write_text(json.dumps({"git": {}}))  # recorded before the block
    df = gather([tmp_path / "new", tmp_path / "old"]).set_index("run_id")
    cols = ["executor", "slurm_job_id", "node", "gpu_uuids"]
    assert df.loc["new", cols].values.tolist() == [["slurm", "23", "gpu-node-7", UUID0]] * 3
    assert df.loc["old", cols].isna().all().all()
