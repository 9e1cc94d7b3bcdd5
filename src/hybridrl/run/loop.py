"""The step loop of one run: resumable, retrying, and each step a list of short named parts.

    part        timed as (timing_s/*, hybridrl.run.record.PHASES)
    rollout     prepare, gen                         the step's requests; the engine generates them
    reward      reward                               rewards, group advantages, the per-request audit file
    transition  sleep | restart, trainer_onload      the placement makes room for training (release_onload: the
                | release_onload                     engine's weights leaving beside the trainer's onload)
    train       update_actor, save_adapter           one GRPO step; a PEFT adapter on disk
    transition  trainer_offload, wake | restart,     the engine gets its memory back and the new adapter
                update_weights
    checks      check                                base canary, adapter applied, KV capacity (hybridrl.run.checks)
    eval        timing_s/eval, outside the step      every eval_every steps: greedy test accuracy with the new adapter
    record      -                                    one JSON line of hybridrl.run.record's keys

An engine found dead in any of them is started again (timing_s/recover, errors/engine_restarts).
"""

from __future__ import annotations

import gc
import json
import math
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hybridrl.engines import make_engine
from hybridrl.engines.base import Completion, Engine, EngineError, Request, Sampling, context_length, stream_flags
from hybridrl.engines.client_ceiling import client_headroom_ok, run_ceiling
from hybridrl.engines.startup import TOTAL, combine
from hybridrl.nvml import processes_used_gb
from hybridrl.run import copy_bandwidth, request_records, run_lock
from hybridrl.run.checks import (
    Canary,
    adapter_not_judged,
    asleep_key,
    asleep_memory_gate,
    awake_memory_gate,
    gap_limits,
    logprob_gate,
    model_family,
)
from hybridrl.run.cores import CoreSplit, engine_env_spec, job_cores, split_cores
from hybridrl.run.gc_pauses import GcPauses
from hybridrl.run.initial_adapter import write_initial_adapter
from hybridrl.run.overlap import AheadRollouts, InFlight, overlap_s
from hybridrl.run.phase_file import PhaseFile
from hybridrl.run.placement import ADAPTER_NAME, Placement, make_placement
from hybridrl.run.provenance import RunProvenance, collect
from hybridrl.run.record import ENGINE_ASLEEP_OWN, ROLLOUT_READINGS, START_PARTS, new_record
from hybridrl.run.telemetry import MemorySampler, Timings, append_record, read_records, rollout_stats
from hybridrl.study.run_config import RunConfig, split_replicate
from hybridrl.task import data as gsm8k
from hybridrl.task.lengths import check_prompts
from hybridrl.task.rl import group_advantages
from hybridrl.trainers import make_trainer
from hybridrl.trainers.base import Sample, Trainer

console = Console(stderr=True, soft_wrap=True)  # one line per step, also in log files


class RunFailed(RuntimeError):
    """A correctness gate failed or the engine could not be brought back; the run stops loudly."""


class AdapterNotApplied(RunFailed):
    """The engine served a non-identity adapter's requests as the base model: no LoRA figure of the run would
    count."""


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
    def phase(self) -> Path:
        """Where the run is now (run/phase_file.py; fault runs wait on it)."""
        return self.root / "phase.json"

    def requests(self, step: int) -> Path:
        return request_records.path(self.root, step)

    @property
    def logs(self) -> Path:
        return self.root / "logs"


@dataclass
class RunContext:
    """What every step of one run works with."""

    run: RunConfig
    run_id: str
    problems: list[dict[str, Any]]
    tokenizer: Any
    engine: Engine
    trainer: Trainer | None
    placement: Placement
    canary: Canary
    sampler: MemorySampler
    paths: RunPaths
    phase: PhaseFile  # phase.json, told every phase and every rollout ahead
    engine_adapter_step: int = 0  # the step whose adapter the engine holds (0: the base model)
    ahead: AheadRollouts = field(init=False)  # overlap: the next step's rollout in flight, told to phase.json
    test_problems: list[dict[str, Any]] | None = None  # the fixed eval slice (eval_every > 0)
    starts_recorded: int = 0  # how many of the engine's starts (Engine.start_parts) a record has taken in
    gc_pauses: GcPauses = field(default_factory=GcPauses)  # the controller's collections (started by run_loop)

    def __post_init__(self) -> None:
        self.ahead = AheadRollouts(self.phase.ahead)

    @property
    def replicate(self) -> int:
        return split_replicate(self.run_id)[1]


def step_requests(problems: list[dict[str, Any]], run: RunConfig, step: int, tokenizer: Any,
                  adapter_step: int | None = None, replicate: int = 1) -> tuple[list[Request], list[str]]:
    """The same prompts, seeds and sampling for every engine: they depend only on (seed, step), and with
    replicate_seeds the sampling seeds on the replicate too. The requests name the policy adapter once there is
    one (from step 1 where lora.init_b_std draws the first): the engine holds step `adapter_step`'s (default: the
    last step's)."""
    has_adapter = (step - 1 if adapter_step is None else adapter_step) > 0 or run.lora.init_b_std > 0
    draw = (replicate - 1) * 7_368_787 if run.replicate_seeds else 0  # replicate 1 keeps the seeds it always had
    picked = gsm8k.step_problems(len(problems), run.seed, step, run.prompts_per_step)
    s = run.sampling
    requests, answers = [], []
    streamed = iter(stream_flags(len(picked) * run.group_size, run.stream_fraction))
    for p_i, idx in enumerate(picked):
        ids = tokenizer(gsm8k.prompt_text(problems[idx]["question"]))["input_ids"]
        for g in range(run.group_size):
            sampling = Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_new_tokens=run.max_new_tokens, ignore_eos=s.ignore_eos,
                                seed=(run.seed * 1_000_003 + step * 10_007 + p_i * 101 + g + draw) % 2**31)
            adapter = ADAPTER_NAME if has_adapter else None
            requests.append(Request(ids, sampling, adapter=adapter, stream=next(streamed)))
            answers.append(problems[idx]["answer"])
    return requests, answers


def _install_sigterm() -> None:
    """SLURM preemption and Snakemake cancel send SIGTERM: unwind so `finally` stops the engine."""
    def handler(signum, frame):
        console.print("[yellow]SIGTERM: stopping the engine; completed steps are kept and the run resumes")
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def run_loop(run: RunConfig, run_id: str, model_dir: Path, data_dir: Path, out_dir: Path,
             env_spec: dict[str, Any], progress: bool = True, engine: Engine | None = None,
             cores: CoreSplit | None = None) -> list[dict[str, Any]]:
    """Run (or resume) all steps of one configuration; returns the records of every step.

    `engine` is for tests of the loop itself; runs build theirs from the config. `cores`: which of the job's cores
    the engine and the trainer use (hybridrl.run.cores; by default split from the job's), recorded in provenance.
    """
    import torch
    from transformers import AutoTokenizer

    _install_sigterm()
    paths = RunPaths(out_dir)
    paths.root.mkdir(parents=True, exist_ok=True)
    lock = run_lock.hold(paths.root, run_id, console)  # noqa: F841 - held until the run returns or dies
    done = read_records(paths.steps)
    first_step = len(done) + 1
    if first_step > run.steps:
        console.print(f"[green]{run_id}: all {run.steps} steps already recorded")
        return done
    problems = gsm8k.read_jsonl(data_dir / "train.jsonl")
    test_problems = gsm8k.read_jsonl(data_dir / "test.jsonl")[:run.eval_problems] if run.eval_every else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model_config = json.loads((model_dir / "config.json").read_text())
    check_prompts(run_id, run, problems, test_problems, tokenizer, context_length(model_config),
                  "at data load, before any engine starts")
    limits = gap_limits(run, model_family(model_config))
    sampler = MemorySampler().start()
    cores = cores or split_cores(run, job_cores())
    engine = engine or make_engine(run, model_dir, engine_env_spec(run, env_spec, cores), paths.logs)
    provenance = RunProvenance(paths.root / "provenance.json")
    engine.on_ports = provenance.add_ports  # every start's, restarts included
    trainer, ctx = None, None
    try:
        engine.preflight()  # a missing engine fails now, not after the trainer's build
        built_at = time.perf_counter()
        trainer = make_trainer(run, model_dir, paths.root)
        if trainer:
            provenance.add_ports(trainer.ports())
        # a resumed run's last adapter, or a fresh run's drawn first one (lora.init_b_std)
        adapter = (paths.adapter(first_step - 1) if first_step > 1
                   else write_initial_adapter(run, model_dir, paths.adapter(0)))
        if adapter is not None:
            if not adapter.exists():
                raise RunFailed(f"{run_id}: step {first_step - 1} is recorded but {adapter} is missing")
            if trainer:
                trainer.resume(adapter)
            verb = "resuming" if first_step > 1 else "starting"
            console.print(f"{run_id}: {verb} at step {first_step} from {adapter}")
        set_up = {"timing_s/trainer_build": time.perf_counter() - built_at}
        measured_at = time.perf_counter()
        # before the engine starts, so that nothing else loads the host while the client and the link are measured
        bandwidth = copy_bandwidth.measure(run.device)
        ceiling = run_ceiling(engine.name, run.prompts_per_step * run.group_size, run.max_new_tokens,
                              run.max_concurrency, run.stream_fraction, run.client_ceiling_s, run.shared_pool,
                              run.keep_connections)
        set_up["timing_s/host_measure"] = time.perf_counter() - measured_at
        placement = make_placement(run.placement, engine, trainer, sampler, run)
        startup_s = placement.start_engine(adapter)
        provenance.write(collect(run, engine.describe(), cores.record(torch.get_num_threads()), model_config,
                                 bandwidth) | ({"base_residency": placement.base_residency}
                                               if placement.base_residency else {}))
        canary = Canary(tokenizer, paths.canary)
        canary.record_baseline(engine)
        ctx = RunContext(run, run_id, problems, tokenizer, engine, trainer, placement, canary, sampler, paths,
                         PhaseFile(paths.phase), test_problems=test_problems, engine_adapter_step=first_step - 1,
                         starts_recorded=len(engine.start_parts))
        ctx.gc_pauses.start()
        if run.gc_freeze:
            freeze_heap()
        first_start = start_keys("timing_s/engine_start", engine.start_parts[-1:])
        records = list(done)
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=console, disable=not progress) as bar:
            task = bar.add_task(run_id, total=run.steps, completed=first_step - 1)
            for step in range(first_step, run.steps + 1):
                record = one_step(ctx, step)
                record["perf/client_ceiling_tok_s"] = ceiling
                record["check/client_headroom_ok"] = client_headroom_ok(record["perf/throughput"], ceiling)
                record.update(asleep_memory_gate(records, record, run.max_asleep_growth_gb))
                record.update(awake_memory_gate(records, record, run.max_awake_shortfall_gb))
                # a rollout from an older adapter (overlap) differs from the trainer by design: not judged
                fresh = record["rollout/staleness"] == 0
                record.update(logprob_gate(record["check/rollout_logprob_abs_diff"] if fresh else None, limits))
                if step == first_step:
                    record.update({"timing_s/engine_start": startup_s, **first_start, **set_up})
                append_record(paths.steps, record)  # kept even when the gate below stops the run: the evidence
                records.append(record)
                if record["check/logprob_gap_tier"] == "fail":
                    raise RunFailed(f"{run_id} step {step}: the trainer's and the engine's logprobs differ by "
                                    f"{record['check/rollout_logprob_abs_diff']:.4f} a token on average, above the "
                                    f"fail limit {limits[1]} (logprob_gap_fail): the engine did not sample with the "
                                    "weights the trainer holds (a stale or wrong adapter, or corrupted weights)")
                stop_if_adapter_dropped(run_id, step, engine.name, record)
                if record["check/asleep_memory_ok"] is False:
                    whose = " (the trainer's processes left out)" if asleep_key(record) == ENGINE_ASLEEP_OWN else ""
                    raise RunFailed(f"{run_id} step {step}: {engine.name} holds "
                                    f"{record['check/asleep_growth_gb']:.2f} GB more GPU memory asleep{whose} than at "
                                    f"its first sleep (bound: max_asleep_growth_gb {run.max_asleep_growth_gb}): it "
                                    "leaks")
                bar.advance(task)
                console.print(_summary(record))
        return records
    finally:
        engine.stop()  # a rollout still in flight ends with its engine
        if ctx is not None:
            ctx.ahead.close()
            ctx.gc_pauses.close()
            if run.gc_freeze:
                gc.unfreeze()  # the process may go on (a test, a sweep): its heap collects as before
        if trainer:
            trainer.close()
        sampler.close()


# -- one step ------------------------------------------------------------------------------------------------------

@dataclass
class Rollout:
    requests: list[Request]
    answers: list[str]
    completions: list[Completion]
    adapter_step: int  # the step whose adapter the engine rolled out with (step N-1's, or N-2's when run ahead)
    staleness: int  # steps between that adapter and the trainer's (0 on-policy)
    gen_s: float  # the engine's own time on the rollout (for throughput), waited for or not
    trainer_gb: float | None  # GPU memory the trainer held beside the engine (mem/trainer_gb_gen)
    ran_ahead: bool = False  # rolled out during the last step's training (overlap): gen was the wait for it


@dataclass
class Scored:
    rewards: list[float]  # shaped: a parseable wrong answer gets format_reward
    correct: list[float]
    samples: list[Sample]  # what the trainer learns from: requests that succeeded and generated tokens


@dataclass
class Trained:
    adapter: Path | None  # None for trainer: none
    metrics: dict[str, float]


def one_step(ctx: RunContext, step: int) -> dict[str, Any]:
    """One step, as the list of its parts; returns its record."""
    t = Timings(on_phase=lambda name: enter_phase(ctx, step, name))
    recovery = EngineRecovery(ctx.run, ctx.engine, t, ctx.sampler,
                              on_start=lambda: ctx.canary.engine_started(ctx.engine))
    t0 = time.perf_counter()
    ctx.sampler.take()  # memory of this step only
    ctx.gc_pauses.take()  # and its collections
    rollout = generate(ctx, step, t, recovery)
    scored = score(ctx, step, rollout, t)
    # a fresh engine must still sleep (colocate) before training: the transition is done again on it
    recovery.transition(lambda: ctx.placement.before_train(t), engine_adapter(ctx), redo=True)
    ahead = start_next_rollout(ctx, step, t)
    train_t0 = time.perf_counter()
    trained = train(ctx, step, scored, t)
    train_span = (train_t0, time.perf_counter())
    if ctx.ahead.pending is not None:
        with t.phase("await_rollout", ctx.sampler):
            ctx.ahead.settle()  # adapters change only between batches
    # started again, the engine already holds the new adapter: nothing to redo
    recovery.transition(lambda: ctx.placement.after_train(t, trained.adapter),
                        trained.adapter or engine_adapter(ctx), redo=False)
    if trained.adapter is not None:
        ctx.engine_adapter_step = step
    # an engine found dead by the checks is started again with the new adapter and checked again
    checks = recovery.on_live_engine(lambda: check(ctx, step, trained, t), trained.adapter or engine_adapter(ctx))
    save_state(ctx, t)
    t.s["step"] = time.perf_counter() - t0
    record = make_record(ctx, step, t, rollout, scored, trained, checks, recovery.restarts)
    record.update(concurrency(t, t0, rollout, ahead, train_span))
    record.update(evaluate(ctx, step, trained.adapter or engine_adapter(ctx)))
    return record


def engine_adapter(ctx: RunContext) -> Path | None:
    """The adapter the engine holds, for starting it again: the step's of ctx.engine_adapter_step."""
    drawn = ctx.run.lora.init_b_std > 0  # step 0's adapter is the drawn one (initial_adapter)
    return ctx.paths.adapter(ctx.engine_adapter_step) if ctx.engine_adapter_step or drawn else None


def freeze_heap() -> None:
    """gc_freeze: what set-up left alive moves to the permanent generation, which later collections skip; its
    garbage is collected first, or it would be kept for good."""
    gc.collect()
    gc.freeze()


def enter_phase(ctx: RunContext, step: int, name: str) -> None:
    """A phase starts: phase.json says so, and the controller's collections are counted in it."""
    ctx.phase.enter(step, name)
    ctx.gc_pauses.set_phase(name)


def start_next_rollout(ctx: RunContext, step: int, t: Timings) -> InFlight | None:
    """overlap: the next step's rollout starts now, against the adapter the engine holds, while the trainer trains."""
    if not ctx.run.overlap or step >= ctx.run.steps:
        return None
    with t.phase("prepare", ctx.sampler):  # starting the thread (and telling phase.json) is part of it
        requests, answers = step_requests(ctx.problems, ctx.run, step + 1, ctx.tokenizer, ctx.engine_adapter_step,
                                          ctx.replicate)
        return ctx.ahead.start(ctx.engine, step + 1, requests, answers, ctx.engine_adapter_step)


def concurrency(t: Timings, t0: float, rollout: Rollout, ahead: InFlight | None,
                train_span: tuple[float, float]) -> dict[str, float]:
    """How much of the step the engine and the trainer worked at once, and how long each sat idle."""
    step_s, end = t.s["step"], t0 + t.s["step"]
    ahead_span = (ahead.started, min(ahead.ended or end, end)) if ahead else None
    engine_busy = t.s.get("gen", 0.0) + (ahead_span[1] - ahead_span[0] if ahead_span else 0.0)
    trainer_busy = sum(t.s.get(p, 0.0) for p in ("release_onload", "trainer_onload", "update_actor", "save_adapter",
                                                  "trainer_offload"))
    return {"timing_s/overlap": overlap_s(train_span, ahead_span),
            "timing_s/engine_idle": max(0.0, step_s - engine_busy),
            "timing_s/trainer_idle": max(0.0, step_s - trainer_busy),
            "rollout/adapter_step": float(rollout.adapter_step),
            "rollout/staleness": float(rollout.staleness)}


def generate(ctx: RunContext, step: int, t: Timings, recovery: EngineRecovery) -> Rollout:
    """rollout: the step's requests (prepare), generated by the engine (gen; restarted and retried if it dies), or
    the rollout that ran ahead during the last step's training (overlap: gen is then the wait for its end)."""
    with t.phase("prepare", ctx.sampler):
        # the trainer is idle (offloaded in colocate) while the engine runs: read it then, off the step's path
        trainer_gb = in_background(trainer_gpu_gb, ctx.trainer)
    flight = ctx.ahead.take(step)
    if flight is not None:
        try:
            with t.phase("gen", ctx.sampler):
                completions = flight.result()
            if all(c.error for c in completions):
                raise EngineError(f"every request failed, e.g. {completions[0].error}")
            return replace(_rolled_out(step, flight.requests, flight.answers, completions, flight.adapter_step,
                                       flight.gen_s, trainer_gb.result(), ctx.trainer is not None), ran_ahead=True)
        except EngineError as exc:  # it failed while running ahead: roll out again now, on a live engine
            if not ctx.engine.alive():
                recovery.restart(engine_adapter(ctx), exc)
    with t.phase("prepare", ctx.sampler):
        requests, answers = step_requests(ctx.problems, ctx.run, step, ctx.tokenizer, ctx.engine_adapter_step,
                                          ctx.replicate)
    waited = t.s.get("gen", 0.0)
    completions = recovery.generate(requests, engine_adapter(ctx))
    return _rolled_out(step, requests, answers, completions, ctx.engine_adapter_step, t.s["gen"] - waited,
                       trainer_gb.result(), ctx.trainer is not None)


def _rolled_out(step: int, requests: list[Request], answers: list[str], completions: list[Completion],
                adapter_step: int, gen_s: float, trainer_gb: float | None, trains: bool) -> Rollout:
    failed = [(i, c.error) for i, c in enumerate(completions) if c.error]
    if failed:  # the step goes on without them; the cause goes to the log and requests/step-NNNN.jsonl
        console.print(f"[yellow]step {step}: {len(failed)} of {len(completions)} requests failed; "
                      f"first (request {failed[0][0]}): {failed[0][1]}")
    # step N's trainer holds step N-1's adapter: a rollout from an older one is that many steps stale; without a
    # trainer (trainer: none) the engine keeps the base model, and nothing is stale
    staleness = step - 1 - adapter_step if trains else 0
    return Rollout(requests, answers, completions, adapter_step, staleness, gen_s, trainer_gb)


def score(ctx: RunContext, step: int, rollout: Rollout, t: Timings) -> Scored:
    """reward: GSM8K rewards, group-normalised advantages, the samples to train on, and the audit file."""
    with t.phase("reward", ctx.sampler):
        texts = gsm8k.completion_texts(ctx.tokenizer, [c.token_ids for c in rollout.completions])
        ok = [c.error is None for c in rollout.completions]
        pairs = list(zip(texts, rollout.answers, ok, strict=True))
        both = [gsm8k.scores(x, a, ctx.run.format_reward) if good else (0.0, 0.0) for x, a, good in pairs]
        correct, rewards = [c for c, _ in both], [r for _, r in both]
        advantages = group_advantages(rewards, ctx.run.group_size)
        samples = [Sample(r.prompt_ids, c.token_ids, c.logprobs, a)
                   for r, c, a in zip(rollout.requests, rollout.completions, advantages, strict=True)
                   if c.error is None and c.token_ids]
        _write_requests(ctx.paths.requests(step), rollout, rewards)
    return Scored(rewards, correct, samples)


def train(ctx: RunContext, step: int, scored: Scored, t: Timings) -> Trained:
    """train: one GRPO step and its adapter on disk (trainer: none holds a memory ballast instead)."""
    if ctx.trainer is None:
        with t.phase("update_actor", ctx.sampler):
            _hold_ballast(ctx.run)
        return Trained(None, {})
    with t.phase("update_actor", ctx.sampler):
        result = ctx.trainer.step(step, scored.samples, ctx.paths.adapter(step))
    metrics = dict(result.metrics)
    save_s = metrics.pop("timing_s/save_adapter", None)  # timed inside the trainer's step: its own phase
    if save_s is not None:
        t.move(save_s, "update_actor", "save_adapter")
    return Trained(result.adapter_dir, metrics)


def check(ctx: RunContext, step: int, trained: Trained, t: Timings) -> dict[str, Any]:
    """checks: the canary after the transition; a changed base model stops the run. An adapter the engine did not
    apply stops it too, once its step is recorded (stop_if_adapter_dropped)."""
    # a zero adapter (e.g. all advantages zero so far) cannot change anything: not judged, and the record says why
    not_judged = adapter_not_judged(trained.adapter, trained.metrics.get("train/lora_norm"))
    with t.phase("check", ctx.sampler):
        checks = ctx.canary.check(ctx.engine, not_judged)
    if checks["check/base_canary_ok"] is False:
        raise RunFailed(f"{ctx.run_id} step {step}: the base model's greedy canary changed after the transition: "
                        "base weights were corrupted (e.g. SGLang released weights without a CPU backup)")
    return checks


def stop_if_adapter_dropped(run_id: str, step: int, engine: str, record: dict[str, Any]) -> None:
    """The adapter gate, after the step is recorded (its record is the evidence): False means the engine answered
    the canary through a non-identity adapter exactly as the base model."""
    if record["check/adapter_applied"] is False:
        raise AdapterNotApplied(
            f"{run_id} step {step}: {engine} did not apply the adapter: the greedy canary through it matched the base "
            f"model's tokens and logprobs (largest shift {record['check/adapter_logprob_shift']:.1e}), although "
            f"training moved it (train/lora_norm {_norm_text(record.get('train/lora_norm'))}); this step's record and "
            "the ones before are kept in steps.jsonl")


def _norm_text(norm: float | None) -> str:
    return "not reported" if norm is None else f"{norm:.3g}"


def save_state(ctx: RunContext, t: Timings) -> None:
    """save_state: the wait for the optimizer state the trainer writes on a thread while the engine takes the new
    adapter; a step is recorded only once it can be resumed."""
    if ctx.trainer is not None:
        with t.phase("save_state", ctx.sampler):
            ctx.trainer.flush()


def eval_due(run: RunConfig, step: int) -> bool:
    """Every eval_every-th step and the last one (so a run always ends measured); never with eval_every 0."""
    return run.eval_every > 0 and (step % run.eval_every == 0 or step == run.steps)


def evaluate(ctx: RunContext, step: int, adapter: Path | None) -> dict[str, Any]:
    """eval: greedy answers to the fixed test slice through the engine, with the adapter it holds after this step's
    transition. Timed apart from the step (timing_s/eval); an engine that fails here leaves the values null and is
    found dead, and restarted, by the next step's rollout."""
    if not eval_due(ctx.run, step) or not ctx.test_problems:
        return {}
    greedy = Sampling(temperature=0.0, max_new_tokens=ctx.run.eval_max_new_tokens or ctx.run.max_new_tokens,
                      ignore_eos=False, seed=0)
    name = ADAPTER_NAME if adapter is not None else None
    requests = [Request(ctx.tokenizer(gsm8k.prompt_text(p["question"]))["input_ids"], greedy, adapter=name)
                for p in ctx.test_problems]
    t0 = time.perf_counter()
    try:
        completions = ctx.engine.generate(requests, progress=False)
    except EngineError as exc:
        console.print(f"[yellow]step {step}: eval failed ({str(exc).splitlines()[0]}); eval/accuracy is null")
        return {"timing_s/eval": time.perf_counter() - t0}
    ok = [(c, p) for c, p in zip(completions, ctx.test_problems, strict=True) if c.error is None]
    right = sum(gsm8k.reward(ctx.tokenizer.decode(c.token_ids, skip_special_tokens=True), p["answer"])
                for c, p in ok)
    return {"eval/accuracy": right / len(requests), "eval/problems": len(requests),
            "eval/response_length_mean": sum(len(c.token_ids) for c, _ in ok) / len(ok) if ok else None,
            "eval/stop_ratio": finish_share([c for c, _ in ok], "stop"),
            "timing_s/eval": time.perf_counter() - t0}


def finish_share(completions: list[Completion], reason: str) -> float | None:
    """Share of the completions whose finish reason is `reason` ("stop": EOS or a stop token; "length")."""
    if not completions:
        return None
    return sum(c.finish_reason == reason for c in completions) / len(completions)


def make_record(ctx: RunContext, step: int, t: Timings, rollout: Rollout, scored: Scored, trained: Trained,
                checks: dict[str, Any], restarts: int) -> dict[str, Any]:
    """record: every key of hybridrl.run.record (None where this step has no value), plus per-GPU readings."""
    run = ctx.run
    record = new_record()
    record.update({"run_id": ctx.run_id, "engine": run.engine, "placement": run.placement, "trainer": run.trainer,
                   "model": run.model, "tp": run.tp, "seed": run.seed, "step": step, "time_unix": time.time()})
    record.update(t.record())
    record.update(rollout_stats(rollout.completions, rollout.gen_s))
    done = [c for c in rollout.completions if c.error is None]
    record["response_length/clip_ratio"] = finish_share(done, "length")
    record["response/stop_ratio"] = finish_share(done, "stop")
    record.update({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in trained.metrics.items()})
    if record["perf/train_tokens"] and t.s.get("update_actor"):
        record["perf/update_actor_tok_s"] = record["perf/train_tokens"] / t.s["update_actor"]
    record["reward/mean"] = sum(scored.rewards) / len(scored.rewards)
    record["reward/accuracy"] = sum(scored.correct) / len(scored.correct)
    record["errors/engine_restarts"] = restarts
    record["mem/trainer_gb_gen"] = rollout.trainer_gb
    mem = ctx.sampler.take()
    record.update(ctx.gc_pauses.take())
    if mem:
        mem["mem/used_gb_train"] = mem.get("mem/used_gb_update_actor")
    record.update(mem)
    record.update(checks)
    record.update(ctx.engine.step_metrics())  # engine-side readings, e.g. NVML after sleep/wake
    record.update(ctx.placement.step_metrics())  # the engine's own memory asleep, the trainer's left out
    restarts_now = ctx.engine.start_parts[ctx.starts_recorded:]
    ctx.starts_recorded += len(restarts_now)
    record.update(start_keys("timing_s/engine_restart", restarts_now, with_total=True))
    if rollout.ran_ahead:
        record.update(dict.fromkeys(ROLLOUT_READINGS))
    return record


def start_keys(prefix: str, starts: list[dict[str, float | None]], with_total: bool = False) -> dict[str, Any]:
    """The record's keys for engine starts' parts (record.ENGINE_START_SPLIT, ENGINE_RESTART), summed over
    `starts`, and with_total their whole time under `prefix`; none where there were no starts."""
    if not starts:
        return {}
    parts = combine(starts)
    return {**{f"{prefix}_{p}": parts[p] for p in START_PARTS}, **({prefix: parts[TOTAL]} if with_total else {})}


class EngineRecovery:
    """One step's engine restarts: an engine found dead is started again with the newest adapter, at most
    run.retries times a step; each counts in errors/engine_restarts and its time in timing_s/recover."""

    def __init__(self, run: RunConfig, engine: Engine, t: Timings, sampler: MemorySampler,
                 on_start: Callable[[], None] | None = None) -> None:
        self.run, self.engine, self.t, self.sampler = run, engine, t, sampler
        self.on_start = on_start  # told after each restart, the engine up again
        self.restarts = 0

    def restart(self, adapter: Path | None, exc: EngineError) -> None:
        if self.restarts >= self.run.retries:
            raise RunFailed(f"{self.engine.name} failed {self.restarts + 1} times in one step; giving up: {exc}") \
                from exc
        self.restarts += 1
        console.print(f"[yellow]{self.engine.name} failed ({str(exc).splitlines()[0]}); "
                      f"restart {self.restarts}/{self.run.retries}")
        with self.t.phase("recover", self.sampler):
            self.engine.stop()
            self.engine.start((ADAPTER_NAME, adapter) if adapter else None)
            if self.on_start is not None:
                self.on_start()

    def generate(self, requests: list[Request], adapter: Path | None) -> list[Completion]:
        """The rollout (timing_s/gen); a dead or broken engine is restarted and the rollout retried. So is one that
        died part way (some requests answered, the rest failed on its dropped connections); failed requests of a
        live engine stay in the step (errors/requests_failed)."""
        while True:
            try:
                with self.t.phase("gen", self.sampler):
                    if not self.engine.alive():
                        raise EngineError(f"{self.engine.name} is not running")
                    completions = self.engine.generate(requests, progress=True)
                    if all(c.error for c in completions):
                        raise EngineError(f"every request failed, e.g. {completions[0].error}")
                failed = [c.error for c in completions if c.error]
                if failed:
                    with self.t.phase("recover", self.sampler):  # died() waits for a process just killed
                        dead = self.died()
                    if dead:
                        raise EngineError(f"{self.engine.name} died during the rollout: {len(failed)} of "
                                          f"{len(completions)} requests failed, e.g. {failed[0]}")
                return completions
            except EngineError as exc:
                self.restart(adapter, exc)

    def on_live_engine(self, fn: Callable[[], Any], adapter: Path | None) -> Any:
        """fn's result on a live engine: one found dead is started again with `adapter` and fn done again on it; a
        live engine that answers wrongly is a real error and is raised."""
        while True:
            try:
                return fn()
            except EngineError as exc:
                if not self.died():
                    raise
                self.restart(adapter, exc)

    def died(self, grace_s: float = 2.0) -> bool:
        """Whether the engine is dead, giving a process just killed time to be reaped: its connection can drop
        (connection reset) a moment before its process reads as gone."""
        deadline = time.perf_counter() + grace_s
        while self.engine.alive():
            if time.perf_counter() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def transition(self, change: Callable[[], None], adapter: Path | None, redo: bool) -> None:
        """A placement transition (sleep, wake, adapter load). An engine found dead there is started again with
        `adapter` (`redo`: and the transition done again on it); a live engine that answers wrongly is a real
        error and is raised."""
        while True:
            try:
                change()
                return
            except EngineError as exc:
                if not self.died():
                    raise
                self.restart(adapter, exc)
                if not redo:
                    return


def trainer_gpu_gb(trainer: Trainer | None) -> float | None:
    """GPU memory (GB, NVML) charged to the trainer's processes: in colocate, what it leaves beside the engine."""
    return None if trainer is None else processes_used_gb(trainer.gpu_pids())


def in_background(fn: Callable[..., Any], *args: Any) -> Future:
    """fn(*args) on a thread of its own, for a reading the step need not wait for; its error, if any, is raised
    where its result is taken."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridrl-reading")
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)


def _write_requests(path: Path, rollout: Rollout, rewards: list[float]) -> None:
    """Per-request audit trail: which adapter (name, and the step that trained it) each request ran with, its
    timings, tokens and reward."""
    requests, completions = rollout.requests, rollout.completions
    rows = [{"i": i, "adapter": r.adapter, "adapter_step": rollout.adapter_step, "seed": r.sampling.seed,
             "prompt_tokens": len(r.prompt_ids),
             "streamed": r.stream, "events": c.events, "tokens": len(c.token_ids), "ttft_s": c.ttft_s,
             "latency_s": c.latency_s,
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
            f"EOS {f('response/stop_ratio', '.0%')}, eval accuracy {f('eval/accuracy')}, "
            f"|dlogp| {f('check/rollout_logprob_abs_diff', '.2e')}, gates: canary {r.get('check/base_canary_ok')}, "
            f"adapter {_adapter_text(r)}, kv {r.get('check/kv_capacity_ok')} "
            f"({f('mem/kv_capacity_tokens', '.0f')} tokens), logprobs {r.get('check/logprob_agreement_ok')}")


def _adapter_text(r: dict[str, Any]) -> str:
    why = r.get("check/adapter_not_judged")
    return f"not judged ({why})" if why else str(r.get("check/adapter_applied"))
