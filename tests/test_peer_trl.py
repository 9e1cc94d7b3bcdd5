"""TRL's GRPOTrainer as a peer arm: real TRL on a tiny model on the CPU (transformers generation, no vLLM), two
steps, through the CLI as the study's rule calls it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml

from hybridrl.cli import main
from hybridrl.study import models
from hybridrl.study.config import resolve
from hybridrl.study.run_config import RunSpec
from hybridrl.task import data
from hybridrl.tools.peer_trl import PeerOptions, check_options, differences, grpo_settings, prompt_dataset, step_dataset

REPO = Path(__file__).resolve().parents[1]


def _run(**over):
    spec = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    spec["defaults"].update({"steps": 2, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12,
                             "lr": 5e-2, "format_reward": 0.5, **over})
    spec["runs"] = [{"placement": "colocate" if over.get("device") == "cuda" else "split"}]
    spec.pop("measurements")
    study = resolve(spec)
    rid, run = next(iter(study.runs.items()))
    return rid, run


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer")
    data.write_synthetic(root / "data", 64, 8, seed=0)
    spec = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    cold = {k: v for k, v in spec["models"]["tiny-qwen3"].items() if k != "warm_start"}
    models.build_random(cold, root / "data" / "train.jsonl", root / "model")
    return root


def test_peer_trl_trains_the_runs_work_with_real_trl(assets: Path, tmp_path: Path) -> None:
    import trl

    rid, run = _run()
    cfg = tmp_path / "config.json"
    cfg.write_text(RunSpec(run_id=rid, run=run, study="t").model_dump_json())
    out = tmp_path / "trl.json"
    # micro-batch 4 of the step's 8 completions: two accumulated forwards, one optimizer step a step
    rc = main(["peer-trl", "--run-config", str(cfg), "--model", str(assets / "model"), "--data",
               str(assets / "data"), "--micro-batch", "4", "--gradient-checkpointing", "off", "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["versions"]["trl"] == trl.__version__ and rep["device"] == "cpu" and rep["run_id"] == rid
    assert rep["settings"]["gradient_accumulation_steps"] == rep["settings"]["steps_per_generation"] == 2
    assert rep["settings"]["gradient_checkpointing"] is False and rep["settings"]["use_vllm"] is False
    steps = rep["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        # TRL's own timers: its generation and its reward call, inside the step the callback timed
        t = s["timers"]
        assert 0 < t["transformers.generate"] <= s["prepare_s"] < s["step_s"]
        assert s["generate_s"] == t["transformers.generate"] and s["sync_weights_s"] is None
        assert 0 < t["hybridrl_reward"] and 0 < s["optimizer_s"] < s["step_s"]
        assert s["train_s"] == pytest.approx(s["step_s"] - s["prepare_s"])
        # TRL scored the step's 8 completions with hybridrl's reward, and logged their mean as its own
        assert len(s["rewards"]) == run.prompts_per_step * run.group_size
        assert s["trl_log"]["rewards/hybridrl_reward/mean"] == pytest.approx(statistics.mean(s["rewards"]))
        assert "step_time" in s["trl_log"] and s["trl_log"]["step_time"] <= s["step_s"]
        assert all(r == 0.0 or 0 < r <= 0.5 or r == 1.0 for r in s["rewards"])  # shaped_reward's values
    assert rep["reward_function"] == "hybridrl.task.data.shaped_reward"
    # the adapter was trained: PEFT starts lora_B at zero
    a = rep["adapter"]
    assert a["tensors"] == 2 * 7 * 2 and a["changed"]
    assert a["lora_b_norm_before"] == 0.0 and a["lora_b_norm_after"] > 0
    assert {d["setting"] for d in rep["differences"]} >= {"gradient_checkpointing", "micro-batching", "generation",
                                                          "output head", "trainer between steps"}


def test_peer_trl_takes_the_runs_prompts_in_step_order() -> None:
    _, run = _run(prompts_per_step=3)
    problems = [{"question": f"q{i}", "answer": str(i)} for i in range(50)]
    rows = step_dataset(problems, run, 2)
    want = [i for step in (1, 2) for i in data.step_problems(50, run.seed, step, 3)]
    assert [r["answer"] for r in rows] == [str(i) for i in want]
    assert rows[0]["prompt"] == data.prompt_text(f"q{want[0]}")
    # TRL's dataset holds the rows in order, fingerprinted from them without dill's hash of the Arrow table
    ds = prompt_dataset(rows)
    assert ds.to_list() == rows and ds._fingerprint == prompt_dataset(list(rows))._fingerprint
    assert ds._fingerprint != prompt_dataset(rows[::-1])._fingerprint


def test_trls_dataset_is_built_without_datasets_dill_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the lease, pyarrow came from an overlay outside site-packages, so dill pickled the pyarrow module by value
    when datasets hashed a new Dataset's table, and failed on its MonthDayNano type. The peer's dataset never
    takes that hash."""
    import datasets.arrow_dataset

    def no_hash(dataset: object) -> str:
        raise RuntimeError("dill's hash of the table")

    monkeypatch.setattr(datasets.arrow_dataset, "generate_fingerprint", no_hash)
    rows = [{"prompt": "p", "answer": "1"}]
    with pytest.raises(RuntimeError, match="dill's hash"):
        datasets.arrow_dataset.Dataset.from_list(rows)
    assert prompt_dataset(rows).to_list() == rows


def test_peer_trl_settings_and_refusals(tmp_path: Path) -> None:
    _, run = _run(device="cuda", rollout_is="truncate")
    kw = grpo_settings(run, PeerOptions(steps=3, micro_batch=4, device="cuda", lr=1e-3), tmp_path)
    assert kw["use_vllm"] and kw["vllm_mode"] == "colocate" and kw["vllm_enable_sleep_mode"]
    assert kw["learning_rate"] == 1e-3 and kw["bf16"] and "gradient_checkpointing" not in kw  # TRL's default
    assert kw["vllm_importance_sampling_mode"] == "token_truncate"
    assert kw["num_generations"] == run.group_size and kw["max_completion_length"] == run.max_new_tokens
    with pytest.raises(ValueError, match="does not divide"):
        check_options(run, PeerOptions(steps=1, micro_batch=3, device="cuda"))
    diffs = {d["setting"]: d["hybridrl"] for d in differences(run.model_copy(update={"chunked_head": True,
                                                                                 "keep_base_on_gpu": "auto"}), kw)}
    assert diffs["output head"] == "chunked head, no full logits" and diffs["trainer between steps"].endswith("auto")
    assert {d["setting"]: d["hybridrl"] for d in differences(run, kw)}["output head"] == "the model's full logits"
    # vLLM awake on both sides: TRL's sleep mode off, beside a run whose engine never sleeps
    awake_kw = grpo_settings(run, PeerOptions(steps=3, micro_batch=4, device="cuda", vllm_sleep=False), tmp_path)
    assert awake_kw["vllm_enable_sleep_mode"] is False
    awake = {d["setting"]: d for d in differences(run.model_copy(update={"engine_sleep": False}), awake_kw)}
    assert awake["vllm sleep"]["trl"].startswith("off, awake") and "awake (engine_sleep false)" in awake[
        "vllm sleep"]["hybridrl"]
    assert awake["trainer between steps"]["hybridrl"].startswith("everything stays on the GPU")
    drawn = run.model_copy(update={"lora": run.lora.model_copy(update={"init_b_std": 1e-3})})
    with pytest.raises(ValueError, match="init_b_std"):
        check_options(drawn, PeerOptions(steps=1, micro_batch=4, device="cuda"))


def test_peer_trl_cli_refuses_a_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rid, run = _run()
    cfg = tmp_path / "config.json"
    cfg.write_text(RunSpec(run_id=rid, run=run, study="t").model_dump_json())
    rc = main(["peer-trl", "--run-config", str(cfg), "--model", str(tmp_path / "nope"), "--data", str(tmp_path),
               "--micro-batch", "4", "--out", str(tmp_path / "o.json")])
    assert rc == 2 and "model directory" in capsys.readouterr().err
