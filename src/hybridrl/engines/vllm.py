"""vLLM as an OpenAI-compatible server in its own Python environment (CPU build or GPU)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from hybridrl.engines.base import Completion, EngineError, Request, Sampling
from hybridrl.engines.gpus import nvml_indices, process_used_gb, split_engine_devices, used_gb
from hybridrl.engines.server import ServerProcess, StreamingClient, free_port, post_json

BASE_NAME = "base"
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.M)


class _VLLMStream(StreamingClient):
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
            "stream": True,
        }
        if s.seed is not None:
            body["seed"] = s.seed
        return body

    def parse(self, chunk: dict[str, Any], seen: int = 0) -> tuple[list[int], list[float], str | None]:
        choice = chunk["choices"][0]
        lp = choice.get("logprobs") or {}
        ids = [int(t.rsplit(":", 1)[1]) for t in lp.get("tokens") or []]
        return ids, list(lp.get("token_logprobs") or []), choice.get("finish_reason")


class VLLMServer:
    """`vllm serve` with runtime LoRA updates; sleep mode when it runs on GPUs."""

    name = "vllm"

    def __init__(self, model: Path, run: dict[str, Any], env_spec: dict[str, Any], log_dir: Path) -> None:
        self.model, self.run, self.log_dir = model, run, log_dir
        self.python = resolve_python(env_spec.get("python", "python"))
        self.extra_env = dict(env_spec.get("env", {}))
        self.supports_sleep = run["device"] == "cuda"
        self.server: ServerProcess | None = None
        self.stream: _VLLMStream | None = None
        self._loaded: set[str] = set()
        self._metrics: dict[str, float | None] = {}

    # -- process ---------------------------------------------------------------------------------
    def command(self, port: int, adapter: tuple[str, Path] | None) -> list[str]:
        run, lora = self.run, self.run["lora"]
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", BASE_NAME,
            "--host", "127.0.0.1", "--port", str(port),
            "--seed", str(run["seed"]), "--dtype", self._dtype(),
            "--max-model-len", str(self._max_len()),
            "--enable-lora", "--max-lora-rank", str(_lora_rank_bucket(lora["rank"])), "--max-loras", "1",
            # only the trained projections: vLLM 0.26 otherwise also wraps the (tied) embedding, and its
            # warm-up dummy adapter for that layer fails when vocab_size != hidden_size
            "--lora-target-modules", *lora["target_modules"],
            "--max-num-seqs", str(run["max_concurrency"]),
        ]
        if run["device"] == "cuda":
            cmd += ["--tensor-parallel-size", str(run["tp"]),
                    "--gpu-memory-utilization", str(run["gpu_memory_utilization"]),
                    "--enable-sleep-mode"]
        if adapter:
            cmd += ["--lora-modules", f"{adapter[0]}={adapter[1]}"]
        return cmd + list(run["engine_args"])

    def _config(self) -> dict[str, Any]:
        return json.loads((self.model / "config.json").read_text())

    def _max_len(self) -> int:
        return min(int(self._config().get("max_position_embeddings", 4096)), 4096)

    def _dtype(self) -> str:
        """The checkpoint's own dtype: the CPU build would otherwise pick bfloat16 for a float32 model."""
        cfg = self._config()
        return str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto")

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the engine has its own environment; the controller's must not leak in
        env.update({
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # /sleep, /wake_up, /is_sleeping
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
        })
        if self.run["device"] == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a large slice of RAM
        env.update(split_engine_devices(self.run, env))  # split: the engine takes the last GPUs
        env.update(self.extra_env)
        return env

    def start(self, adapter: tuple[str, Path] | None = None) -> float:
        port = free_port()
        self.server = ServerProcess(self.name, self.command(port, adapter), self.environment(),
                                    self.log_dir / "engine.log", port)
        self.server.start()
        elapsed = self.server.wait_healthy(self.run["startup_timeout_s"])
        self.stream = _VLLMStream(self.server, self.run["request_timeout_s"], self.run["max_concurrency"])
        # the first request pays one-off kernel compilation; count it as start-up, not as rollout
        t0 = time.perf_counter()
        warm = self.stream.generate([Request([1, 2, 3], Sampling(max_new_tokens=2, temperature=0.0))])[0]
        if warm.error:
            self.stop()
            raise EngineError(f"vllm: warm-up request failed: {warm.error}")
        elapsed += time.perf_counter() - t0
        self._loaded = {adapter[0]} if adapter else set()
        return elapsed

    def stop(self) -> None:
        if self.server:
            self.server.stop()
        self.server = None

    def alive(self) -> bool:
        return bool(self.server and self.server.alive())

    # -- rollouts and adapters -------------------------------------------------------------------
    def generate(self, requests: list[Request], progress: bool = False) -> list[Completion]:
        if not self.stream:
            raise EngineError("vllm: generate() before start()")
        return self.stream.generate(requests, progress)

    def load_adapter(self, name: str, path: Path) -> None:
        # A reused name is unloaded and loaded again rather than sent with load_inplace: vLLM 0.26 keeps
        # load_inplace=True on the request it stores for that name, so every later rollout request
        # reloads the adapter from disk. On the H200 reference run that cut rollout throughput from
        # ~9.6k to ~2.5k tok/s from the first in-place reload on (results/reference/2026-11-22-h200).
        if name in self._loaded:
            post_json(self._url(), "/v1/unload_lora_adapter", {"lora_name": name})
            self._loaded.discard(name)
        post_json(self._url(), "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        self._loaded.add(name)

    # -- sleep mode (GPU) ------------------------------------------------------------------------
    def sleep(self) -> None:
        post_json(self._url(), f"/sleep?level={self.run['vllm_sleep_level']}")
        self._metrics["mem/engine_asleep_gb"] = used_gb(nvml_indices(self.environment()))

    def wake(self) -> None:
        if self.run["vllm_sleep_level"] == 2:
            # level 2 discarded the weights: wake them, reload the (unchanged) base from disk, then the cache
            post_json(self._url(), "/wake_up?tags=weights")
            post_json(self._url(), "/collective_rpc", {"method": "reload_weights"})
            post_json(self._url(), "/wake_up?tags=kv_cache")
        else:
            post_json(self._url(), "/wake_up")
        self._metrics["mem/engine_awake_gb"] = used_gb(nvml_indices(self.environment()))
        # colocate wakes right after the trainer offloaded: what the controller still holds on the GPU
        self._metrics["mem/controller_gb"] = process_used_gb(indices=nvml_indices(self.environment()))

    def step_metrics(self) -> dict[str, float | None]:
        """NVML memory on the engine's GPUs right after the last sleep and wake; then forget them."""
        out, self._metrics = self._metrics, {}
        return out

    def flush_cache(self) -> None:
        post_json(self._url(), "/reset_prefix_cache")

    def kv_capacity_tokens(self) -> int | None:
        text = post_json(self._url(), "/metrics", method="GET", timeout_s=30).text
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
                "version": _version(self.python, "vllm", self.environment())}

    def _url(self) -> str:
        if not self.server:
            raise EngineError("vllm: not started")
        return self.server.base_url


def resolve_python(python: str) -> str:
    """A relative interpreter path in a config means the repository's (e.g. .venvs/vllm-cpu/bin/python)."""
    from hybridrl.config import REPO

    path = Path(python)
    if "/" in python and not path.is_absolute():
        return str(REPO / path)
    return python


def _lora_rank_bucket(rank: int) -> int:
    """vLLM accepts only some --max-lora-rank values; take the smallest that fits."""
    for bucket in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= bucket:
            return bucket
    raise EngineError(f"vllm: LoRA rank {rank} is larger than vLLM supports (512)")


def _version(python: str, package: str, env: dict[str, str] | None = None) -> str | None:
    import subprocess

    # the CPU build is distributed as vllm-cpu
    code = ("import importlib.metadata as m, sys\n"
            "for p in sys.argv[1:]:\n"
            "    try:\n        print(m.version(p)); break\n"
            "    except m.PackageNotFoundError:\n        pass")
    try:
        out = subprocess.run([python, "-c", code, package, f"{package}-cpu"],
                             capture_output=True, text=True, timeout=60, env=env)  # the engine's overlay
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None

