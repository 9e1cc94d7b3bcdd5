"""The warm-start rule on a tiny model on the CPU, Qwen-vocabulary models, and the harder synthetic problems."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hybridrl.study import models, warm_start
from hybridrl.study.config import ConfigError, dataset_name, resolve
from hybridrl.task import data
from hybridrl.task.answer import answer_value

REPO = Path(__file__).resolve().parents[1]
TINY = {"init": "random", "arch": "qwen3", "dtype": "float32", "vocab_size": 300, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "max_position_embeddings": 256, "tie_word_embeddings": True, "seed": 0}


def test_warm_start_writes_a_checkpoint_that_learned_and_its_base_accuracy(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data.write_synthetic(tmp_path / "data", 64, 8, seed=0)
    spec = {**TINY, "warm_start": {"tokens": 20_000, "lr": 1e-2, "batch_size": 16, "eval_problems": 8,
                                   "max_new_tokens": 40}}
    models.build_random(TINY, tmp_path / "data" / "train.jsonl", tmp_path / "cold")
    models.build_random(spec, tmp_path / "data" / "train.jsonl", tmp_path / "warm", tmp_path / "data" / "test.jsonl")

    result = json.loads((tmp_path / "warm" / warm_start.WARM_START_FILE).read_text())
    assert result["tokens"] >= 20_000 and result["device"] == "cpu" and result["eval_split"] == "test"
    assert result["problems"] == 8 and 0 <= result["base_accuracy"] <= 1 and 0 <= result["eos_share"] <= 1
    assert json.loads((tmp_path / "warm" / "hybridrl-model.json").read_text())["warm_started"] is True
    assert not (tmp_path / "cold" / warm_start.WARM_START_FILE).exists()

    # an ordinary HF checkpoint, and one that learned: the answers' loss fell well below the random model's
    tok = AutoTokenizer.from_pretrained(tmp_path / "warm")
    batch = warm_start.batch_tensors(warm_start.examples(data.read_jsonl(tmp_path / "data" / "train.jsonl")[:16],
                                                         tok), tok.pad_token_id)
    losses = {}
    for name in ("cold", "warm"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        with torch.no_grad():
            losses[name] = model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2]).loss.item()
    assert losses["warm"] < 0.75 * losses["cold"], losses  # ~0.64 after 20k tokens


def test_a_warm_start_needs_the_test_split(tmp_path):
    data.write_synthetic(tmp_path / "data", 8, 2, seed=0)
    with pytest.raises(ValueError, match="test split"):
        models.build_random({**TINY, "warm_start": {"tokens": 10}}, tmp_path / "data" / "train.jsonl", tmp_path / "m")


def test_greedy_accuracy_counts_right_answers_and_eos():
    import torch

    class Tok:
        pad_token_id, eos_token_id = 0, 1

        def __call__(self, text):
            return {"input_ids": [5, 6]}

        def decode(self, ids, skip_special_tokens=True):
            return "#### 7" if ids == [7] else "#### 8"

    class Model:
        generation_config = type("G", (), {"eos_token_id": 1})()

        def generate(self, input_ids, **kw):  # row 0 answers 7 then EOS; row 1 answers 8 and runs on
            new = torch.tensor([[7, 1, 0], [8, 8, 8]])
            return torch.cat([input_ids, new], dim=1)

    rows = [{"question": "q", "answer": "#### 7"}, {"question": "q", "answer": "#### 7"}]
    out = warm_start.greedy_accuracy(Model(), Tok(), rows, 3, "cpu")
    assert out == {"accuracy": 0.5, "eos_share": 0.5, "response_length_mean": 2.0, "problems": 2}


def test_qwen_tokenizer_model_takes_qwen3s_vocab_and_stop_tokens(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    data.write_synthetic(tmp_path / "data", 8, 2, seed=0)
    spec = {k: v for k, v in TINY.items() if k != "vocab_size"} | {"tokenizer": "qwen"}
    models.build_random(spec, tmp_path / "data" / "train.jsonl", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["vocab_size"] == 151_936
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (151643, 151645, 151643)
    assert GenerationConfig.from_pretrained(tmp_path / "m").eos_token_id == [151645, 151643]
    assert len(AutoTokenizer.from_pretrained(tmp_path / "m")) == 151_669


def test_qwen_tokenizer_refuses_a_vocab_size():
    study = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    study["models"]["tiny-qwen3"]["tokenizer"] = "qwen"
    with pytest.raises(ConfigError, match=r"models.tiny-qwen3.vocab_size: not used with tokenizer: qwen"):
        resolve(study)


def test_multi_step_problems_are_worked_step_by_step_and_parse():
    rows = data.synthesize(300, seed=3, steps=3)
    lines = [r["answer"].count("<<") for r in rows]
    assert set(lines) == {2, 3}  # two or three worked steps each
    assert all(answer_value(r["answer"]) is not None and answer_value(r["answer"]) >= 0 for r in rows)
    assert max(int(answer_value(r["answer"])) for r in rows) > 1000  # larger numbers than the one-step problems
    assert data.synthesize(5, seed=3) == data.synthesize(5, seed=3, steps=1)  # one-step data is unchanged
    assert data.synthesize(50, seed=3, steps=2) != data.synthesize(50, seed=3, steps=3)
    assert dataset_name({"source": "synthetic"}) == "synthetic-s0-n512-128"
    assert dataset_name({"source": "synthetic", "steps": 3}) == "synthetic-s0-n512-128-k3"


@pytest.mark.parametrize("target, stops_early", [(0.0, True), (1.0, False)])
def test_a_target_accuracy_stops_the_warm_start_on_held_out_train_problems(tmp_path, target, stops_early):
    data.write_synthetic(tmp_path / "data", 64, 8, seed=0)
    spec = {**TINY, "warm_start": {"tokens": 8_000, "lr": 1e-2, "batch_size": 16, "eval_problems": 8,
                                   "max_new_tokens": 8, "target_accuracy": target, "check_tokens": 2_000,
                                   "check_problems": 8}}
    models.build_random(spec, tmp_path / "data" / "train.jsonl", tmp_path / "m", tmp_path / "data" / "test.jsonl")
    result = json.loads((tmp_path / "m" / warm_start.WARM_START_FILE).read_text())
    assert result["stopped_at_target"] is stops_early
    if stops_early:  # any accuracy reaches 0: the first check stops it, a quarter into the budget
        assert len(result["checks"]) == 1 and 2_000 <= result["tokens"] < 4_000
    else:  # a tiny model is never all right: checked at 2k, 4k and 6k tokens, then the whole budget trained
        assert [c["tokens"] // 2_000 for c in result["checks"]] == [1, 2, 3] and result["tokens"] >= 8_000
    assert all(0 <= c["accuracy"] <= 1 for c in result["checks"])


def test_too_few_train_problems_to_hold_out_are_refused(tmp_path):
    data.write_synthetic(tmp_path / "data", 8, 2, seed=0)
    spec = {**TINY, "warm_start": {"tokens": 100, "target_accuracy": 0.3, "check_problems": 8}}
    with pytest.raises(ValueError, match=r"check_problems \(8\) must be fewer than the train split's 8"):
        models.build_random(spec, tmp_path / "data" / "train.jsonl", tmp_path / "m", tmp_path / "data" / "test.jsonl")
