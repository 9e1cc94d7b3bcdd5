"""Prompt plus generation beyond the model's positions: refused at validate where the study shows it, and at the
run's data load with the prompts, before any engine starts; each time in one line saying where it was checked."""

import json
from pathlib import Path

import pytest
import yaml

from hybridrl import cli
from hybridrl.study.config import ConfigError, dataset_name, load_study
from hybridrl.study.models import build_tokenizer
from hybridrl.study.run_config import RunConfig
from hybridrl.task import data, lengths

REPO = Path(__file__).resolve().parents[1]


class WordTokenizer:
    """One token a word: prompt lengths a test can count."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": list(range(len(text.split())))}


def _study(tmp_path: Path, **defaults) -> Path:
    raw = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())  # tiny-qwen3: 512 positions
    raw["defaults"].update(defaults)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_positions_come_from_the_spec_else_the_built_config_capped_as_the_engines_run_them(tmp_path):
    assert lengths.positions({"max_position_embeddings": 512}) == 512
    assert lengths.positions({"max_position_embeddings": 40960}) == 4096  # the engines' context cap
    assert lengths.positions({"hf_id": "Qwen/Qwen3-0.6B"}, tmp_path) is None  # not downloaded yet: unknown
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    assert lengths.positions({"hf_id": "Qwen/Qwen3-0.6B"}, tmp_path) == 1024
    assert lengths.positions({"max_position_embeddings": 256}, tmp_path) == 256  # the study's spec wins


@pytest.mark.parametrize(("setting", "key"), [({"max_new_tokens": 100000}, "max_new_tokens 100000"),
                                              ({"max_new_tokens": 512}, "max_new_tokens 512"),
                                              ({"eval_max_new_tokens": 600}, "eval_max_new_tokens 600")])
def test_validate_refuses_a_generation_that_fills_the_positions_in_one_line(tmp_path, capsys, monkeypatch,
                                                                            setting, key):
    monkeypatch.chdir(tmp_path)  # no resources/ here: nothing built yet
    path = _study(tmp_path, **setting)
    assert cli.main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    first = next(iter(load_study(path).runs))
    assert err.startswith(f"hybridrl: config error: {path}: run {first}: {key} leaves no room for a prompt in the "
                          "512 positions the engines give model tiny-qwen3; give it at most 511 (checked at validate, "
                          "without the prompts: those are checked once data and model are built, at the run's data "
                          "load)")


def test_validate_passes_a_generation_that_leaves_room(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["validate", "--config", str(_study(tmp_path, max_new_tokens=511))]) == 0
    assert capsys.readouterr().err == ""


def _problems(*questions: str) -> list[dict]:
    return [{"question": q, "answer": "#### 1"} for q in questions]


def test_the_longest_prompt_the_run_sends_is_checked_with_its_budget():
    # "Question: <words>\nAnswer:": the word count plus 2
    problems = _problems("one two", "a much longer question of nine words in all")
    run = RunConfig(model="m", steps=1, prompts_per_step=2, max_new_tokens=20, eval_every=0)
    lengths.check_prompts("r", run, problems, None, WordTokenizer(), 31, "here")  # 11 + 20 = 31: fits
    with pytest.raises(ConfigError) as exc:
        lengths.check_prompts("r", run, problems, None, WordTokenizer(), 30, "at data load, before any engine starts")
    assert str(exc.value) == ("r: max_new_tokens 20 + the longest prompt it sends (11 tokens, problem 2 of the train "
                              "split) = 31, beyond the 30 positions the engines give model m; give max_new_tokens at "
                              "most 19 (checked at data load, before any engine starts)")


def test_a_prompt_the_run_never_sends_is_not_held_against_it():
    problems = _problems(*(["short"] * 50), " ".join(["long"] * 100))
    run = RunConfig(model="m", steps=2, prompts_per_step=1, max_new_tokens=10, eval_every=0)
    sent = {i for step in (1, 2) for i in data.step_problems(len(problems), run.seed, step, 1)}
    assert 50 not in sent
    lengths.check_prompts("r", run, problems, None, WordTokenizer(), 20, "here")


def test_the_eval_slice_is_checked_with_the_eval_budget():
    train, test = _problems("q"), _problems("short", " ".join(["w"] * 30))
    run = RunConfig(model="m", steps=1, prompts_per_step=1, max_new_tokens=10, eval_every=1, eval_problems=2,
                    eval_max_new_tokens=20)
    with pytest.raises(ConfigError, match=r"eval_max_new_tokens 20 \+ the longest prompt it sends \(32 tokens, "
                                          r"problem 2 of the test split\) = 52"):
        lengths.check_prompts("r", run, train, test, WordTokenizer(), 40, "here")
    lengths.check_prompts("r", run.model_copy(update={"eval_problems": 1}), train, test, WordTokenizer(), 40, "here")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """resources/ as the workflow leaves it for the smoke study: its data and the tiny model's tokenizer."""
    root = tmp_path_factory.mktemp("built")
    spec = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    data_dir = root / "resources" / "data" / dataset_name(spec["data"])
    data.write_synthetic(data_dir, 64, 8, seed=0)
    model = root / "resources" / "models" / "tiny-qwen3"
    rows = data.read_jsonl(data_dir / "train.jsonl")
    build_tokenizer([data.prompt_text(r["question"]) + " " + r["answer"] for r in rows], 512, model)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    return root


def test_validate_checks_the_prompts_where_data_and_model_are_built(tmp_path, capsys, monkeypatch, built):
    monkeypatch.chdir(built)
    assert cli.main(["validate", "--config", str(_study(tmp_path, max_new_tokens=500))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "max_new_tokens 500 + the longest prompt it sends (" in err
    dataset = dataset_name(yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())["data"])
    assert err.rstrip().endswith(f"(checked at validate, on the built data in resources/data/{dataset} and "
                                 "tokenizer in resources/models/tiny-qwen3)")
    assert cli.main(["validate", "--config", str(_study(tmp_path, max_new_tokens=48))]) == 0


def test_a_run_whose_prompts_do_not_fit_stops_at_data_load_before_the_engine(tmp_path, built):
    from hybridrl.run.loop import run_loop

    class NoEngine:  # any use of the engine (preflight, start) would mean the run went on
        def __getattr__(self, name):
            raise AssertionError(f"the engine was used ({name}) on prompts that do not fit")

    model = built / "resources" / "models" / "tiny-qwen3"
    data_dir = next((built / "resources" / "data").iterdir())
    run = RunConfig(model="tiny-qwen3", engine="vllm", device="cpu", max_new_tokens=500, eval_every=0)
    with pytest.raises(ConfigError, match=r"^r: max_new_tokens 500 \+ the longest prompt .* \(checked at data load, "
                                          r"before any engine starts\)$"):
        run_loop(run, "r", model, data_dir, tmp_path / "run", {}, progress=False, engine=NoEngine())
