"""Standalone rollout benchmark: one engine alone on the exact request set of step N of a run.

Same prompts, seeds, sampling and max tokens as the run's step N (they depend only on the run config and
the step), the same engine flags, and the adapter the run used at that step. Nothing else runs beside the
engine: no trainer, no sleep/wake, no checks. Each repeat measures the paths of PATHS in turn: `raw`, which
bypasses the rollout client (`Engine.generate_raw`); `client`, the run's own rollout client with its share of
streamed requests; `whole`, the same client with nothing streamed (so `client` against `whole` is the price of
the streamed share, `whole` against `raw` the client's own); `stream_all`, the client streaming every request;
and `old_client`, every request streamed through one shared pool (the older results' path). The in-loop
rollout of a run should reach at least 95% of the raw throughput.

    python -m hybridrl bench --run-config results/runs/R/config.json --model M --data D \\
        --run-dir results/runs/R --step 3 --repeats 3 --out bench.json
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from hybridrl.atomic import write_text
from hybridrl.engines import make_engine
from hybridrl.engines.base import ROLLOUT_PATHS, Engine, EngineError, Request, Sampling
from hybridrl.nvml import used_gb
from hybridrl.run.cores import engine_env_spec, job_cores, split_cores
from hybridrl.run.loop import step_requests
from hybridrl.run.placement import ADAPTER_NAME
from hybridrl.run.telemetry import read_records, rollout_stats
from hybridrl.study.config import read_run_spec, with_overrides
from hybridrl.study.run_config import RunSpec, split_replicate
from hybridrl.task import data as gsm8k


def in_loop_throughput(run_dir: Path, step: int) -> float | None:
    for rec in read_records(run_dir / "steps.jsonl"):
        if rec.get("step") == step:
            return rec.get("perf/throughput")
    return None


def _greedy(engine: Engine, prompt: list[int], adapter: str | None = None) -> list[int]:
    out = engine.generate([Request(prompt, Sampling(temperature=0.0, max_new_tokens=16, ignore_eos=True),
                                   adapter)])[0]
    if out.error:
        raise EngineError(f"greedy probe failed: {out.error}")
    return out.token_ids


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def probe_engine(engine: Engine, prompt: list[int], adapter: Path | None) -> dict[str, Any]:
    """What the engine shows of itself (probe_info: e.g. its raw stream events), each way it can sleep timed
    with NVML readings and a greedy before/after comparison, and adapter (re)load times."""
    gpus = engine.gpus()
    req = Request(prompt, Sampling(temperature=0.0, max_new_tokens=4, ignore_eos=True), stream=True)
    out: dict[str, Any] = engine.probe_info(req)
    before = _greedy(engine, prompt)
    cycles = []
    for variant in engine.sleep_variants():
        awake = used_gb(gpus)
        t_sleep = _timed(variant.sleep)
        asleep = used_gb(gpus)
        t_wake = _timed(variant.wake)
        cycles.append({**variant.label, "sleep_s": t_sleep, "wake_s": t_wake, "awake_gb": awake, "asleep_gb": asleep,
                       "woken_gb": used_gb(gpus), "greedy_same": _greedy(engine, prompt) == before})
    out["cycles"] = cycles
    out["kv_capacity_tokens"] = engine.kv_capacity_tokens()
    if adapter is not None:
        loads = [_timed(lambda: engine.load_adapter(ADAPTER_NAME, adapter)) for _ in range(3)]
        out["adapter_load_s"] = loads
        out["adapter_changes_greedy_or_logprobs"] = _greedy(engine, prompt, ADAPTER_NAME) != before or None
    return out


# the paths a rollout can take, measured interleaved on one engine start so that a drift hits them alike:
# raw (no rollout client), the run's own client and mix of streamed requests, the same client streaming every
# request, and the earlier client the older committed results went through (one shared connection pool, every
# request streamed; server engines only)
PATHS = ROLLOUT_PATHS


def _one_pass(engine: Engine, requests: list[Request], path: str) -> tuple[list[Any], float]:
    engine.flush_cache()  # as in the loop after an adapter load: no prefix hits from the last pass
    streamed = [dataclasses.replace(r, stream=True) for r in requests]
    whole = [dataclasses.replace(r, stream=False) for r in requests]
    t0 = time.perf_counter()
    if path == "raw":
        completions = engine.generate_raw(requests)
    elif path == "old_client":
        completions = engine.generate(streamed, shared_pool=True)
    else:
        completions = engine.generate({"stream_all": streamed, "whole": whole}.get(path, requests))
    return completions, time.perf_counter() - t0


def run_bench(spec: RunSpec, model_dir: Path, data_dir: Path, run_dir: Path, step: int,
              repeats: int, log_dir: Path, probe: bool = False, paths: tuple[str, ...] = PATHS) -> dict[str, Any]:
    from transformers import AutoTokenizer

    run = spec.run
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = gsm8k.read_jsonl(data_dir / "train.jsonl")
    requests, _ = step_requests(problems, run, step, tokenizer, replicate=split_replicate(spec.run_id)[1])
    adapter = None
    if step > 1:  # step N's requests use the adapter trained at step N-1
        adapter = run_dir / "adapters" / f"step-{step - 1:04d}"
        if not adapter.exists():
            raise FileNotFoundError(f"adapter {adapter} (written by step {step - 1} of the run)")
    # the engine on the cores it had in its run, so that its raw throughput and the run's in-loop one compare
    cores = split_cores(run, job_cores())
    engine = make_engine(run, model_dir, engine_env_spec(run, spec.engine_env, cores), log_dir)
    if not engine.has_http_client:  # in-process vLLM has no HTTP client, old or new
        paths = tuple(p for p in paths if p != "old_client")
    reps: list[dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        engine.start((ADAPTER_NAME, adapter) if adapter else None)
        start_s = time.perf_counter() - t0
        for i in range(repeats):
            for k in range(len(paths)):  # the order rotates each repeat: no path always runs first
                path = paths[(i + k) % len(paths)]
                cpu0 = time.process_time()
                completions, gen_s = _one_pass(engine, requests, path)
                stats = rollout_stats(completions, gen_s)
                cpu = 100.0 * (time.process_time() - cpu0) / gen_s
                reps.append({"repeat": i, "path": path, "gen_s": gen_s, "controller_cpu_pct": cpu, **stats})
                print(f"repeat {i} {path}: {stats['perf/throughput']:.1f} tok/s, {stats['perf/gen_tokens']:.0f} "
                      f"tokens, {stats['errors/requests_failed']:.0f} failed, controller CPU {cpu:.0f}%", flush=True)
        probed = None
        if probe:
            try:
                probed = probe_engine(engine, requests[0].prompt_ids, adapter)
            except Exception as exc:  # the throughput above stands; say what the probe hit
                probed = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(probed, default=str)[:4000], flush=True)
    finally:
        engine.stop()
    medians = {p: _median([r["perf/throughput"] for r in reps if r["path"] == p]) for p in paths}
    in_loop = in_loop_throughput(run_dir, step)
    raw = medians.get("raw")
    return {
        "run_id": spec.run_id, "engine": run.engine, "placement": run.placement, "step": step,
        "requests": len(requests), "streamed_requests": sum(r.stream for r in requests), "repeats": reps,
        "engine_start_s": start_s, "tok_s_median": medians, "raw_tok_s_median": raw,
        "over_raw": {p: (m / raw if m and raw else None) for p, m in medians.items()},
        "in_loop_tok_s": in_loop, "in_loop_over_raw": (in_loop / raw) if in_loop and raw else None,
        "goal": 0.95, "probe": probed, "cores": cores.record(),
    }


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v]
    return statistics.median(kept) if kept else None


def main(run_config: Path, model_dir: Path, data_dir: Path, run_dir: Path, step: int, repeats: int,
         out: Path, probe: bool = False, overrides: dict[str, Any] | None = None,
         paths: tuple[str, ...] = PATHS) -> dict[str, Any]:
    spec = read_run_spec(Path(run_config))
    if overrides:  # e.g. sglang_release=all: start with the CPU weight backup to probe it
        spec = spec.model_copy(update={"run": with_overrides(spec.run, overrides, "bench --set")})
    result = run_bench(spec, Path(model_dir), Path(data_dir), Path(run_dir), step, repeats,
                       Path(out).parent / f"bench-logs-{spec.run_id}", probe, paths)
    result["overrides"] = overrides or {}
    write_text(Path(out), json.dumps(result, indent=2))
    ratio = result["in_loop_over_raw"]
    print(json.dumps({k: result[k] for k in ("run_id", "engine", "step", "tok_s_median", "over_raw",
                                              "in_loop_tok_s", "in_loop_over_raw")}))
    if ratio is not None and ratio < result["goal"]:
        print(f"in-loop throughput is {ratio:.1%} of the engine's raw throughput (goal >= {result['goal']:.0%})")
    return result
