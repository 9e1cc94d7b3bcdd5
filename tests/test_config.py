import copy
from pathlib import Path

import pytest
import yaml

from hybridrl.config import ConfigError, load_study, resolve, run_id

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def smoke() -> dict:
    return yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "config").glob("*.yaml")))
def test_shipped_configs_validate(name):
    study = load_study(REPO / "config" / name)
    assert study.runs
    for rid, run in study.runs.items():
        assert rid == run_id(run)


def test_smoke_compares_split_and_restart(smoke):
    study = resolve(smoke)
    assert sorted(r["placement"] for r in study.runs.values()) == ["restart", "split"]
    assert all(r["steps"] >= 3 for r in study.runs.values())


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


def test_vllm_level_2_sleep_is_refused_because_lora_cannot_reload(smoke):
    smoke["runs"][0].update(engine="vllm", vllm_sleep_level=2)
    with pytest.raises(ConfigError, match=r"runs\[0\].vllm_sleep_level: 2 does not work with LoRA.*#39934"):
        resolve(smoke)


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
