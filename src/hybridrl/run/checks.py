"""The correctness gates of every step: the base model unchanged, the adapter applied, the KV capacity recovered,
and the trainer's logprobs in agreement with the engine's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridrl.atomic import write_text
from hybridrl.engines.base import Completion, Engine, EngineError, Request, Sampling
from hybridrl.run.placement import ADAPTER_NAME
from hybridrl.run.record import ENGINE_ASLEEP_OWN, IDENTITY_ADAPTER, NO_ADAPTER
from hybridrl.study.run_config import RunConfig
from hybridrl.task import data as gsm8k

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
        self.engine_started(engine)
        if self.path.exists():  # a resumed run compares against the original step-0 answer
            saved = json.loads(self.path.read_text())
            self.base = Completion(token_ids=saved["token_ids"], logprobs=saved["logprobs"])
            return
        self.base = self._probe(engine, None)
        write_text(self.path, json.dumps({"token_ids": self.base.token_ids, "logprobs": self.base.logprobs,
                                          "kv_capacity_tokens": self.kv_capacity}))

    def engine_started(self, engine: Engine) -> None:
        """The KV capacity of an engine process right after its start, which its later readings are held to.
        An engine started again (a restart, a resume) sizes its cache from the memory it finds free then: on a GPU
        shared with the trainer, SGLang restarted beside the trainer's optimizer state got 23% less on an H200.
        That shows in mem/kv_capacity_tokens; the gate asks whether
        transitions keep an engine's own capacity."""
        self.kv_capacity = engine.kv_capacity_tokens()

    def check(self, engine: Engine, not_judged: str | None) -> dict[str, Any]:
        """The gates after a transition; the adapter is probed unless `not_judged` says why it cannot be."""
        base_now = self._probe(engine, None)
        out: dict[str, Any] = {"check/base_canary_ok": base_now.token_ids == self.base.token_ids,
                               "check/adapter_not_judged": not_judged}
        if not_judged is None:
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


def adapter_not_judged(adapter: Path | None, lora_norm: float | None) -> str | None:
    """Why the adapter gate cannot judge this adapter, or None where it can. A trainer that reports no norm
    (train/lora_norm) is judged."""
    if adapter is None:
        return NO_ADAPTER
    return IDENTITY_ADAPTER if lora_norm is not None and lora_norm <= 0 else None


# Per model family: (warn above, fail above) for the mean trainer-vs-engine gap per token. Published bf16 gaps are
# about 0.01-0.03 for dense models and higher for MoE without routing replay (about 10% of Qwen3-30B-A3B's routers
# pick other experts, arXiv 2510.11370); slime's CI fails a rollout-logprob gap above 0.1.
GAP_LIMITS = {"dense": (0.02, 0.1), "moe": (0.05, 0.1)}


def model_family(config: dict[str, Any]) -> str:
    """'moe' for a checkpoint with routed experts (Qwen3-MoE: num_experts), else 'dense'."""
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    return "moe" if experts or "moe" in str(config.get("model_type", "")) else "dense"


def gap_limits(run: RunConfig, family: str) -> tuple[float, float]:
    """(warn, fail) limits: the run's own where it sets them, else its model family's."""
    warn, fail = GAP_LIMITS[family]
    return run.max_logprob_gap or warn, run.logprob_gap_fail or fail


def logprob_gate(gap: float | None, limits: tuple[float, float]) -> dict[str, Any]:
    """Trainer-vs-engine agreement: did the engine sample with the weights the trainer thinks it had?

    pass up to the warn limit; warn above it (recorded and reported, the run goes on); fail above the fail limit
    (the loop stops the run). A single step cannot show drift: the report fits the gap's trend over steps."""
    warn, fail = limits
    tier = None if gap is None else "pass" if gap <= warn else "warn" if gap <= fail else "fail"
    return {"check/logprob_gap_max": warn, "check/logprob_gap_fail_at": fail, "check/logprob_gap_tier": tier,
            "check/logprob_agreement_ok": None if tier is None else tier == "pass"}


def awake_memory_gate(earlier: list[dict[str, Any]], record: dict[str, Any], bound_gb: float) -> dict[str, Any]:
    """Does a woken engine get back the memory it held right after it started, its KV cache above all (a public
    write-up reported in-process vLLM 53 GB short after its first sleep and wake)? This step's NVML reading after
    wake against the latest start's (an engine started again sizes itself anew); None where the engine never woke
    or no start was read. The KV capacity an engine reports is fixed when it starts, so only memory can show it."""
    starts = [r.get("mem/engine_started_gb") for r in (*earlier, record)]
    starts = [s for s in starts if s is not None]
    awake = record.get("mem/engine_awake_gb")
    if awake is None or not starts:
        return {"check/awake_shortfall_gb": None, "check/awake_memory_ok": None}
    short = starts[-1] - awake
    return {"check/awake_shortfall_gb": short, "check/awake_memory_ok": short <= bound_gb}


def asleep_key(record: dict[str, Any]) -> str:
    """The reading the asleep gate judges: the engine's own (the trainer's processes left out) where the step has
    it, the whole GPUs' otherwise (no NVML per process, or the trainer in the engine's process)."""
    return ENGINE_ASLEEP_OWN if record.get(ENGINE_ASLEEP_OWN) is not None else "mem/engine_asleep_gb"


def asleep_memory_gate(earlier: list[dict[str, Any]], record: dict[str, Any], bound_gb: float) -> dict[str, Any]:
    """Does a sleeping engine give its memory back every time? This step's NVML reading after sleep (asleep_key)
    against the run's first one of the same kind (`earlier` records, a resumed run's included); None where the
    engine never slept."""
    key = asleep_key(record)
    readings = [r.get(key) for r in (*earlier, record)]
    readings = [r for r in readings if r is not None]
    if record.get(key) is None or not readings:
        return {"check/asleep_growth_gb": None, "check/asleep_memory_ok": None}
    growth = record[key] - readings[0]
    return {"check/asleep_growth_gb": growth, "check/asleep_memory_ok": growth <= bound_gb}
