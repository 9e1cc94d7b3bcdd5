"""SGLang (`sglang.launch_server`) in its own Python environment, GPU only.

Sleep is `/release_memory_occupation` with explicit tags (torch_memory_saver, `--enable-memory-saver`):
- `sglang_release: kv_cache` frees the KV cache and the CUDA graphs' memory and keeps the weights
  resident: LoRA training never changes the base, so nothing has to come back but the cache;
- `sglang_release: all` frees the weights too. Released weights come back as garbage unless the
  server keeps a CPU copy, so this policy always starts it with `--enable-weights-cpu-backup`. That copy is
  pinned host memory; torch_memory_saver frees it on every wake and pins 57 GiB of it anew on every sleep
  (24 s a sleep at the 48-layer MoE shape on an H200), unless `sglang_retain_cpu_backup` keeps it, as vLLM's
  level-1 sleep keeps its pinned buffers in torch's host cache (1.2 s a sleep on the same machine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridrl.engines.base import EngineError, Request, Sampling, SleepStages, SleepVariant, stamp_timing
from hybridrl.engines.gpus import asleep_readings, awake_readings, split_engine_devices
from hybridrl.engines.server import HTTPEngine, RolloutClient, engine_environ, max_model_len, model_dtype
from hybridrl.study.run_config import RunConfig

BASE_NAME = "base"
# torch_memory_saver tags as SGLang names them (sglang.srt.constants.GPU_MEMORY_TYPE_*)
RELEASE_TAGS = {
    "kv_cache": ["kv_cache", "cuda_graph"],
    "all": ["kv_cache", "weights", "cuda_graph"],
}


def release_tags(policy: str) -> list[str]:
    """Never an empty list: an empty or missing `tags` makes SGLang release everything."""
    try:
        return list(RELEASE_TAGS[policy])
    except KeyError:
        raise EngineError(f"sglang: unknown sglang_release {policy!r} (kv_cache or all)") from None


def generate_body(req: Request) -> dict[str, Any]:
    """Native /generate body: token ids in, token ids and the sampled tokens' logprobs out (streamed or not)."""
    s: Sampling = req.sampling
    params: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "ignore_eos": s.ignore_eos,
    }
    if s.seed is not None:
        # honoured only with --enable-deterministic-inference; recorded for the request set either way
        params["sampling_seed"] = s.seed
    body: dict[str, Any] = {
        "input_ids": req.prompt_ids,
        "sampling_params": params,
        "stream": req.stream,
        "return_logprob": True,
        "logprob_start_len": -1,  # output tokens only; no prompt logprobs
    }
    if req.adapter:
        body["lora_path"] = req.adapter  # the name given to /load_lora_adapter
    return body


def parse_chunk(chunk: dict[str, Any], seen: int) -> tuple[list[int], list[float], str | None]:
    """-> (new token ids, their logprobs, finish reason) from one streamed /generate event.

    With --incremental-streaming-output each event carries only the new tokens; without it, every
    event repeats the whole output so far. meta_info.completion_tokens (the running total) tells
    which: an event as long as the total is cumulative, so the first `seen` entries are old.
    """
    meta = chunk.get("meta_info") or {}
    ids = [int(t) for t in chunk.get("output_ids") or []]
    lps_raw = meta.get("output_token_logprobs") or []
    total = meta.get("completion_tokens")
    if total is not None and len(ids) == int(total):
        ids = ids[seen:]
    if total is not None and len(lps_raw) == int(total):
        lps_raw = lps_raw[seen:]
    # each entry is (logprob, token_id, token_text or None)
    lps = [float(e[0]) if isinstance(e, (list, tuple)) else float(e) for e in lps_raw]
    finish = meta.get("finish_reason")
    if isinstance(finish, dict):
        if finish.get("type") == "abort":
            raise EngineError(f"sglang aborted the request: {finish.get('message', finish)}")
        finish = finish.get("type")
    return ids, lps, finish


def answer_timing(answer: dict[str, Any]) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds from a finished /generate answer (whole, or a stream's last event) of a server
    started with --enable-metrics. From the request's arrival at the server (request_received_ts) to its first
    token, then per later token until it finished (request_finished_ts). The first token is the scheduler's end
    of prefill (prefill_finished_time) where the answer has it; SGLang 0.5.16 on the H200 sent none, so
    otherwise the API server's own first-token stamp, which its
    decode_throughput gives: (tokens - 1) / (finished - first token). Wall-clock seconds; NaN where a field is
    missing."""
    meta = answer.get("meta_info") or {}
    tokens = int(meta.get("completion_tokens") or 0)
    first = meta.get("prefill_finished_time")
    if not first and meta.get("request_finished_ts"):
        rate = float(meta.get("decode_throughput") or 0.0)
        if rate > 0 and tokens > 1:
            first = float(meta["request_finished_ts"]) - (tokens - 1) / rate
        elif tokens == 1:  # one token: it came at the end
            first = meta["request_finished_ts"]
    return stamp_timing(meta.get("request_received_ts"), first, meta.get("request_finished_ts"), tokens)


class _SGLangClient(RolloutClient):
    url_path = "/generate"

    def body(self, req: Request) -> dict[str, Any]:
        return generate_body(req)

    def parse(self, chunk: dict[str, Any], seen: int = 0) -> tuple[list[int], list[float], str | None]:
        return parse_chunk(chunk, seen)

    def timing(self, answer: dict[str, Any]) -> tuple[float, float]:
        return answer_timing(answer)


class SGLangServer(HTTPEngine):
    """`python -m sglang.launch_server` with the memory saver and runtime LoRA loading."""

    name = "sglang"
    packages = ("sglang",)
    stream_cls = _SGLangClient
    fatal_markers = ("Scheduler hit an exception",)
    # its torch.distributed rendezvous, at any TP: left to SGLang it is a random port near --port, which two
    # servers on one node can both draw
    own_ports = ("nccl",)

    def __init__(self, model: Path, run: RunConfig, env_spec: dict[str, Any], log_dir: Path) -> None:
        if run.device != "cuda":
            raise EngineError("sglang: no CPU build; use device: cuda")
        super().__init__(model, run, env_spec, log_dir)
        self.tags = release_tags(run.sglang_release)

    # -- process ---------------------------------------------------------------------------------
    def command(self, port: int, adapter: tuple[str, Path] | None) -> list[str]:
        run, lora = self.run, self.run.lora
        cmd = [
            self.python, "-m", "sglang.launch_server",
            "--model-path", str(self.model), "--served-model-name", BASE_NAME,
            "--host", "127.0.0.1", "--port", str(port),
            "--random-seed", str(run.seed), "--dtype", model_dtype(self.model),
            "--context-length", str(max_model_len(self.model)),
            "--tp-size", str(run.tp),
            "--mem-fraction-static", str(run.gpu_memory_utilization),
            "--max-running-requests", str(run.max_concurrency),
            "--enable-memory-saver",
            "--enable-lora", "--max-lora-rank", str(lora.rank),
            "--lora-target-modules", *lora.target_modules,
            "--max-loras-per-batch", "2",  # base + the policy adapter in one batch
            # each event carries only its new tokens (parse_chunk also reads cumulative events)
            "--incremental-streaming-output",
        ]
        if "nccl" in self.ports:  # taken at start(); a command line asked for before it has none to give
            cmd += ["--nccl-port", str(self.ports["nccl"])]
        if run.sglang_release == "all":
            cmd.append("--enable-weights-cpu-backup")
        if run.engine_timing:  # per-request timestamps in each answer's meta_info (answer_timing)
            cmd.append("--enable-metrics")
        if not run.sglang_detokenize:  # token ids in and out: the run never reads SGLang's text
            cmd.append("--skip-tokenizer-init")
        if adapter:
            cmd += ["--lora-paths", f"{adapter[0]}={adapter[1]}"]
        return cmd + list(run.engine_args)

    def environment(self) -> dict[str, str]:
        env = engine_environ()
        env.update({"HF_HUB_OFFLINE": "1", "SGLANG_DISABLE_REQUEST_LOGGING": "1"})
        if self.run.engine_timing:
            # a request answered whole reaches SGLang's API server every 50 tokens by default, so its first-token
            # stamp would be the 50th token's: every token, as a streamed request does (answer_timing)
            env["SGLANG_FORCE_STREAM_INTERVAL"] = "1"
        if self.run.sglang_release == "all":  # set either way: an inherited value must not decide it
            env["TMS_RETAIN_CPU_BACKUP"] = "1" if self.run.sglang_retain_cpu_backup else "0"
        if self.run.placement == "colocate" and self.run.keep_base_on_gpu and self.run.tp > 1:
            # the trainer's base stays on the first of the engine's GPUs, so their free memory differs by design;
            # SGLang refuses such a TP group at start unless told (it sizes every rank's KV cache from the least)
            env["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] = "0"
        env.update(split_engine_devices(self.run, env))
        env.update(self.extra_env)
        return env

    # -- adapters --------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: Path) -> None:
        # SGLang refuses a second adapter under a loaded name: unload it first
        r = self._swap_adapter(name, path, "/unload_lora_adapter", "/load_lora_adapter")
        answer = r.json() if r.content else {}
        if isinstance(answer, dict) and answer.get("success") is False:
            self._loaded.discard(name)
            raise EngineError(f"sglang: /load_lora_adapter {name}: {answer.get('error_message')}")

    # -- memory saver ----------------------------------------------------------------------------
    def sleep(self) -> None:
        self._release(self.tags)
        self._metrics.update(asleep_readings(self.gpus()))

    def wake(self) -> None:
        self._resume(self.tags)
        self._metrics.update(awake_readings(self.gpus()))

    def sleep_stages(self) -> SleepStages | None:
        """The KV cache and CUDA graphs' memory first (freed, nothing copied), then the weights (copied to their
        pinned CPU backup); None where the weights stay (sglang_release kv_cache)."""
        if "weights" not in self.tags:
            return None
        return SleepStages(release_cache=lambda: self._release([t for t in self.tags if t != "weights"]),
                           release_weights=lambda: self._release(["weights"]),
                           read_asleep=lambda: self._metrics.update(asleep_readings(self.gpus())))

    def _release(self, tags: list[str]) -> None:
        self._post("/release_memory_occupation", {"tags": tags})

    def _resume(self, tags: list[str]) -> None:
        self._post("/resume_memory_occupation", {"tags": tags})

    def sleep_variants(self) -> list[SleepVariant]:
        policies = [release_tags("kv_cache")]
        if self.server and "--enable-weights-cpu-backup" in self.server.cmd:  # weights go only with a CPU backup
            policies.append(release_tags("all"))
        return [SleepVariant({"tags": tags}, lambda tags=tags: self._release(tags),
                             lambda tags=tags: self._resume(tags)) for tags in policies]

    def probe_info(self, request: Request) -> dict[str, Any]:
        info = self.server_info()
        keys = ("version", "max_total_num_tokens", "enable_memory_saver", "enable_weights_cpu_backup",
                "max_lora_rank", "lora_backend")
        server = {k: info.get(k) for k in keys}
        server["internal_state_keys"] = sorted((info.get("internal_states") or [{}])[0].keys())
        return {**super().probe_info(request), "server_info": server}

    def flush_cache(self) -> None:
        self._post("/flush_cache")

    def server_info(self) -> dict[str, Any]:
        try:
            return self._post("/server_info", method="GET", timeout_s=30).json()
        except EngineError:  # older releases only have the deprecated name
            return self._post("/get_server_info", method="GET", timeout_s=30).json()

    def kv_capacity_tokens(self) -> int | None:
        return kv_capacity_from_info(self.server_info())

    def describe(self) -> dict[str, Any]:
        port = self.server.port if self.server else 0
        env = self.environment()
        return {"engine": self.name, "python": self.python, "command": self.command(port, None),
                "release_tags": self.tags,
                "env": {k: v for k, v in env.items() if k.startswith(("SGLANG_", "CUDA_", "TMS_", "PYTHONPATH"))},
                "version": self.installed_version()}


def kv_capacity_from_info(info: dict[str, Any]) -> int | None:
    """KV capacity in tokens: the scheduler's live memory_usage if reported, else max_total_num_tokens."""
    for state in info.get("internal_states") or []:
        usage = state.get("memory_usage") if isinstance(state, dict) else None
        if isinstance(usage, dict) and usage.get("token_capacity") is not None:
            return int(usage["token_capacity"])
    value = info.get("max_total_num_tokens")
    return int(value) if value is not None else None
