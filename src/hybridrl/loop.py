"""The step loop of one run: rollout, reward, train, sync, check, record; resumable and retrying."""

from __future__ import annotations

import json
import math
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hybridrl import data as gsm8k
from hybridrl.barrier import StartBarrier
from hybridrl.engines import make_engine
from hybridrl.engines.base import Completion, Engine, EngineError, Request, Sampling
from hybridrl.engines.gpus import process_used_gb
from hybridrl.placement import ADAPTER_NAME, make_placement
from hybridrl.provenance import collect
from hybridrl.provenance import write as write_provenance
from hybridrl.rl import group_advantages
from hybridrl.run_config import RunConfig
from hybridrl.telemetry import MemorySampler, Timings, append_record, read_records, rollout_stats
from hybridrl.trainers import make_trainer
from hybridrl.trainers.base import Sample

console = Console(stderr=True, soft_wrap=True)  # one line per step, also in log files
CANARY_QUESTION = "Ava has 12 apples. Ben gives Ava 7 more. How many apples does Ava have now?"
CANARY_TOKENS = 16
KV_TOLERANCE = 0.01


class RunFailed(RuntimeError):
    """A correctness gate failed or the engine could not be brought back; the run stops loudly."""


@dataclass
class RunPaths:
    root: Path

    @property
    def steps(self) -> Path:
        return self.root / "steps.jsonl"

    @property
    def canary(self) -> Path:
        return self.root / "canary.json"

    def adapter(self, step: int) -> Path:
        return self.root / "adapters" / f"step-{step:04d}"

    @property
    def logs(self) -> Path:
        return self.root / "logs"


def step_requests(problems: list[dict], run: RunConfig, step: int, tokenizer) -> tuple[list[Request], list[str]]:
    """The same prompts, seeds and sampling for every engine: they depend only on (seed, step)."""
    rng = random.Random(run.seed * 1_000_003 + step)
    picked = rng.sample(range(len(problems)), min(run.prompts_per_step, len(problems)))
    s = run.sampling
    requests, answers = [], []
    for p_i, idx in enumerate(picked):
        ids = tokenizer(gsm8k.prompt_text(problems[idx]["question"]))["input_ids"]
        for g in range(run.group_size):
            sampling = Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_new_tokens=run.max_new_tokens, ignore_eos=s.ignore_eos,
                                seed=(run.seed * 1_000_003 + step * 10_007 + p_i * 101 + g) % 2**31)
            requests.append(Request(ids, sampling, adapter=ADAPTER_NAME if step > 1 else None))
            answers.append(problems[idx]["answer"])
    return requests, answers


class Canary:
    """A greedy probe: the base model must answer as at step 0, and the adapter must change the answer."""

    def __init__(self, tokenizer, path: Path) -> None:
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
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"token_ids": self.base.token_ids, "logprobs": self.base.logprobs,
                                   "kv_capacity_tokens": self.kv_capacity}))
        tmp.replace(self.path)

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


def _install_sigterm() -> None:
    """SLURM preemption and Snakemake cancel send SIGTERM: unwind so `finally` stops the engine."""
    def handler(signum, frame):
        console.print("[yellow]SIGTERM: stopping the engine; completed steps are kept and the run resumes")
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def run_loop(run: RunConfig, run_id: str, model_dir: Path, data_dir: Path, out_dir: Path,
             env_spec: dict[str, Any], progress: bool = True, engine: Engine | None = None) -> list[dict[str, Any]]:
    """Run (or resume) all steps of one configuration; returns the records of every step.

    `engine` is for tests of the loop itself; runs build theirs from the config.
    """
    from transformers import AutoTokenizer

    _install_sigterm()
    paths = RunPaths(out_dir)
    paths.root.mkdir(parents=True, exist_ok=True)
    done = read_records(paths.steps)
    first_step = len(done) + 1
    if first_step > run.steps:
        console.print(f"[green]{run_id}: all {run.steps} steps already recorded")
        return done
    problems = gsm8k.read_jsonl(data_dir / "train.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    barrier = StartBarrier.from_env()
    sampler = MemorySampler().start()
    engine = engine or make_engine(run, model_dir, env_spec, paths.logs)
    trainer = None
    try:
        if hasattr(engine, "preflight"):  # a missing engine fails now, not after the trainer's build
            engine.preflight()
        trainer = make_trainer(run, model_dir, paths.root)
        adapter = paths.adapter(first_step - 1) if first_step > 1 else None
        if adapter is not None:
            if not adapter.exists():
                raise RunFailed(f"{run_id}: step {first_step - 1} is recorded but {adapter} is missing")
            if trainer:
                trainer.resume(adapter)
            console.print(f"{run_id}: resuming at step {first_step} from {adapter}")
        if trainer and run.placement in ("colocate", "restart"):  # the engine starts on a shared GPU
            trainer.offload()
        sampler.set_phase("start")
        t0 = time.perf_counter()
        engine.start((ADAPTER_NAME, adapter) if adapter else None)
        startup_s = time.perf_counter() - t0
        write_provenance(paths.root / "provenance.json", collect(run, engine.describe()))
        canary = Canary(tokenizer, paths.canary)
        canary.record_baseline(engine)
        placement = make_placement(run.placement, engine, trainer, sampler)
        waited_s = barrier.wait(run_id, console.print) if barrier else None
        records = list(done)
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=console, disable=not progress) as bar:
            task = bar.add_task(run_id, total=run.steps, completed=first_step - 1)
            for step in range(first_step, run.steps + 1):
                record = one_step(run, run_id, step, problems, tokenizer, engine, trainer, placement,
                                  canary, sampler, paths)
                record["timing_s/engine_start"] = startup_s if step == first_step else None
                record["timing_s/start_barrier"] = waited_s if step == first_step else None
                append_record(paths.steps, record)
                records.append(record)
                bar.advance(task)
                console.print(_summary(record))
        return records
    finally:
        if barrier:
            barrier.leave(run_id)
        engine.stop()
        if trainer:
            trainer.close()
        sampler.close()


def _restart(run: RunConfig, engine: Engine, adapter: Path | None, restarts: int, exc: EngineError) -> int:
    """Start a failed engine again (with `adapter`), or give up once the step has used run.retries."""
    if restarts >= run.retries:
        raise RunFailed(f"{engine.name} failed {restarts + 1} times in one step; giving up: {exc}") from exc
    restarts += 1
    console.print(f"[yellow]{engine.name} failed ({str(exc).splitlines()[0]}); restart {restarts}/{run.retries}")
    engine.stop()
    engine.start((ADAPTER_NAME, adapter) if adapter else None)
    return restarts


def _rollout_with_retries(run: RunConfig, engine: Engine, requests: list[Request],
                          adapter: Path | None) -> tuple[list[Completion], int]:
    """A dead or broken engine is restarted and the rollout retried, at most run.retries times."""
    restarts = 0
    while True:
        try:
            if not engine.alive():
                raise EngineError(f"{engine.name} is not running")
            completions = engine.generate(requests, progress=True)
            if all(c.error for c in completions):
                raise EngineError(f"every request failed, e.g. {completions[0].error}")
            return completions, restarts
        except EngineError as exc:
            restarts = _restart(run, engine, adapter, restarts, exc)


def _through_engine_death(run: RunConfig, engine: Engine, adapter: Path | None, restarts: int,
                          transition: Callable[[], None], redo: bool) -> int:
    """A placement transition (sleep, wake, adapter load); an engine found dead there is started again with
    `adapter` and counted, as in a rollout (`redo`: run the transition again on the fresh engine). A live engine
    that answers wrongly is a real error and is raised. Returns the step's restarts so far."""
    while True:
        try:
            transition()
            return restarts
        except EngineError as exc:
            if engine.alive():
                raise
            restarts = _restart(run, engine, adapter, restarts, exc)
            if not redo:
                return restarts


def one_step(run, run_id, step, problems, tokenizer, engine, trainer, placement, canary, sampler,
             paths: RunPaths) -> dict[str, Any]:
    t = Timings()
    step_t0 = time.perf_counter()
    prev_adapter = paths.adapter(step - 1) if step > 1 else None
    requests, answers = step_requests(problems, run, step, tokenizer)
    sampler.take()  # memory of this step only
    trainer_gb = trainer_gpu_gb(trainer)  # the trainer is idle (and offloaded in colocate) while the engine generates
    with t.phase("gen", sampler):
        completions, restarts = _rollout_with_retries(run, engine, requests, prev_adapter)
    gen_s = t.s["gen"]
    failed = [(i, c.error) for i, c in enumerate(completions) if c.error]
    if failed:  # the step goes on without them; the cause goes to the log and requests/step-NNNN.jsonl
        console.print(f"[yellow]step {step}: {len(failed)} of {len(completions)} requests failed; "
                      f"first (request {failed[0][0]}): {failed[0][1]}")
    with t.phase("reward", sampler):
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        ok = [c.error is None for c in completions]
        correct = [gsm8k.reward(x, a) if good else 0.0 for x, a, good in zip(texts, answers, ok, strict=True)]
        rewards = [gsm8k.shaped_reward(x, a, run.format_reward) if good else 0.0
                   for x, a, good in zip(texts, answers, ok, strict=True)]
        advantages = group_advantages(rewards, run.group_size)
    _write_requests(paths.root / "requests" / f"step-{step:04d}.jsonl", requests, completions, rewards)
    samples = [Sample(r.prompt_ids, c.token_ids, c.logprobs, a)
               for r, c, a in zip(requests, completions, advantages, strict=True) if c.error is None and c.token_ids]
    restarts = _through_engine_death(run, engine, prev_adapter, restarts, lambda: placement.before_train(t),
                                     redo=True)  # a fresh engine must still sleep (colocate) before training
    adapter, train_metrics = None, {}
    with t.phase("update_actor", sampler):
        if trainer is not None:
            result = trainer.step(step, samples, paths.adapter(step))
            adapter, train_metrics = result.adapter_dir, result.metrics
        else:
            _hold_ballast(run)
    # started again, the engine already holds the new adapter: nothing to redo
    restarts = _through_engine_death(run, engine, adapter or prev_adapter, restarts,
                                     lambda: placement.after_train(t, adapter), redo=False)
    sampler.set_phase("check")
    # a zero adapter (e.g. all advantages zero so far) cannot change anything: the check does not apply
    nonzero = adapter is not None and train_metrics.get("train/lora_norm", 1.0) > 0
    checks = canary.check(engine, adapter_loaded=nonzero)
    if checks["check/base_canary_ok"] is False:
        raise RunFailed(f"{run_id} step {step}: the base model's greedy canary changed after the transition: "
                        "base weights were corrupted (e.g. SGLang released weights without a CPU backup)")
    t.s["step"] = time.perf_counter() - step_t0
    record: dict[str, Any] = {
        "run_id": run_id, "engine": run.engine, "placement": run.placement, "trainer": run.trainer,
        "model": run.model, "tp": run.tp, "seed": run.seed, "step": step, "time_unix": time.time(),
    }
    record.update(t.record())
    record.update(rollout_stats(completions, gen_s))
    record.update({"perf/train_tokens": None, "perf/train_tok_s": None, "train/loss": None,
                   "train/grad_norm": None, "train/kl": None, "train/clipfrac": None,
                   "check/rollout_logprob_abs_diff": None, "check/logprob_gap_sample_max": None,
                   "check/logprob_gap_token_max": None})
    record.update({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in train_metrics.items()})
    if record["perf/train_tokens"] and t.s.get("update_actor"):
        record["perf/train_tok_s"] = record["perf/train_tokens"] / t.s["update_actor"]
    record["reward/mean"] = sum(rewards) / len(rewards)
    record["reward/accuracy"] = sum(correct) / len(correct)
    record["errors/engine_restarts"] = restarts
    record.update({"mem/used_gb_gen": None, "mem/used_gb_train": None, "mem/peak_gb": None,
                   "mem/trainer_gb_gen": trainer_gb})
    mem = sampler.take()
    if mem:
        mem["mem/used_gb_train"] = mem.get("mem/used_gb_update_actor")
    record.update(mem)
    record.update(checks)
    record.update(logprob_gate(record.get("check/rollout_logprob_abs_diff"), run))
    step_metrics = getattr(engine, "step_metrics", None)  # engine-side readings, e.g. NVML after sleep/wake
    if step_metrics:
        record.update(step_metrics())
    return record


def logprob_gate(gap: float | None, run: RunConfig) -> dict[str, Any]:
    """Trainer-vs-engine agreement: did the engine sample with the weights the trainer thinks it had?"""
    limit = run.max_logprob_gap
    return {"check/logprob_gap_max": limit, "check/logprob_agreement_ok": None if gap is None else gap <= limit}


def trainer_gpu_gb(trainer: Any) -> float | None:
    """GPU memory (GB, NVML) charged to the trainer's processes: in colocate, what it leaves beside the engine."""
    if trainer is None:
        return None
    readings = [process_used_gb(pid) for pid in trainer.gpu_pids()]
    readings = [r for r in readings if r is not None]
    return sum(readings) if readings else None


def _write_requests(path: Path, requests: list[Request], completions: list[Completion],
                    rewards: list[float]) -> None:
    """Per-request audit trail: which adapter each request named, its timings, tokens and reward."""
    rows = [{"i": i, "adapter": r.adapter, "seed": r.sampling.seed, "prompt_tokens": len(r.prompt_ids),
             "tokens": len(c.token_ids), "ttft_s": c.ttft_s, "latency_s": c.latency_s,
             "finish_reason": c.finish_reason, "error": c.error, "reward": w}
            for i, (r, c, w) in enumerate(zip(requests, completions, rewards, strict=True))]
    gsm8k.write_jsonl_atomic(path, rows)


def _hold_ballast(run: RunConfig) -> None:
    """trainer: none — hold ballast_gb of GPU memory for ballast_s seconds in place of training."""
    import torch

    ballast = None
    if run.ballast_gb > 0 and torch.cuda.is_available():
        ballast = torch.empty(int(run.ballast_gb * 1e9), dtype=torch.uint8, device="cuda")
        ballast.fill_(1)
    time.sleep(run.ballast_s)
    del ballast
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _summary(r: dict[str, Any]) -> str:
    def f(key: str, fmt: str = ".2f") -> str:
        v = r.get(key)
        return "-" if v is None else format(v, fmt)

    return (f"step {r['step']}: gen {f('timing_s/gen')} s, {f('perf/throughput', '.1f')} tok/s, "
            f"train {f('timing_s/update_actor')} s, step {f('timing_s/step')} s, reward {f('reward/mean')}, "
            f"|dlogp| {f('check/rollout_logprob_abs_diff', '.2e')}, gates: canary {r.get('check/base_canary_ok')}, "
            f"adapter {r.get('check/adapter_applied')}, kv {r.get('check/kv_capacity_ok')} "
            f"({f('mem/kv_capacity_tokens', '.0f')} tokens), logprobs {r.get('check/logprob_agreement_ok')}")
