"""The correctness gates of every step: the base model unchanged, the adapter applied, the KV capacity recovered,
and the trainer's logprobs in agreement with the engine's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridrl import data as gsm8k
from hybridrl.atomic import write_text
from hybridrl.engines.base import Completion, Engine, EngineError, Request, Sampling
from hybridrl.placement import ADAPTER_NAME
from hybridrl.run_config import RunConfig

CANARY_QUESTION = "Ava has 12 apples. Ben gives Ava 7 more. How many apples does Ava have now?"
CANARY_TOKENS = 16
KV_TOLERANCE = 0.01


class Canary:
    """A greedy probe: the base model must answer as at step 0, and the adapter must change the answer."""

    def __init__(self, tokenizer: Any, path: Path) -> None:
        self.prompt = tokenizer(gsm8k.prompt_text(CANARY_QUESTION))["input_ids"]
        self.path = path
        self.base: Completion | None = None
        self.kv_capacity: int | None = None

    def _probe(self, engine: Engine, adapter: str | None) -> Completion:
        sampling = Sampling(temperature=0.0, max_new_tokens=CANARY_TOKENS, ignore_eos=True, seed=0)
        out = engine.generate([Request(self.prompt, sampling, adapter)])[0]
        if out.error:
            raise EngineError(f"canary request failed: {out.error}")
        return out

    def record_baseline(self, engine: Engine) -> None:
        if self.path.exists():  # a resumed run compares against the original step-0 answer
            saved = json.loads(self.path.read_text())
            self.base = Completion(token_ids=saved["token_ids"], logprobs=saved["logprobs"])
            self.kv_capacity = saved.get("kv_capacity_tokens")
            return
        self.base = self._probe(engine, None)
        self.kv_capacity = engine.kv_capacity_tokens()
        write_text(self.path, json.dumps({"token_ids": self.base.token_ids, "logprobs": self.base.logprobs,
                                          "kv_capacity_tokens": self.kv_capacity}))

    def check(self, engine: Engine, adapter_loaded: bool) -> dict[str, Any]:
        base_now = self._probe(engine, None)
        out: dict[str, Any] = {"check/base_canary_ok": base_now.token_ids == self.base.token_ids}
        if adapter_loaded:
            tuned = self._probe(engine, ADAPTER_NAME)
            # a small update may keep the greedy tokens, but it must move their logprobs
            shared = min(len(tuned.logprobs), len(base_now.logprobs))
            moved = max((abs(a - b) for a, b in zip(tuned.logprobs[:shared], base_now.logprobs[:shared],
                                                     strict=True)), default=0.0)
            out["check/adapter_applied"] = tuned.token_ids != base_now.token_ids or moved > 1e-6
            out["check/adapter_logprob_shift"] = moved
        else:
            out["check/adapter_applied"] = None
        kv = engine.kv_capacity_tokens()
        out["mem/kv_capacity_tokens"] = kv
        out["check/kv_capacity_ok"] = (None if kv is None or not self.kv_capacity
                                       else abs(kv - self.kv_capacity) <= KV_TOLERANCE * self.kv_capacity)
        return out


def logprob_gate(gap: float | None, run: RunConfig) -> dict[str, Any]:
    """Trainer-vs-engine agreement: did the engine sample with the weights the trainer thinks it had?"""
    return {"check/logprob_gap_max": run.max_logprob_gap,
            "check/logprob_agreement_ok": None if gap is None else gap <= run.max_logprob_gap}
