import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridrl.study import config
from hybridrl.study.config import ConfigError, load_study, resolve, run_id
from hybridrl.study.run_config import RunConfig, run_schema, split_replicate

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def smoke() -> dict:
    """The smoke study without its measurements: these tests change its runs, and a measurement names a run
    (tests/test_study_config.py has the measurements' own tests)."""
    raw = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    raw.pop("measurements")
    return raw


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "config").glob("*.yaml")))
def test_shipped_configs_validate(name):
    study = load_study(REPO / "config" / name)
    assert study.runs
    for rid, run in study.runs.items():
        assert rid == run_id(run, split_replicate(rid)[1])  # replicates: <config id>-rK


def test_smoke_compares_split_restart_and_overlapped_split(smoke):
    study = resolve(smoke)
    assert sorted((r.placement, r.overlap) for r in study.runs.values()) == [("restart", 0), ("split", 0),
                                                                              ("split", 1)]
    assert all(r.steps >= 3 for r in study.runs.values())
    # the overlapped run reads its rollouts through a worker process: the smoke runs that path on the real server
    assert [r.rollout_process for r in study.runs.values() if r.overlap] == [True]


def test_misspelt_key_is_named_with_a_suggestion(smoke):
    smoke["defaults"]["group_sise"] = smoke["defaults"].pop("group_size")
    with pytest.raises(ConfigError, match=r"unknown key 'group_sise' in defaults; did you mean 'group_size'"):
        resolve(smoke)


def test_wrong_type_names_the_key(smoke):
    smoke["runs"][0]["steps"] = "three"
    with pytest.raises(ConfigError, match=r"runs\.0\.steps"):
        resolve(smoke)


def test_unknown_engine_names_the_key(smoke):
    smoke["runs"][1]["engine"] = "tgi"
    with pytest.raises(ConfigError, match=r"runs\.1\.engine"):
        resolve(smoke)


def test_undefined_model_is_named(smoke):
    smoke["defaults"]["model"] = "llama-70b"
    with pytest.raises(ConfigError, match="'llama-70b' is not defined under models"):
        resolve(smoke)


def test_missing_model_path_is_named(smoke, tmp_path):
    smoke["models"]["local"] = {"path": str(tmp_path / "nope")}
    with pytest.raises(ConfigError, match=r"models\.local\.path: .*nope does not exist"):
        resolve(smoke)


def test_colocate_needs_a_gpu(smoke):
    smoke["runs"][0]["placement"] = "colocate"
    with pytest.raises(ConfigError, match="colocate needs device: cuda"):
        resolve(smoke)


def test_an_engine_that_stays_awake_lets_colocate_run_on_a_cpu_and_keeps_older_ids(smoke):
    smoke["runs"] = [{"placement": "colocate", "engine_sleep": False}, {"placement": "split"}]
    awake, split = resolve(smoke).runs.values()
    assert awake.placement == "colocate" and not awake.engine_sleep
    assert run_id(split) == run_id(split.model_copy(update={"engine_sleep": True}))  # the default stays out of ids
    assert run_id(awake) != run_id(awake.model_copy(update={"engine_sleep": True}))
    smoke["runs"] = [{"placement": "split", "engine_sleep": False}]
    with pytest.raises(ConfigError, match=r"runs\[0\].engine_sleep: only a colocated engine sleeps \(placement split"):
        resolve(smoke)


def test_vllm_level_2_sleep_is_refused_because_lora_cannot_reload(smoke):
    smoke["runs"][0].update(engine="vllm", vllm_sleep_level=2)
    with pytest.raises(ConfigError, match=r"runs\[0\].vllm_sleep_level: 2 does not work with LoRA.*#39934"):
        resolve(smoke)


@pytest.mark.parametrize("over", [{"trainer": "hf"}, {"trainer": "megatron", "train_tp": 1}])
def test_release_comms_is_refused_where_there_are_no_groups_to_release(smoke, over):
    smoke["runs"][0].update(release_comms=True, **over)
    with pytest.raises(ConfigError, match=r"runs\[0\].release_comms: only the megatron trainer on 2 or more GPUs"):
        resolve(smoke)


@pytest.mark.parametrize(("over", "message"), [
    ({"trainer": "hf"}, r"train_ep: expert parallelism is the megatron trainer's \(trainer hf\)"),
    ({"trainer": "megatron", "train_tp": 2, "lora": {"rank": 8}}, r"train_ep: 2 with train_tp 2: .* train_tp 1"),
    ({"trainer": "megatron", "device": "cuda", "placement": "split", "train_gpus": 1},
     r"train_ep: 2 needs 2 GPUs, and train_gpus is 1"),
    ({"trainer": "megatron", "device": "cuda", "placement": "colocate", "tp": 1},
     r"train_ep: 2 needs 2 GPUs, and the engine's tp \(colocate: the trainer shares them\) is 1"),
])
def test_train_ep_is_refused_where_it_cannot_run(smoke, over, message):
    smoke["runs"][0].update(train_ep=2, **over)
    with pytest.raises(ConfigError, match=r"runs\[0\]\." + message):
        resolve(smoke)


def test_train_ep_runs_where_the_trainer_has_its_gpus_and_keeps_ids_at_its_default(smoke):
    plain = resolve(copy.deepcopy(smoke)).runs
    smoke["runs"][0]["train_ep"] = 1
    assert list(resolve(copy.deepcopy(smoke)).runs) == list(plain)
    smoke["runs"][0].update(train_ep=2, trainer="megatron", device="cuda", placement="split", tp=2, train_gpus=2)
    (run,) = [r for r in resolve(smoke).runs.values() if r.train_ep == 2]
    assert (run.train_tp, run.train_ep, run.train_gpus) == (1, 2, 2)


@pytest.mark.parametrize(("key", "default", "other"), [("ep_dispatch", "host_read", "masked"),
                                                        ("ep_batch", "replicated", "split")])
def test_expert_parallel_keys_need_expert_parallelism_and_keep_ids_at_their_default(smoke, key, default, other):
    plain = resolve(copy.deepcopy(smoke)).runs
    smoke["runs"][0][key] = default
    assert list(resolve(copy.deepcopy(smoke)).runs) == list(plain)
    smoke["runs"][0][key] = other
    with pytest.raises(ConfigError, match=rf"runs\[0\]\.{key}: {other} changes the megatron trainer .* train_ep 1"):
        resolve(copy.deepcopy(smoke))
    smoke["runs"][0].update(train_ep=2, trainer="megatron", device="cuda", placement="split", tp=2, train_gpus=2)
    changed = resolve(copy.deepcopy(smoke)).runs
    smoke["runs"][0][key] = default
    assert set(resolve(smoke).runs) != set(changed)  # a run of its own


def test_release_comms_at_its_default_keeps_run_ids(smoke):
    plain = resolve(copy.deepcopy(smoke)).runs
    smoke["runs"][0]["release_comms"] = False
    assert list(resolve(copy.deepcopy(smoke)).runs) == list(plain)
    smoke["runs"][0].update(release_comms=True, trainer="megatron", train_tp=2, lora={"rank": 8})
    changed = resolve(smoke).runs
    assert len(set(changed) - set(plain)) == 1


def test_run_id_changes_only_for_the_changed_run(smoke):
    before = resolve(copy.deepcopy(smoke)).runs
    smoke["runs"][1]["lr"] = 1e-3
    after = resolve(smoke).runs
    assert list(before)[0] == list(after)[0]
    assert list(before)[1] != list(after)[1]
    assert list(after)[1].startswith("vllm-restart-hf-tiny-qwen3-")


def test_duplicate_runs_are_rejected(smoke):
    smoke["runs"].append(dict(smoke["runs"][0]))
    with pytest.raises(ConfigError, match="same run as an earlier entry"):
        resolve(smoke)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_study(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("study: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_study(bad)


@pytest.mark.parametrize(("key", "value"), [("steps", 3.0), ("group_size", 4.0), ("seed", 0.0), ("steps", 2.5),
                                            ("micro_batch", 8.0), ("lora", {"rank": 8.0})])
def test_a_float_for_an_integer_is_refused_with_one_line_naming_the_key(smoke, key, value):
    # JSON Schema counts 3.0 as an integer; a run must not: it crashed inside the run and changed the run id
    smoke["runs"][0][key] = value
    with pytest.raises(ConfigError) as err:
        resolve(smoke)
    where = "runs.0." + (f"{key}.rank" if isinstance(value, dict) else key)
    assert str(err.value).startswith(f"config: {where}: ") and "integer" in str(err.value)
    assert "\n" not in str(err.value)


def test_validate_cli_prints_one_line_for_steps_3_0(smoke, tmp_path):
    smoke["runs"][0]["steps"] = 3.0
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(smoke))
    out = subprocess.run([sys.executable, "-m", "hybridrl", "validate", "--config", str(path)],
                         capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO / "src")})
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [f"hybridrl: config error: {path}: runs.0.steps: 3.0 is not of type 'integer'"]


def test_every_key_a_component_reads_can_be_set(smoke):
    smoke["defaults"].update(micro_batch=2, train_dtype="fp32", max_logprob_gap=1e-3, logprob_gap_fail=0.01)
    run = next(iter(resolve(smoke).runs.values()))
    assert (run.micro_batch, run.train_dtype, run.max_logprob_gap, run.logprob_gap_fail) == (2, "fp32", 1e-3, 0.01)
    default = RunConfig(model="m")  # the gap limits default to the model family's (hybridrl.run.checks.GAP_LIMITS)
    assert (default.micro_batch, default.train_dtype, default.max_logprob_gap) == (8, None, None)


def test_unknown_nested_key_is_named_with_a_suggestion(smoke):
    smoke["defaults"]["lora"]["rnak"] = 4
    with pytest.raises(ConfigError, match=r"unknown key 'rnak' in defaults\.lora; did you mean 'rank'"):
        resolve(smoke)


def test_run_config_is_frozen_and_typed(smoke):
    run = next(iter(resolve(smoke).runs.values()))
    assert isinstance(run, RunConfig) and run.lora.alpha == 16.0 and isinstance(run.lora.alpha, float)
    with pytest.raises(ValueError, match="frozen"):
        run.steps = 4  # type: ignore[misc]
    # an int for a float key is the same run as the float: one id for `alpha: 16` and `alpha: 16.0`
    a = copy.deepcopy(smoke)
    a["defaults"]["lora"]["alpha"] = 16.0
    assert list(resolve(a).runs) == list(resolve(smoke).runs)


def test_run_json_round_trips_to_the_same_run_and_id(smoke):
    for rid, run in resolve(smoke).runs.items():
        again = RunConfig.model_validate_json(run.model_dump_json())
        assert again == run and run_id(again) == rid


def test_the_model_refuses_what_the_schema_would_let_through():
    # the second gate: a merged run that the schema did not see (e.g. a JSON run file edited by hand)
    with pytest.raises(ConfigError, match=r"^x\.steps: Input should be a valid integer"):
        config.run_config({"model": "m", "steps": 3.0}, {"m": {}}, "x")
    with pytest.raises(ConfigError, match=r"^x\.model: None is not defined under models \(defined: m\)"):
        config.run_config({}, {"m": {}}, "x")


def test_schema_run_part_equals_the_model():
    """Fails when workflow/schemas/config.schema.yaml and RunConfig disagree: run `python -m hybridrl schema`."""
    committed = config.SCHEMA.read_text()
    assert yaml.safe_load(committed)["$defs"]["run"] == run_schema()
    assert config.schema_text() == committed


def test_schema_gives_every_key_a_default_and_a_description():
    def keys(props: dict, prefix: str = ""):
        for name, node in props.items():
            yield prefix + name, node
            yield from keys(node.get("properties", {}), f"{prefix}{name}.")

    required = {name for name, f in RunConfig.model_fields.items() if f.is_required()}
    for name, node in keys(run_schema()["properties"]):
        assert node.get("description"), name
        assert "default" in node or name in required, name
    assert required == {"model"}  # named per study: no default could be right


def test_a_key_added_later_keeps_recorded_ids_at_its_default_and_changes_them_when_set():
    """The placement study's committed runs were recorded before rollout_process existed: their ids still resolve."""
    study = config.REPO / "config" / "gpu-2xh200-placement.yaml"
    recorded = {p.name for p in (config.REPO / "results/reference/2026-11-26-2xh200-placement/runs").iterdir()}
    ids = set(load_study(study).runs)
    assert recorded and recorded <= ids
    for key, value in (("rollout_process", True), ("replicate_seeds", True), ("chunked_head", True),
                       ("keep_connections", True), ("gc_freeze", True)):
        raw = yaml.safe_load(study.read_text())
        raw["runs"][0][key] = value
        changed = set(resolve(raw).runs) - ids
        assert len(changed) == 3 and all(rid.startswith("sglang-colocate-") for rid in changed), key  # 3 replicates


@pytest.mark.parametrize(("change", "cause"), [
    ({"engine": "vllm-inprocess"}, r"vllm-inprocess has no connections to keep"),
    ({"engine": "vllm", "shared_pool": True}, r"the old client's one shared pool \(shared_pool\) is made anew"),
])
def test_keep_connections_is_refused_where_there_is_nothing_to_keep(smoke, change, cause):
    smoke["runs"][0].update(keep_connections=True, **change)
    with pytest.raises(ConfigError, match=r"runs\[0\].keep_connections: " + cause):
        resolve(smoke)
    smoke["runs"][0].update(keep_connections=False)
    resolve(smoke)  # the same run without the key is fine


def test_rollout_process_is_refused_for_the_engine_without_a_client(smoke):
    smoke["runs"][0].update(engine="vllm-inprocess", rollout_process=True)
    with pytest.raises(ConfigError, match=r"runs\[0\].rollout_process: vllm-inprocess has no rollout client"):
        resolve(smoke)
