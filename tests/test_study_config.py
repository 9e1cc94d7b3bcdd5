"""The typed study (StudyConfig): its schema, its measurements as jobs, the node it runs on, the order of its runs,
and the cluster checks that stop a study before anything is submitted."""

import copy
import subprocess
from pathlib import Path

import pytest
import yaml

from hybridrl.study import cluster
from hybridrl.study.config import REPO, ConfigError, load_study, resolve
from hybridrl.study.measurements import Inputs, fault_runs, measure_argv
from hybridrl.study.study_config import study_schema


@pytest.fixture
def smoke() -> dict:
    return yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())


def _keys(node: dict, where: str = ""):
    """Every property of the study's own part of the schema (the run part has tests of its own)."""
    for option in node.get("oneOf", []):
        yield from _keys(option, where)
    for name, child in node.get("properties", {}).items():
        yield f"{where}{name}", child
        yield from _keys(child, f"{where}{name}.")
    for child in (node.get("additionalProperties"), node.get("items")):
        if isinstance(child, dict) and "$ref" not in child:
            yield from _keys(child, f"{where}*.")


def test_every_key_of_a_study_has_a_description():
    keys = dict(_keys(study_schema()))
    assert {"node.sharing", "order", "run_minutes", "measurements.*.repeats", "models.*.warm_start.tokens"} <= set(keys)
    assert [k for k, node in keys.items() if not node.get("description")] == []


def test_measurements_resolve_to_jobs_with_their_results(smoke):
    study = resolve(smoke)
    split = next(rid for rid, run in study.runs.items() if run.placement == "split" and not run.overlap)
    jobs = study.measurements
    assert [j.output for j in jobs.values()] == [
        "results/bench/vllm-split.json", "results/bench/client-ceiling.json",
        "results/bench/trainer-tiny-hf-mb4-device-cpu.json"]
    assert jobs["vllm-split"].run_id == split and jobs["vllm-split"].gpus == 1
    assert jobs["client-ceiling"].run_id is None and jobs["client-ceiling"].gpus == 0


def test_trainer_replicates_and_profiles_name_their_results(smoke):
    smoke["measurements"] = [{"kind": "trainer_bench", "shape": "qwen3-0.6b", "trainer": "megatron",
                              "micro_batch": 32, "flags": ["vocab=151936"], "replicates": 2},
                             {"kind": "trainer_profile", "shape": "tiny", "trainer": "hf", "micro_batch": 4}]
    jobs = resolve(smoke).measurements
    assert [j.output for j in jobs.values()] == [
        "results/bench/trainer-qwen3-0.6b-megatron-mb32-vocab-151936.json",
        "results/bench/trainer-qwen3-0.6b-megatron-mb32-vocab-151936-r2.json",
        "results/bench/profile-tiny-hf-mb4.txt"]
    argv = measure_argv(jobs["trainer-qwen3-0.6b-megatron-mb32-vocab-151936-r2"], Inputs())
    assert argv[:3] == ["trainer-bench", "--shape", "qwen3-0.6b"] and "--vocab=151936" in argv
    assert argv[-2:] == ["--out", "results/bench/trainer-qwen3-0.6b-megatron-mb32-vocab-151936-r2.json"]


def test_a_trainer_bench_at_ep_2_takes_two_gpus_and_passes_the_flag_on(smoke):
    smoke["measurements"] = [{"kind": "trainer_bench", "shape": "qwen3-30b-a3b", "trainer": "megatron",
                              "micro_batch": 8, "flags": ["ep=2", "vocab=151936"]},
                             {"kind": "trainer_bench", "shape": "qwen3-30b-a3b", "trainer": "megatron",
                              "micro_batch": 8, "flags": ["vocab=151936"]}]
    jobs = resolve(smoke).measurements
    sharded, whole = jobs.values()
    assert sharded.name == "trainer-qwen3-30b-a3b-megatron-mb8-ep-2-vocab-151936"
    assert (sharded.gpus, whole.gpus) == (2, 1)
    assert "--ep=2" in measure_argv(sharded, Inputs())
    smoke["measurements"][0]["flags"] = ["ep=two"]
    with pytest.raises(ConfigError, match=r"measurements\[0\]\.flags: ep=two: give ep=N once"):
        resolve(smoke)


def test_a_fault_run_trains_its_run_and_the_engine_bench_replays_one(smoke):
    smoke["measurements"] = [{"kind": "fault_run", "run": "vllm-restart", "kill_engine_at": 2, "term_at": 3},
                             {"kind": "engine_bench", "run": "vllm-split", "step": 2, "repeats": 4}]
    study = resolve(smoke)
    restart = next(rid for rid, run in study.runs.items() if run.placement == "restart")
    assert fault_runs(study.measurements) == {restart}
    at = Inputs(run_dir="results/runs/R", run_config="results/runs/R/config.json", model="m", data="d")
    fault = measure_argv(study.measurements["fault-vllm-restart"], at)
    assert fault[:7] == ["fault-run", "--kill-engine-at", "2", "--term-at", "3", "--out",
                         "results/bench/fault-vllm-restart.json"]
    assert fault[fault.index("--") + 1:][:4] == ["python", "-m", "hybridrl", "train"]
    bench = measure_argv(study.measurements["vllm-split"], at)
    assert bench[bench.index("--step") + 1] == "2" and bench[bench.index("--repeats") + 1] == "4"
    assert bench[bench.index("--run-dir") + 1] == "results/runs/R"


def test_trls_peer_mirrors_a_run_in_two_configurations(smoke):
    smoke["measurements"] = [{"kind": "peer_trl", "run": "vllm-split", "micro_batch": 4},
                             {"kind": "peer_trl", "run": "vllm-split", "micro_batch": 4,
                              "gradient_checkpointing": False, "lr": 1e-3, "steps": 2},
                             {"kind": "peer_trl", "run": "vllm-split", "micro_batch": 4,
                              "gradient_checkpointing": False, "vllm_sleep": False}]
    study = resolve(smoke)
    split = next(rid for rid, run in study.runs.items() if run.placement == "split" and not run.overlap)
    jobs = study.measurements
    assert [j.output for j in jobs.values()] == ["results/bench/trl-vllm-split-defaults.json",
                                                 "results/bench/trl-vllm-split-gc-off.json",
                                                 "results/bench/trl-vllm-split-gc-off-awake.json"]
    assert all(j.run_id == split and j.gpus == 1 and j.device == "cpu" for j in jobs.values())
    at = Inputs(run_dir="results/runs/R", run_config="results/runs/R/config.json", model="m", data="d")
    default, off, awake = (measure_argv(j, at) for j in jobs.values())
    assert "--vllm-awake" in awake and "--vllm-awake" not in off
    assert default[:3] == ["peer-trl", "--run-config", "results/runs/R/config.json"]
    assert default[default.index("--gradient-checkpointing") + 1] == "default" and "--lr" not in default
    assert off[off.index("--gradient-checkpointing") + 1] == "off" and off[off.index("--lr") + 1] == "0.001"
    assert off[off.index("--steps") + 1] == "2" and off[-2:] == ["--out", "results/bench/trl-vllm-split-gc-off.json"]
    assert set(cluster.measure_shapes(jobs)) == {"peer_trl_cpu"}


@pytest.mark.parametrize(("entry", "message"), [
    ({"kind": "engine_bench", "run": "nope"}, r"measurements\[0\]\.run: 'nope' is not a run of this study"),
    ({"kind": "engine_bench", "run": "vllm-split", "repeats": 0}, r"measurements\.0\.repeats: .*greater than"),
    ({"kind": "trainer_bench", "shape": "huge", "trainer": "hf", "micro_batch": 1}, r"measurements\.0\.shape: "),
    ({"kind": "engine_bench", "run": "vllm-split", "steps": 2}, r"measurements\.0\.steps: Extra inputs"),
    ({"kind": "benchmark"}, r"measurements\.0: .*tag 'benchmark'"),
    ({"kind": "peer_trl", "run": "vllm-split", "beta": 0.1}, r"measurements\.0\.beta: Extra inputs"),
    ({"kind": "peer_trl", "run": "nope"}, r"measurements\[0\]\.run: 'nope' is not a run of this study"),
])
def test_a_bad_measurement_is_one_line_naming_its_key(smoke, entry, message):
    smoke["measurements"] = [entry]
    with pytest.raises(ConfigError, match=message) as err:
        resolve(smoke, "study.yaml")
    assert "\n" not in str(err.value) and str(err.value).startswith("study.yaml: ")


def test_two_measurements_writing_one_result_are_refused(smoke):
    smoke["measurements"] = [{"kind": "client_ceiling"}, {"kind": "client_ceiling", "args": ["--seconds", "1"]}]
    with pytest.raises(ConfigError, match=r"measurements\[1\]: its result results/bench/client-ceiling.json is also"):
        resolve(smoke)


def test_a_run_or_measurement_needing_more_gpus_than_the_node_is_refused_at_validation(smoke):
    gpu = copy.deepcopy(smoke)
    gpu["defaults"]["device"] = "cuda"
    gpu["node"] = {"gpus": 1}
    with pytest.raises(ConfigError, match=r"run vllm-split-\S+ needs 2 GPUs but node.gpus is 1"):
        resolve(gpu)
    gpu["node"] = {"gpus": 2}
    assert resolve(gpu).node.gpus == 2
    gpu["measurements"] = [{"kind": "fault_run", "run": "vllm-split", "kill_engine_at": 1, "term_at": 2}]
    gpu["runs"] = [{"placement": "split", "tp": 2, "train_gpus": 1}]
    gpu["node"] = {"gpus": 2}
    with pytest.raises(ConfigError, match="needs 3 GPUs but node.gpus is 2"):
        resolve(gpu)


def test_validate_refuses_a_study_larger_than_its_node_in_one_line(smoke, tmp_path):
    smoke["defaults"]["device"] = "cuda"
    smoke["node"] = {"gpus": 1}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(smoke))
    done = subprocess.run(["python", "-m", "hybridrl", "validate", "--config", str(path)], capture_output=True,
                          text=True, cwd=REPO, env={"PATH": str(Path(__import__("sys").executable).parent),
                                                    "PYTHONPATH": str(REPO / "src")})
    assert done.returncode != 0 and "needs 2 GPUs but node.gpus is 1" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_balanced_rounds_reverse_every_second_round(smoke):
    smoke["defaults"]["replicates"] = 3
    smoke["runs"] = [{"placement": "split"}, {"placement": "restart"}]
    plain = [run.placement[0] + rid[-2:] for rid, run in resolve(smoke).runs.items()]
    smoke["order"] = "balanced"
    balanced = [run.placement[0] + rid[-2:] for rid, run in resolve(smoke).runs.items()]
    assert [p[0] for p in plain] == list("srsrsr")
    assert [p[0] for p in balanced] == list("srrssr")
    assert sorted(plain) == sorted(balanced)  # the same runs, the same ids


def test_the_lease_study_declares_what_the_issue_asks():
    study = load_study(REPO / "config" / "gpu-verdict.yaml")
    assert study.node.gpus == 1 and study.node.sharing == "one_at_a_time"
    assert sorted({(r.engine, r.steps) for r in study.runs.values()}) == [("sglang", 10), ("vllm", 10)]
    assert len(study.runs) == 4
    assert {j.kind for j in study.measurements.values()} == {"engine_bench", "trainer_bench"}


# -- the cluster's side ----------------------------------------------------------------------------------------

def test_measurement_rules_split_by_kind_and_gpus(smoke):
    jobs = resolve(smoke).measurements
    assert cluster.measure_shapes(jobs) == {"engine_bench_cpu": ["vllm-split"], "client_ceiling_cpu": [
        "client-ceiling"], "trainer_bench_cpu": ["trainer-tiny-hf-mb4-device-cpu"]}
    assert cluster.measure_shapes(jobs, fake=True)["engine_bench_gpu1"] == ["vllm-split"]


def test_the_controller_takes_the_overlays_it_runs_in_its_own_process():
    assert cluster.controller_overlays("vllm-inprocess", "megatron", "/o") == ["/o/vllm", "/o/trainer"]
    assert cluster.controller_overlays("sglang", "hf", "/o") == []  # an HTTP engine gets its own from engine_envs
    # TRL's peer: vLLM in its process, then TRL's own set
    assert cluster.controller_overlays("vllm-inprocess", "hf", "/o", peer=True) == ["/o/vllm", "/o/peer"]


def test_jobs_wait_for_the_overlays_and_give_up_in_one_line(tmp_path):
    slept = []
    (tmp_path / "later").mkdir()

    def arrive(s: float) -> None:
        slept.append(s)
        if len(slept) == 3:
            (tmp_path / "later" / cluster.OVERLAYS_READY).touch()

    cluster.await_overlays(tmp_path / "later", timeout_s=10, sleep=arrive)
    assert len(slept) == 3
    with pytest.raises(SystemExit, match=r"not installed within 2 s .*gpu-env install"):
        cluster.await_overlays(tmp_path / "never", timeout_s=2, sleep=lambda s: None)


def test_a_profile_without_its_gpu_settings_is_named():
    assert cluster.check_gpu_profile(8, "local", gpu_jobs=3) == []
    assert cluster.check_gpu_profile(None, None, gpu_jobs=0) == []  # a CPU study needs neither
    missing = cluster.check_gpu_profile(None, "local", gpu_jobs=3)
    assert len(missing) == 1 and "no `resources: gpu`" in missing[0]
    scope = cluster.check_gpu_profile(8, "global", gpu_jobs=1)
    assert len(scope) == 1 and "set-resource-scopes: gpu: local" in scope[0]


def test_a_cluster_whose_controller_does_not_answer_names_the_kit():
    def down(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "slurm_load_ctl_conf error: Unable to contact slurm controller")

    (problem,) = cluster.check_controller(down)
    assert "Unable to contact slurm controller" in problem and "slurm-lease start" in problem
    up = lambda *a, **k: subprocess.CompletedProcess(a, 0, "Slurmctld(primary) at vm is UP\n", "")  # noqa: E731
    assert cluster.check_controller(up) == []

    def missing(*args, **kwargs):
        raise FileNotFoundError("scontrol")

    assert "FileNotFoundError" in cluster.check_controller(missing)[0]


def test_a_study_run_one_job_at_a_time_keeps_its_order_on_slurm():
    assert cluster.sbatch_order(3, one_at_a_time=False) == ""
    flags = [cluster.sbatch_order(rank, one_at_a_time=True) for rank in (0, 1, 2)]
    assert all(f.endswith(" --exclusive") for f in flags)
    nice = [int(f.split()[0].removeprefix("--nice=")) for f in flags]
    assert nice == sorted(nice) and min(b - a for a, b in zip(nice, nice[1:], strict=False)) > 100
    # each job a rule of its own: no array gives one job's flags to another
    assert cluster.one_rule_a_job({"train_gpu1": ["a", "b"], "train_gpu2": ["c"]}) == {
        "train_gpu1_1": ["a"], "train_gpu1_2": ["b"], "train_gpu2_1": ["c"]}


def test_a_measurement_takes_its_place_after_the_round_it_names(smoke):
    smoke["defaults"]["replicates"] = 2
    smoke["order"] = "balanced"
    ceiling = next(m for m in smoke["measurements"] if m["kind"] == "client_ceiling")
    ceiling["after_round"] = 1
    study = resolve(smoke)
    runs, ranks = list(study.runs), study.ranks
    assert sorted(ranks.values()) == list(range(1, len(runs) + len(study.measurements) + 1))
    assert runs == sorted(runs, key=ranks.get)  # the runs keep the study's order
    second = [rid for rid in runs if rid.endswith("-r2")]
    assert second and max(ranks[r] for r in runs if r not in second) < ranks["client-ceiling"] < min(
        ranks[r] for r in second)
    others = [name for name in study.measurements if name != "client-ceiling"]
    assert [ranks[name] for name in others] == list(range(len(runs) + 2, len(runs) + len(others) + 2))
    ceiling["after_round"] = 9  # past the last round: after every run, in the file's order
    ranks = resolve(smoke).ranks
    assert min(ranks[name] for name in study.measurements) == len(runs) + 1


@pytest.mark.parametrize(("order", "want"), [("balanced", ["mb4", "mb8", "mb8-r2", "mb4-r2"]),
                                             ("rounds", ["mb4", "mb8", "mb4-r2", "mb8-r2"])])
def test_a_replicated_trainer_tools_processes_go_round_by_round(smoke, order: str, want: list[str]):
    smoke["order"] = order
    bench = {"kind": "trainer_bench", "shape": "tiny", "trainer": "hf", "flags": ["device=cpu"], "replicates": 2}
    smoke["measurements"] = [{**bench, "micro_batch": 4}, {**bench, "micro_batch": 8}]
    ranks = resolve(smoke).ranks
    names = sorted((n for n in ranks if n.startswith("trainer-")), key=ranks.get)
    assert [n.removeprefix("trainer-tiny-hf-").replace("-device-cpu", "") for n in names] == want


def test_trls_replicates_are_processes_of_their_own_that_go_round_by_round(smoke):
    smoke["order"] = "balanced"
    trl = {"kind": "peer_trl", "run": "vllm-split", "micro_batch": 4, "replicates": 2}
    smoke["measurements"] = [trl, {**trl, "gradient_checkpointing": False}]
    study = resolve(smoke)
    names = sorted((n for n in study.ranks if n.startswith("trl-")), key=study.ranks.get)
    assert names == ["trl-vllm-split-defaults", "trl-vllm-split-gc-off", "trl-vllm-split-gc-off-r2",
                     "trl-vllm-split-defaults-r2"]
    smoke["defaults"]["replicates"] = 2
    for m in smoke["measurements"]:
        m["after_round"] = 1
    study = resolve(smoke)
    first, second = ([rid for rid in study.runs if rid.endswith("-r2") == (k == 2)] for k in (1, 2))
    ranks = study.ranks  # process 1 between the rounds, process 2 after the second
    assert max(ranks[r] for r in first) < ranks["trl-vllm-split-defaults"] < min(ranks[r] for r in second)
    assert max(ranks[r] for r in second) < ranks["trl-vllm-split-defaults-r2"]
    job = study.measurements["trl-vllm-split-gc-off-r2"]
    argv = measure_argv(job, Inputs(run_config="c", model="m", data="d"))
    assert job.replicate == 2 and argv[-2:] == ["--out", "results/bench/trl-vllm-split-gc-off-r2.json"]
    assert argv[argv.index("--workdir") + 1] == "resources/trl/trl-vllm-split-gc-off-r2"  # none shared


def test_a_start_bench_starts_its_runs_engine_both_ways_after_the_run(smoke):
    smoke["measurements"] = [{"kind": "start_bench", "run": "vllm-split", "repeats": 3}]
    study = resolve(smoke)
    job = study.measurements["start-vllm-split"]
    assert job.output == "results/bench/start-vllm-split.json" and job.device == "cpu"
    assert job.run_id == next(r for r, run in study.runs.items() if run.placement == "split" and not run.overlap)
    argv = measure_argv(job, Inputs(run_config="results/runs/R/config.json", model="m"))
    assert argv[:3] == ["start-bench", "--run-config", "results/runs/R/config.json"]
    assert argv[argv.index("--repeats") + 1] == "3" and argv[-2:] == ["--out", job.output]
    smoke["measurements"] = [{"kind": "start_bench", "run": "vllm-split", "repeats": 1}]
    with pytest.raises(ConfigError, match="repeats"):
        resolve(smoke)


def test_vllm_detokenize_is_in_process_vllms_and_gives_a_run_an_id_of_its_own(smoke):
    smoke["defaults"]["vllm_detokenize"] = False
    with pytest.raises(ConfigError, match=r"vllm_detokenize: only in-process vLLM detokenizes in the controller"):
        resolve(smoke)
    from hybridrl.study.run_config import RunConfig, run_id

    run = RunConfig.model_validate({"engine": "vllm-inprocess", "placement": "colocate", "model": "m"})
    off = run.model_copy(update={"vllm_detokenize": False})
    assert run_id(off) != run_id(run)  # a run without vLLM's text is not a replicate of one with it
    assert run_id(run) == run_id(run.model_copy(update={"vllm_detokenize": True}))  # the default keeps old ids


def test_sglang_detokenize_is_sglangs_and_gives_a_run_an_id_of_its_own(smoke):
    smoke["defaults"]["sglang_detokenize"] = False  # the smoke study's runs are not all SGLang's
    with pytest.raises(ConfigError, match=r"sglang_detokenize: SGLang's flag \(--skip-tokenizer-init\), not engine"):
        resolve(smoke)
    from hybridrl.study.run_config import RunConfig, run_id

    run = RunConfig.model_validate({"engine": "sglang", "placement": "colocate", "model": "m"})
    off = run.model_copy(update={"sglang_detokenize": False})
    assert run_id(off) != run_id(run)
    assert run_id(run) == run_id(run.model_copy(update={"sglang_detokenize": True}))  # the default keeps old ids
