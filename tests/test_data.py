import hashlib
import json
import socket
from pathlib import Path

import pytest
import yaml

from hybridrl.study import models
from hybridrl.study.config import validate
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
