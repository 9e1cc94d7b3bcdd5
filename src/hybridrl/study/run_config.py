"""One run's configuration: every key with its type, default and meaning, in one place.

A study's `defaults` and `runs` entries are partial overrides of this model; `config.resolve` merges them and
validates the result here. The run part of workflow/schemas/config.schema.yaml is generated from this model
(`python -m hybridrl schema`), and a test keeps the committed file equal to what it generates.

Integers are strict: a YAML `3.0` for `steps` is refused, not silently taken as 3 (it would also change the run
id). Floats take integers (`alpha: 16` is 16.0), so a written default and an explicit equal value give one id.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ENGINES = ("vllm", "sglang", "vllm-inprocess")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Frozen(BaseModel):
    # strict: no "3" -> 3 or 3.0 -> 3 coercion; validate_default: defaults get the same types as given values
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", validate_default=True)


class RunSampling(_Frozen):
    """How the engine samples each rollout request."""

    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollout")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: keep the most likely tokens up to this mass")
    top_k: int = Field(-1, ge=-1, description="keep the k most likely tokens; -1 keeps all")
    ignore_eos: bool = Field(False, description="generate max_new_tokens even past end-of-sequence")


class RunLora(_Frozen):
    """The LoRA adapter the trainer trains and the engine loads."""

    rank: int = Field(8, ge=1, description="LoRA rank r (megatron: divisible by train_tp)")
    alpha: float = Field(16.0, gt=0, description="LoRA scale: the update is multiplied by alpha / rank")
    dropout: float = Field(0.0, ge=0, le=1, description="LoRA dropout (the megatron trainer needs 0)")
    # lists in YAML and JSON, a tuple here so that the frozen config cannot be changed in place
    target_modules: tuple[Literal[LORA_TARGETS], ...] = Field(
        LORA_TARGETS, strict=False, min_length=1, description="projections that get an adapter")
    init_b_std: float = Field(
        0.0, ge=0, le=0.1, strict=False,
        description="standard deviation of the B matrices' first draw. 0 (PEFT's default): the adapter starts as the "
                    "identity, and step 1 rolls out the base model. Above 0: the run starts from a drawn adapter "
                    "(adapters/step-0000, trainer and engine alike), so that the adapter gate judges every step even "
                    "where the reward gives no gradient, as with a random-init model (1e-3 moves B about as much as "
                    "one AdamW step at lr 1e-3)")


class RunConfig(_Frozen):
    """One configuration of a study: engine, placement, trainer, model and every setting they read."""

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$",
                             description="readable prefix of the run id (default: engine-placement-trainer-model)")
    engine: Literal[ENGINES] = Field(
        "vllm", description="rollout engine: vllm or sglang (HTTP servers), vllm-inprocess (in the controller)")
    placement: Literal["colocate", "restart", "split"] = Field(
        "split", description="colocate: the engine sleeps while the trainer runs on its GPUs; restart: the engine "
                             "stops and starts again each step; split: the engine keeps GPUs of its own")
    overlap: int = Field(
        0, ge=0, le=1, description="split only: steps the rollout may run ahead of training. 1 rolls out step k+1 "
        "with the newest adapter the engine has while the trainer trains step k (one step off-policy; adapters "
        "swap only between batches); 0 alternates them")
    trainer: Literal["hf", "megatron", "none"] = Field(
        "hf", description="hf (transformers + PEFT), megatron (megatron-core under torchrun), or none "
                          "(inference only: a memory ballast in place of training)")
    model: str = Field(description="name of an entry under the study's models")
    device: Literal["cpu", "cuda"] = Field("cuda", description="where the engine and the trainer run")
    tp: int = Field(1, ge=1, description="tensor parallel size of the engine")
    train_tp: int = Field(1, ge=1, description="tensor parallel size of the megatron trainer")
    train_ep: int = Field(
        1, ge=1, description="expert parallel size of the megatron trainer (MoE models): each of train_ep GPUs holds "
        "num_experts / train_ep of every MoE layer's experts and a replica of everything else, and runs the whole "
        "batch (or its share: ep_batch); the trainer takes train_tp x train_ep GPUs")
    ep_batch: Literal["replicated", "split"] = Field(
        "replicated", description="megatron trainer at train_ep > 1: replicated, every rank runs the whole batch "
        "and a MoE layer sums its ranks' expert outputs; split, rank k runs samples k, k + train_ep, ... (the "
        "attention, router and head work divided by train_ep), and a MoE layer gathers every rank's tokens before "
        "its experts and hands each rank back its own tokens' sums")
    ep_dispatch: Literal["host_read", "masked"] = Field(
        "host_read", description="megatron trainer at train_ep > 1: how each rank picks its experts' rows. host_read "
        "keeps just its own, whose ends it reads from the GPU once a MoE layer (a wait that drains the host's launch "
        "queue); masked keeps every token's rows, its experts' first, and masks the others on the GPU: no wait, "
        "twice the expert inputs held for the backward")
    train_gpus: int = Field(1, ge=0, description="GPUs of the trainer in split placement")
    steps: int = Field(5, ge=1, description="training steps of the run")
    prompts_per_step: int = Field(8, ge=1, description="distinct prompts per step")
    group_size: int = Field(4, ge=2, description="rollouts per prompt (the GRPO group)")
    max_new_tokens: int = Field(128, ge=1, description="most tokens generated per rollout")
    max_concurrency: int = Field(64, ge=1, description="most requests the engine runs at once")
    sampling: RunSampling = Field(RunSampling(), description="sampling of the rollout requests")
    lora: RunLora = Field(RunLora(), description="the trained LoRA adapter")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate of the adapter")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip epsilon of the GRPO loss")
    format_reward: float = Field(0.1, ge=0, le=1, description="reward for a parseable but wrong answer")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL penalty to the base model (0: none)")
    grad_clip: float = Field(1.0, gt=0, description="clip the adapter's gradient norm to this")
    micro_batch: int = Field(8, ge=1, description="samples per trainer forward/backward; gradients accumulate "
                                                  "over the step's whole batch")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="when set, replaces micro_batch: each micro-batch takes samples, in order, while "
        "the tokens its forward computes stay within this many (packed: the sum of prompt + completion lengths; "
        "padded: rows x the longest); a longer sample gets a micro-batch of its own")
    pack_sequences: bool = Field(
        True, description="the trainers run each micro-batch's samples back to back in one row, kept apart by "
        "variable-length causal attention (torch's flash varlen kernel on a GPU), so no layer computes padding; "
        "false pads every row to the longest")
    engine_sleep: bool = Field(
        True, description="colocate: the engine sleeps before each update (what sglang_release or vllm_sleep_level "
        "say) and wakes after it; false: it stays awake beside the trainer, which stays on the GPU whole after its "
        "first onload (no sleep, wake, onload or offload in a step), for where the engine's share of each GPU and "
        "the trainer's peak fit together, as verl's free_cache_engine false; the only colocate a CPU can run")
    keep_base_on_gpu: bool | Literal["auto"] = Field(
        False, description="colocate: the trainer's frozen base weights stay on the GPU while the engine runs "
        "(only the LoRA weights and the optimizer state are offloaded); auto: they stay where each GPU's free "
        "memory, measured once the rest of the trainer is offloaded and before the engine starts, holds the "
        "engine's share (gpu_memory_utilization of the GPU) and a margin (run/base_residency.py); the decision is "
        "in provenance.json and train/keep_base_on_gpu")
    onload_beside_release: bool = Field(
        False, description="colocate with SGLang releasing its weights too (sglang_release all): the engine's sleep "
        "is two calls, its KV cache first, then its weights, and the trainer's onload runs beside the second, so "
        "that the weights leaving and the trainer's base coming back cross the host link at once, in opposite "
        "directions; done in a step where every GPU's free memory after the first call holds the most the trainer's "
        "last onload done alone took on a GPU and a margin, else one after the other "
        "(run/onload_beside_release.py; each step records which as placement/onload_beside_release). For a base "
        "that does not stay on the GPU (keep_base_on_gpu false, or auto where it does not fit)")
    release_comms: bool = Field(
        False, description="megatron trainer on 2 or more GPUs (train_tp x train_ep): destroy its process groups "
        "(their NCCL communicators and buffers) at each offload and make them again at the next onload; the groups' "
        "setup then lands in every step. Measured at TP 2 on two H200s it gave back a few tens of MB a rank, far from "
        "issue 15's 1 GB bound (results/reference/2026-11-27-2xh200-tp2release)")
    train_dtype: Literal["bf16", "fp32"] | None = Field(
        None, description="megatron trainer: dtype of the base weights (default bf16 on cuda, fp32 on cpu)")
    chunked_head: bool = Field(
        False, description="the trainers run the output head chunk by chunk over the completion tokens, keeping only "
        "each token's logprob and entropy and recomputing a chunk's logits in the backward, so that no [tokens, "
        "vocabulary] logits are held (src/hybridrl/trainers/chunked_head.py; the full path's values and gradients "
        "to fp32 rounding); false (until a GPU lease has measured it): the model's logits at every position, then the "
        "log-softmax. The HF trainer "
        "takes it for llama, qwen2, qwen3 and qwen3_moe checkpoints and the full logits otherwise; recorded as "
        "train/chunked_head")
    rollout_is: Literal["off", "truncate", "mask"] = Field(
        "off", description="importance-sampling correction for samples the engine drew from an older adapter "
        "(overlap), with its rollout logprobs as the behaviour policy: truncate caps each token's weight at "
        "rollout_is_threshold, mask drops the tokens above it (verl rollout_is, slime --use-tis); off on-policy")
    rollout_is_threshold: float = Field(
        2.0, gt=1, description="the importance weight cap of rollout_is (verl rollout_is_threshold, slime "
        "--tis-clip)")
    max_asleep_growth_gb: float = Field(
        1.0, ge=0, description="a sleeping engine's GPU memory (NVML, 10^9 bytes; its own where NVML can leave the "
        "trainer's processes out, mem/engine_asleep_own_gb) may grow at most this much over its first sleep of the "
        "run; more fails the run (a leak, as vLLM issues 21336 and 32714 report)")
    max_awake_shortfall_gb: float = Field(
        2.0, ge=0, description="a woken engine's GPU memory (NVML, 10^9 bytes) may fall at most this much short of "
        "what it held right after it started; more is recorded as check/awake_memory_ok false and reported (the run "
        "goes on: what a short KV cache does to the rollout is what it then measures)")
    # bf16 engines and trainers differ by ~0.007 per token on the dense H200 reference; a wrong or stale adapter, or
    # stale cached prefixes, shows up above 0.02 (0.026 on the H200 when split vLLM reused the old adapter's KV)
    max_logprob_gap: float | None = Field(
        None, gt=0, description="gate, warn tier: mean |trainer - engine| logprob per token above this is recorded "
        "and reported (check/logprob_gap_tier warn); default by model family: 0.02 dense, 0.05 MoE (fp32 runs "
        "can use 1e-3)")
    logprob_gap_fail: float | None = Field(
        None, gt=0, description="gate, fail tier: a mean gap above this stops the run; default 0.1 (slime's "
        "rollout-logprob gate in its CI)")
    seed: int = Field(0, ge=0, description="seed of the prompts, the sampling and the adapter's initialisation")
    replicate_seeds: bool = Field(
        False, description="replicate k > 1 draws sampling seeds of its own (k mixed into every request's seed), "
        "the prompts unchanged, so the interval over runs also holds the spread of the answers; replicate k of "
        "every arm still sends one request set. Off, every replicate resends replicate 1's seeded requests, which "
        "the vLLM engines answer alike and SGLang does not (README, the verdict)")
    # replicates repeat a configuration: same seed, hence the same request sets; only the run id differs
    replicates: int = Field(
        1, ge=1, description="independent runs of this configuration, each with its own run id (the first keeps the "
        "plain id, the others end in -r2, -r3, ...) and the same seed, hence the same request sets; the study runs "
        "them interleaved across configurations (A B C A B C); not part of the run's hash")
    warmup_steps: int = Field(
        2, ge=0, description="steps the report keeps out of the steady-state statistics and shows apart: step 1 "
        "rolls out the base model, step 2 is the first rollout with an adapter")
    eval_every: int = Field(
        0, ge=0, description="every this many steps (and after the last), a greedy pass over a fixed slice of the "
        "test split through the engine with the current adapter (eval/accuracy, timing_s/eval); 0: never")
    eval_problems: int = Field(64, ge=1, description="size of that slice: the first this many test problems")
    eval_max_new_tokens: int | None = Field(
        None, ge=1, description="most tokens of one eval answer (default: max_new_tokens)")
    retries: int = Field(2, ge=0, description="engine restarts allowed per step")
    stream_fraction: float = Field(
        0.125, ge=0, le=1, description="share of each step's requests streamed for TTFT/TPOT; the rest come back "
        "whole, so the controller's client cannot cap the throughput it measures (1: every request, the old path)")
    shared_pool: bool = Field(
        False, description="the rollout client before 2026-11-23, one connection pool for every request (with "
        "stream_fraction 1: the old path), to compare with results recorded through it")
    keep_connections: bool = Field(
        False, description="server engines: the rollout client keeps its event loop and its connection a slot from "
        "one rollout to the next, so a step's requests leave on open connections (engines/rollout_loop.py), and the "
        "control calls (sleep, wake, adapter, cache flush) share one kept connection; false: each rollout makes its "
        "clients and connects anew, and each control call makes a client that loads the CA bundle, as every result "
        "before 2026-11-29 was recorded")
    gc_freeze: bool = Field(
        False, description="the controller collects its garbage once and freezes its heap after the run's set-up "
        "(the trainer's build and the engine's first start), so that later collections, which stop every Python "
        "thread of the controller (the rollout client's too), skip the objects set-up made, as vLLM's engine core "
        "and API server do in their own processes after their start; no engine freezes the controller's")
    rollout_process: bool = Field(
        False, description="server engines: the rollout client runs in a process of its own, so that its parsing "
        "never waits for, or holds up, the trainer's Python thread on the controller's interpreter lock (overlap "
        "runs both at once); false: a thread of the controller, as every result before 2026-11-26 was recorded")
    engine_timing: bool = Field(
        False, description="ask the engine for its own timing of each request (SGLang --enable-metrics with "
        "SGLANG_FORCE_STREAM_INTERVAL=1, so that its API server sees every token; vLLM "
        "--enable-per-request-metrics, in-process vLLM's request stats): TTFT and TPOT of the requests answered "
        "whole too (perf/engine_*), with no stream to pay for")
    client_ceiling_s: float = Field(
        2.0, ge=0, description="seconds spent before the engine starts on measuring the rollout client's ceiling "
        "against a fake engine (perf/client_ceiling_tok_s); 0 skips it")
    request_timeout_s: float = Field(600.0, gt=0, description="timeout of one rollout request")
    startup_timeout_s: float = Field(900.0, gt=0, description="timeout of an engine's or trainer's start")
    engine_args: tuple[str, ...] = Field((), strict=False,
                                         description="extra command-line flags passed to the engine server")
    sglang_release: Literal["kv_cache", "all"] = Field(
        "kv_cache", description="what SGLang releases on sleep: kv_cache keeps LoRA base weights resident")
    sglang_retain_cpu_backup: bool = Field(
        True, description="with sglang_release all: keep SGLang's pinned CPU copy of the weights from one sleep to "
        "the next (torch_memory_saver's TMS_RETAIN_CPU_BACKUP), as vLLM's level-1 sleep keeps its pinned buffers "
        "in torch's host cache; false is SGLang's own default, which pins the whole copy anew on every sleep and "
        "frees it on every wake")
    vllm_sleep_level: Literal[1, 2] = Field(
        1, description="level 2 is refused while vLLM cannot reload LoRA-wrapped weights (vllm#39934)")
    vllm_detokenize: bool = Field(
        True, description="in-process vLLM: turn each new token, and each sampled token's logprob, into text in the "
        "controller's process as it comes (vLLM's default). false asks for token ids and logprobs only "
        "(SamplingParams detokenize false): the run decodes each whole completion once in its reward phase, so "
        "the thread that collects the outputs does no per-token text work")
    sglang_detokenize: bool = Field(
        True, description="SGLang: its tokenizer and detokenizer processes turn each new token into text as it comes "
        "(SGLang's default), though the run asks for token ids and reads only those. false starts it with "
        "--skip-tokenizer-init: token ids and logprobs only, no detokenizer work beside the scheduler; the "
        "counterpart of vllm_detokenize false")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="share of each GPU the engine may use")
    ballast_gb: float = Field(0.0, ge=0, description="trainer none: GPU memory held in place of training")
    ballast_s: float = Field(0.0, ge=0, description="trainer none: seconds the ballast is held each step")


class RunSpec(_Frozen):
    """One run as the `run_config` rule hands it to `python -m hybridrl train` (results/runs/<id>/config.json)."""

    run_id: str = Field(description="the run's id: readable prefix and a hash of `run`")
    run: RunConfig = Field(description="the resolved run")
    study: str = Field(description="name of the study the run belongs to")
    engine_env: dict[str, Any] = Field({}, description="the engine's Python and extra environment (engine_envs)")


# keys added after reference results were recorded: out of the hash while they hold their default, so that those
# results keep their ids (and a study's later rounds join its earlier ones); a run that sets one gets an id of its own
_LATE_KEYS = {"rollout_process": False, "release_comms": False, "replicate_seeds": False, "chunked_head": False,
              "train_ep": 1, "max_awake_shortfall_gb": 2.0, "lora.init_b_std": 0.0, "engine_sleep": True,
              "ep_dispatch": "host_read", "ep_batch": "replicated", "vllm_detokenize": True,
              "sglang_detokenize": True, "keep_connections": False, "gc_freeze": False,
              "onload_beside_release": False}

# a replicate's suffix: after the 8-hex hash, so no readable prefix (`name`) can look like one
_REPLICATE = re.compile(r"^(?P<config>.+-[0-9a-f]{8})(?:-r(?P<k>[0-9]+))?$")


def _hash_excluded(run: RunConfig) -> dict[str, Any]:
    """model_dump's `exclude` for the hash: `replicates`, and every late key (dotted: one level down) at its default."""
    out: dict[str, Any] = {"replicates": True}
    for key, default in _LATE_KEYS.items():
        parent, _, child = key.rpartition(".")
        if getattr(getattr(run, parent) if parent else run, child) == default:
            if parent:
                out.setdefault(parent, {})[child] = True
            else:
                out[child] = True
    return out


def run_id(run: RunConfig, replicate: int = 1) -> str:
    """Readable prefix plus a short hash of the resolved run, so one changed parameter changes one id.

    `replicates` stays out of the hash: raising it adds runs and keeps those already measured. Replicate 1 has
    the configuration's plain id, replicate k > 1 the suffix -r<k>.
    """
    if not 1 <= replicate <= run.replicates:
        raise ValueError(f"replicate {replicate} is outside 1..{run.replicates}")
    canonical = json.dumps(run.model_dump(mode="json", exclude=_hash_excluded(run)), sort_keys=True,
                           separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:8]
    prefix = run.name or f"{run.engine}-{run.placement}-{run.trainer}-{run.model}"
    return f"{prefix}-{digest}" + (f"-r{replicate}" if replicate > 1 else "")


def split_replicate(rid: str) -> tuple[str, int]:
    """(configuration id, replicate number) of a run id; ids without a suffix are replicate 1."""
    match = _REPLICATE.match(rid)
    if match is None:
        return rid, 1
    return match["config"], int(match["k"] or 1)


def run_schema() -> dict[str, Any]:
    """The JSON schema of a study's `defaults` and `runs` entries, as workflow/schemas/ holds it."""
    raw = RunConfig.model_json_schema()
    defs = raw.pop("$defs", {})

    def clean(node: Any, is_properties: bool = False) -> Any:
        if isinstance(node, list):
            return [clean(x) for x in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:  # nested models inline: the study schema keeps one `run` definition
            node = {**defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
        return {k: clean(v, is_properties=k == "properties" and not is_properties) for k, v in node.items()
                if is_properties or k != "title"}

    schema = clean(raw)
    # every key may be left out of one entry: the merged run is checked by the model, where `model` is required
    schema.pop("required", None)
    return schema
