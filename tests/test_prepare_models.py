"""A lease prepares only the models its plans' runs use, and keeps one already built from the same spec: the
verdict plans' study defines three models and its runs use one, whose warm start sets when the study can begin."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.study import prepare_study
from hybridrl.study.config import ConfigError, load_study
from hybridrl.study.models import MARKER
from hybridrl.tools.lease import driver
from hybridrl.tools.lease.driver import Lease, Refused, plan_models, run_plan, run_plans

REPO = Path(__file__).resolve().parents[1]
LEARNING = "config/gpu-h200-learning.yaml"
WARM = "qwen3-0.6b-warm"


def _fake_build(calls: list[list[str]]):
    """`python -m hybridrl CMD` recorded; a model command leaves what a build leaves (config.json, the marker)."""
    def run(argv: list[str]) -> None:
        calls.append(argv)
        if argv[0] == "model":
            out = Path(argv[argv.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)  # a build replaces a folder it wrote
            (out / "config.json").write_text('{"vocab_size": 151936}')
            (out / MARKER).write_text(json.dumps({"init": "random", **json.loads(argv[argv.index("--spec") + 1])}))
    return run


def _built(calls: list[list[str]]) -> list[str]:
    return [Path(a[a.index("--out") + 1]).name for a in calls if a[0] == "model"]


def test_prepare_builds_only_the_named_models_and_keeps_those_built_from_the_same_spec(tmp_path, monkeypatch,
                                                                                      capsys) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(prepare_study, "_hybridrl", _fake_build(calls))
    study = load_study(REPO / LEARNING)
    prepare_study.prepare(study, tmp_path, models=[WARM])
    assert [a[0] for a in calls] == ["data", "model"] and _built(calls) == [WARM]
    calls.clear()
    prepare_study.prepare(study, tmp_path)  # every model: the warm one is there already
    assert _built(calls) == ["qwen3-0.6b-random-qwen-vocab", "qwen3-0.6b-random-small-vocab"]
    assert f"{WARM}: built already, kept" in capsys.readouterr().out
    marker = tmp_path / "models" / WARM / MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "seed": 7}))  # built from another spec
    calls.clear()
    prepare_study.prepare(study, tmp_path, models=[WARM])
    assert _built(calls) == [WARM]
    calls.clear()
    prepare_study.prepare(study, tmp_path, models=[])  # a plan of trainer tools: no model at all
    assert [a[0] for a in calls] == ["data"]


def test_an_unknown_model_is_one_clear_error_before_anything_is_written(tmp_path, monkeypatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(prepare_study, "_hybridrl", _fake_build(calls))
    with pytest.raises(ConfigError, match=r"defines no model qwen3-nope \(it has: qwen3-0.6b-random-qwen-vocab, "):
        prepare_study.prepare(load_study(REPO / LEARNING), tmp_path, models=["qwen3-nope"])
    assert calls == [] and not (tmp_path / "cfg").exists()


def test_the_cli_passes_the_models_on(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "hybridrl", "prepare-study", "--config", str(REPO / LEARNING), "--out",
                           str(tmp_path), "--models", "qwen3-nope"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "defines no model qwen3-nope" in done.stderr


def test_a_plans_models_are_those_its_runs_use() -> None:
    lease = Lease(REPO, Path("/nonexistent"))
    assert plan_models(lease, ["verdictvllm"]) == {LEARNING: [WARM]}  # not the study's two random models
    assert plan_models(lease, ["verdictvllm", "placement"]) == {
        LEARNING: [WARM], "config/gpu-2xh200-placement.yaml": [WARM]}
    assert plan_models(lease, ["rest"]) == {"config/gpu-h200.yaml": ["qwen3-0.6b-random", "qwen3-0.6b-random-v768"]}
    assert plan_models(lease, ["trainer"]) == {"config/gpu-h200.yaml": []}  # trainer tools build their own


def test_a_plan_whose_model_is_missing_is_refused_in_one_line(tmp_path) -> None:
    (tmp_path / "gpu-h200-learning").mkdir()
    (tmp_path / "gpu-h200-learning" / "setup.done").touch()
    with pytest.raises(Refused) as refused:
        run_plan(Lease(REPO, tmp_path), "verdictvllm")
    assert refused.value.message.startswith(f"plan verdictvllm needs models its study's folder lacks ({WARM} under ")


def test_run_plans_prepares_a_set_up_study_again_for_a_model_it_lacks(tmp_path, monkeypatch) -> None:
    preps: list[dict[str, str]] = []

    class Prep:
        def __init__(self, argv, env, **kw) -> None:
            preps.append({"study": argv[-1], "models": env["HYBRIDRL_PREP_MODELS"]})

        def wait(self) -> int:
            return 0

    ran: list[str] = []
    monkeypatch.setattr(driver.subprocess, "Popen", Prep)
    monkeypatch.setattr(driver, "run_plan", lambda lease, name, out: ran.append(name))
    monkeypatch.delenv("HYBRIDRL_ENVS_READY", raising=False)
    study = tmp_path / "gpu-h200-learning"
    study.mkdir()
    (study / "setup.done").touch()  # set up by an earlier start, for plans whose models this one lacks
    run_plans(Lease(REPO, tmp_path), ["verdictvllm"])
    assert preps == [{"study": LEARNING, "models": WARM}] and ran == ["verdictvllm"]
    (study / "models" / WARM).mkdir(parents=True)
    (study / "models" / WARM / "config.json").write_text("{}")
    preps.clear()
    run_plans(Lease(REPO, tmp_path), ["verdictvllm", "verdictinproc"])
    assert preps == []  # set up, and its one model built: nothing to prepare


def test_the_drivers_prepare_passes_the_models_on_and_an_empty_set_builds_none(tmp_path) -> None:
    import yaml

    raw = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw))
    bin_dir = tmp_path / "bin"  # python3 is this interpreter, as on the GPU machine
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HYBRIDRL_REF_DIR": str(tmp_path / "ref"), "HYBRIDRL_PREP_MODELS": ""}
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu" / "run_reference.sh"), "prepare", str(config)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ref = tmp_path / "ref" / "tiny"
    assert (ref / "setup.done").exists() and (ref / "data" / "train.jsonl").exists()
    assert not (ref / "models").exists() or not any((ref / "models").iterdir())  # none asked for, none built
    env["HYBRIDRL_PREP_MODELS"] = "tiny-nope"
    bad = subprocess.run(["bash", str(REPO / "scripts" / "gpu" / "run_reference.sh"), "prepare", str(config)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "defines no model tiny-nope" in bad.stderr
