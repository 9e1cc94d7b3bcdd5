import hashlib
import json
import re
import socket
import warnings
from pathlib import Path

import pytest
import yaml

from hybridrl.study import models
from hybridrl.study.config import ConfigError, validate
from hybridrl.task import data

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She pays 5 + 3 = 8 dollars.\n#### 8", "8"),
        ("#### 1,234", "1234"),
        ("The total is $1,234.50\n#### $1,234.50", "1234.5"),
        ("#### -7", "-7"),
        ("#### 3.0", "3"),
        ("#### 0.25", "0.25"),
        ("#### .5", "0.5"),
        ("work 12 then 13 #### 40 apples.", "40"),
        ("first #### 3 then a second #### 9", "9"),  # the last marker wins
        ("no marker, the answer is 42.", "42"),
        ("no marker, it costs $-3.50 in the end", "-3.5"),
        ("1,000,000 people", "1000000"),
        ("#### 12345678901234567890123456789012345", "12345678901234567890123456789012345"),  # > 28 digits
        ("a random policy: 9999999999999999999999999999999.5000", "9999999999999999999999999999999.5"),
        ("#### 100.00", "100"),
        ("#### nothing numeric", None),
        ("no numbers at all", None),
    ],
)
def test_extract_answer(text, expected):
    assert data.extract_answer(text) == expected


@pytest.mark.parametrize(
    ("completion", "reference", "reward"),
    [
        ("so 18 eggs\n#### 18", "16 - 3 - 4 = 9, 9 * 2 = 18\n#### 18", 1.0),
        ("#### 1,800", "#### 1800", 1.0),
        ("#### $5.00", "#### 5", 1.0),
        ("#### 17", "#### 18", 0.0),
        ("#### -18", "#### 18", 0.0),
        ("", "#### 18", 0.0),
        ("the answer is 18", "#### 18", 1.0),
    ],
)
def test_reward(completion, reference, reward):
    assert data.reward(completion, reference) == reward


def test_synthetic_is_deterministic_gsm8k_format(tmp_path):
    data.write_synthetic(tmp_path, n_train=50, n_test=10, seed=3)
    rows = data.read_jsonl(tmp_path / "train.jsonl")
    assert len(rows) == 50 and len(data.read_jsonl(tmp_path / "test.jsonl")) == 10
    assert rows == data.synthesize(50, 3)
    assert data.synthesize(50, 4) != rows
    for row in rows:
        assert "####" in row["answer"]
        # the worked answer must agree with its own final line
        assert data.reward(row["answer"], row["answer"]) == 1.0


def test_download_checks_checksum(tmp_path):
    src = tmp_path / "upstream"
    src.mkdir()
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        data.download_gsm8k(tmp_path / "out", url_template=f"file://{src}/{{split}}.jsonl")
    assert not (tmp_path / "out" / "train.jsonl").exists()  # nothing half-written is kept


def test_download_accepts_matching_file(tmp_path, monkeypatch):
    src = tmp_path / "upstream"
    src.mkdir()
    rows = {"train": 3, "test": 2}
    for split, n in rows.items():
        (src / f"{split}.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n' * n)
        digest = hashlib.sha256((src / f"{split}.jsonl").read_bytes()).hexdigest()
        monkeypatch.setitem(data.GSM8K_SHA256, split, digest)
        monkeypatch.setitem(data.GSM8K_ROWS, split, n)
    data.download_gsm8k(tmp_path / "out", url_template=f"file://{src}/{{split}}.jsonl")
    assert len(data.read_jsonl(tmp_path / "out" / "train.jsonl")) == 3


def test_download_failure_names_the_cause(tmp_path):
    with pytest.raises(RuntimeError, match="download failed"):
        data.download_gsm8k(tmp_path, url_template=f"file://{tmp_path}/missing-{{split}}.jsonl")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_named(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}/{{split}}.jsonl"
    with pytest.raises(RuntimeError, match=r"GSM8K train: download failed from http://127.0.0.1:\d+/train.jsonl: "
                                           r".*Connection refused; use data.source: synthetic"):
        data.download_gsm8k(tmp_path, url_template=url)
    assert list(tmp_path.iterdir()) == []  # no partial file is left


def test_download_times_out_on_a_server_that_never_answers(tmp_path):
    # the kernel completes the connection from the listen backlog; nothing is ever sent back
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/{{split}}.jsonl"
        with pytest.raises(RuntimeError, match="download failed .*timed out"):
            data.download_gsm8k(tmp_path, url_template=url, timeout_s=0.2)


def test_download_url_from_the_environment(tmp_path, monkeypatch):
    src = tmp_path / "mirror"
    src.mkdir()
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
        monkeypatch.setitem(data.GSM8K_SHA256, split, hashlib.sha256((src / f"{split}.jsonl").read_bytes()).hexdigest())
        monkeypatch.setitem(data.GSM8K_ROWS, split, 1)
    monkeypatch.setenv(data.GSM8K_URL_ENV, f"file://{src}/{{split}}.jsonl")
    data.download_gsm8k(tmp_path / "out")
    assert (tmp_path / "out" / "test.jsonl").exists()


def test_random_moe_model_pads_its_vocab_and_keeps_norm_topk_prob(tmp_path):
    """A tiny CPU build: the schema takes norm_topk_prob, the model vocab is padded, the tokenizer is not."""
    from transformers import AutoTokenizer

    spec = {"init": "random", "arch": "qwen3_moe", "dtype": "float32", "vocab_size": 300, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "norm_topk_prob": True, "seed": 0}
    study = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    study["models"]["tiny-moe"] = spec
    validate(study)
    data.write_synthetic(tmp_path / "data", 32, 4, seed=0)
    models.build_random(spec, tmp_path / "data" / "train.jsonl", tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    n_tokens = len(AutoTokenizer.from_pretrained(tmp_path / "model"))
    assert config["norm_topk_prob"] is True
    assert config["vocab_size"] % models.VOCAB_MULTIPLE == 0
    assert n_tokens < config["vocab_size"] < n_tokens + models.VOCAB_MULTIPLE  # ~300 tokens, padded
    # vocab_multiple: 1 keeps the tokenizer's length (how the first H200 study's model was built)
    models.build_random({**spec, "vocab_multiple": 1}, tmp_path / "data" / "train.jsonl", tmp_path / "unpadded")
    assert json.loads((tmp_path / "unpadded" / "config.json").read_text())["vocab_size"] == n_tokens


def test_a_finished_checkpoint_is_moved_into_place_not_copied(tmp_path, monkeypatch):
    # a copy needs the checkpoint's size twice on the disk: the 48-layer one (61 GB) filled a 64 GiB disk so
    import shutil

    from hybridrl.study import models

    tmp = tmp_path / ".model.build"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"w" * 1000)
    (tmp / "sub" / "tokenizer.json").write_text("{}")
    copies = []
    monkeypatch.setattr(shutil, "copy2", lambda *a, **k: copies.append(a))  # a rename within one disk copies nothing
    models._publish(tmp, tmp_path / "model")
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == b"w" * 1000
    assert (tmp_path / "model" / "sub" / "tokenizer.json").read_text() == "{}"
    assert list(tmp.iterdir()) == [] and copies == []


# -- bad input: one line naming the file (or argument) and the cause, nothing written lost --------------------

def test_a_torn_or_garbage_line_names_the_file_and_line(tmp_path):
    split = tmp_path / "train.jsonl"
    split.write_text('{"question": "q", "answer": "#### 1"}\n\n{"question": "cut sh')
    with pytest.raises(data.DataError, match=rf"^{split}:3: not a problem record \(Unterminated string") as exc:
        data.read_jsonl(split)
    assert "\n" not in str(exc.value)
    split.write_text('{"question": "q", "answer": "#### 1"}\n[1, 2]\n')
    with pytest.raises(data.DataError, match=rf"^{split}:2: not a problem record \(a JSON list, not an object\)"):
        data.read_jsonl(split)
    split.write_bytes(b'{"question": "caf\xe9"}\n')
    with pytest.raises(data.DataError, match=rf"^{split}: not UTF-8 text"):
        data.read_jsonl(split)


def test_a_split_with_no_problems_is_refused(tmp_path):
    split = tmp_path / "train.jsonl"
    for text in ("", "\n  \n"):
        split.write_text(text)
        with pytest.raises(data.DataError, match=rf"^{split}: holds no problems"):
            data.read_jsonl(split)


@pytest.mark.parametrize(("n_train", "n_test", "flag"), [(0, 4, "--n-train"), (-5, 4, "--n-train"), (4, 0, "--n-test")])
def test_synthetic_data_refuses_an_empty_split_and_writes_nothing(tmp_path, n_train, n_test, flag):
    with pytest.raises(data.DataError, match=rf"^{flag} must be at least 1, got {min(n_train, n_test)}"):
        data.write_synthetic(tmp_path / "d", n_train, n_test, seed=0)
    assert not (tmp_path / "d").exists()


def test_a_record_without_question_or_answer_text_names_its_file_and_line(tmp_path):
    split = tmp_path / "train.jsonl"
    good = '{"question": "q", "answer": "#### 1"}\n'
    for record, what in [({"question": "q"}, "no 'answer' text (missing; keys: question)"),
                         ({"question": "q", "answer": 42}, "no 'answer' text (42, not text; keys: question, answer)"),
                         ({"answer": "#### 2"}, "no 'question' text (missing; keys: answer)")]:
        split.write_text(good + "\n" + json.dumps(record) + "\n" + good)  # a blank line: line 3, not row 2
        with pytest.raises(data.DataError, match=rf"^{split}:3: problem record has {re.escape(what)}") as exc:
            data.read_jsonl(split)
        assert "\n" not in str(exc.value)


def test_answers_without_a_number_pass_with_one_warning_that_counts_them(tmp_path):
    split = tmp_path / "train.jsonl"
    rows = [{"question": "q", "answer": a} for a in ("#### 1", "no idea", "#### 2", "#### none")]
    split.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning) as caught:
        assert data.read_jsonl(split) == rows
    assert [str(w.message) for w in caught] == [
        f"{split}: 2 of 4 answers hold no number (first at {split}:2): no completion can be right on those problems"]
    split.write_text(json.dumps(rows[0]) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data.read_jsonl(split)  # every answer has its number: no warning


@pytest.mark.parametrize(("train", "said"), [
    ("", "train.jsonl: holds no problems"),
    ('{"question": "q", "answer": "#### 1"}\n{"question": "q2"}\n', r"train.jsonl:2: problem record has no 'answer'"),
])
def test_a_run_on_a_bad_train_split_stops_before_the_trainer_and_engine(tmp_path, train, said):
    from hybridrl.run.loop import run_loop
    from hybridrl.study.run_config import RunConfig

    class NoEngine:  # any use of the engine (preflight, start) would mean the run went on
        def __getattr__(self, name):
            raise AssertionError(f"the engine was used ({name}) on a bad train split")

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(train)
    (tmp_path / "data" / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(data.DataError, match=said):
        run_loop(RunConfig(model="tiny", engine="vllm", eval_every=0), "r-empty", tmp_path / "model",
                 tmp_path / "data", tmp_path / "run", {}, progress=False, engine=NoEngine())


_TINY = {"arch": "qwen3", "dtype": "float32", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
         "max_position_embeddings": 128, "tie_word_embeddings": True, "seed": 0}


def test_model_never_replaces_an_out_directory_it_did_not_write(tmp_path):
    src = tmp_path / "local-model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    for spec in ({"path": str(src)}, {"hf_id": "nobody/nothing"}, _TINY):  # refused before any download or build
        with pytest.raises(models.ModelOutError, match=rf"^--out {precious} exists and was not written by hybridrl"):
            models.prepare(spec, tmp_path / "no-corpus.jsonl", precious)
        assert (precious / "notes.txt").read_text() == "mine"
    with pytest.raises(models.ModelOutError):  # nor by the swap itself
        models._publish(tmp_path, precious)
    assert (precious / "notes.txt").read_text() == "mine"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(models.ModelOutError, match="is a file"):
        models.prepare({"path": str(src)}, tmp_path / "no-corpus.jsonl", tmp_path / "afile")
    # what hybridrl wrote is rebuilt in place: its link, an empty directory, a directory holding its marker
    link = tmp_path / "link"
    models.prepare({"path": str(src)}, tmp_path / "no-corpus.jsonl", link)
    models.prepare({"path": str(src)}, tmp_path / "no-corpus.jsonl", link)
    assert link.resolve() == src.resolve() and (src / "config.json").exists()
    for built in (tmp_path / "empty", tmp_path / "built"):
        built.mkdir()
    (tmp_path / "built" / models.MARKER).write_text("{}")
    (tmp_path / "built" / "model.safetensors").write_text("old")
    for built in (tmp_path / "empty", tmp_path / "built"):
        models.prepare({"path": str(src)}, tmp_path / "no-corpus.jsonl", built)
        assert built.is_symlink()


def test_a_bad_model_spec_is_one_config_error_naming_the_key(tmp_path, capsys):
    from hybridrl.cli import main
    from hybridrl.study.config import ConfigError

    with pytest.raises(ConfigError, match=r"^--spec is not JSON \(Expecting property name"):
        models.parse_spec("{arch: qwen3")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        models.parse_spec("[1]")
    assert models.parse_spec('{"arch": "qwen3"}') == {"arch": "qwen3"}
    known = "qwen3, qwen2, llama, qwen3_moe"
    for spec, said in (({**_TINY, "arch": "qwen9"}, f"model spec: unknown arch 'qwen9' (known: {known})"),
                       ({k: v for k, v in _TINY.items() if k != "arch"},
                        f"model spec has none of path, hf_id or arch (arch: one of {known})")):
        rc = main(["model", "--spec", json.dumps(spec), "--corpus", str(tmp_path / "c.jsonl"),
                   "--out", str(tmp_path / "m")])
        assert rc == 2 and capsys.readouterr().err == f"hybridrl: config error: {said}\n"
    assert not (tmp_path / "m").exists()


def test_a_model_on_an_empty_or_torn_corpus_names_the_file(tmp_path):
    corpus = tmp_path / "train.jsonl"
    test = tmp_path / "test.jsonl"
    test.write_text('{"question": "q", "answer": "#### 1"}\n')
    torn = '{"question": "q", "answer": "#### 1"}\n{"quest'
    for text, cause in (("", "holds no problems"), (torn, "2: not a problem record")):
        corpus.write_text(text)
        for spec in (_TINY, {**_TINY, "warm_start": {"steps": 1}}):
            with pytest.raises(data.DataError, match=rf"^{corpus}:? ?{cause}"):
                models.prepare(spec, corpus, tmp_path / "m", test)
    assert not (tmp_path / "m").exists()


def test_a_local_model_path_that_is_not_there_or_not_a_checkpoint_says_which(tmp_path):
    from hybridrl.study import models

    with pytest.raises(FileNotFoundError, match=r"^model path .*nowhere does not exist$"):
        models.prepare({"path": str(tmp_path / "nowhere")}, tmp_path / "c.jsonl", tmp_path / "m")
    (tmp_path / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json: not a Hugging Face checkpoint"):
        models.prepare({"path": str(tmp_path / "plain")}, tmp_path / "c.jsonl", tmp_path / "m")
    assert not (tmp_path / "m").exists()


TINY_DENSE = {"init": "random", "arch": "qwen3", "dtype": "bfloat16", "vocab_size": 300, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 16, "seed": 3}


def test_weights_drawn_on_the_cpu_are_those_every_earlier_build_drew(tmp_path):
    """init_device's default keeps a study's random model what it was: float32 draws under the seed, then cast."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    data.write_synthetic(tmp_path / "data", 32, 4, seed=0)
    models.build_random(TINY_DENSE, tmp_path / "data" / "train.jsonl", tmp_path / "model")
    built = load_file(tmp_path / "model" / "model.safetensors")
    config = Qwen3Config.from_pretrained(tmp_path / "model")
    torch.manual_seed(3)
    before = Qwen3ForCausalLM(config).to(torch.bfloat16).state_dict()  # how the build drew them until now
    assert built["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    for name in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):
        torch.testing.assert_close(built[name], before[name], rtol=0, atol=0)


def test_weights_drawn_on_cuda_need_a_gpu_and_make_the_build_a_gpu_job(tmp_path, monkeypatch):
    import torch

    from hybridrl.study.rule_params import model_build_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    data.write_synthetic(tmp_path / "data", 32, 4, seed=0)
    with pytest.raises(ConfigError, match="init_device: cuda, but no CUDA device"):
        models.build_random({**TINY_DENSE, "init_device": "cuda"}, tmp_path / "data" / "train.jsonl", tmp_path / "m")
    assert not (tmp_path / "m").exists()
    assert model_build_gpus({**TINY_DENSE, "init_device": "cuda"}) == 1
    assert model_build_gpus(TINY_DENSE) == 0
    assert model_build_gpus({**TINY_DENSE, "warm_start": {"device": "cuda"}}) == 1
    assert model_build_gpus({**TINY_DENSE, "warm_start": {"tokens": 10}}, fake_gpus=True) == 1
    assert model_build_gpus({**TINY_DENSE, "warm_start": {"tokens": 10}}) == 0
