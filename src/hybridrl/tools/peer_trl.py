"""TRL's GRPOTrainer as a peer arm (`python -m hybridrl peer-trl`): the framework many users would pick instead,
trained on a study run's model, prompts, reward and batch, its step and phases recorded beside hybridrl's rows.

What it mirrors from the run (results/runs/<id>/config.json): the model, the problems each step asks (the same
`step_problems(seed, step)` draw, in order, TRL's shuffling off), the prompt text, the reward (hybridrl's
`shaped_reward` with the run's format_reward, called by TRL as a reward function), prompts_per_step x group_size
completions a step, max_new_tokens, the sampling (temperature, top_p, top_k, ignore_eos), LoRA rank, alpha, dropout
and target modules, the clip epsilon, the KL weight (0: no reference pass in either), the gradient-norm clip,
the weight decay, the seed, and one optimizer step a step. Its loss is TRL's `dapo` (a token mean over the step's
whole batch however it is split), which is hybridrl's. On CUDA: bf16 autocast over a bf16 base with fp32 LoRA
weights (PEFT's default upcast), as hybridrl's HF trainer; vLLM in colocate mode with sleep mode on (or off: the
measurement's vllm_sleep false, beside a run whose engine stays awake).

Settings that differ from hybridrl's runs, and why (each is also in the result's `differences`):
- lr: the measurement's `lr` where given (the peer study asks 1e-3), else the run's; a constant schedule, as hybridrl's
  (TRL's default decays linearly to 0 over the steps).
- gradient_checkpointing: TRL's default is on (hybridrl never checkpoints); a study declares both, the default and
  off, so that TRL's best configuration is measured too.
- the micro-batch: TRL's per_device_train_batch_size (completions a forward); the step's batch is accumulated over
  gradient_accumulation_steps = steps_per_generation micro-batches, so that one generation feeds one optimizer
  step. hybridrl sizes its micro-batches by tokens (micro_batch_tokens) and packs them without padding; TRL pads
  every row to the longest and does not pack.
- vLLM sleep: TRL sleeps at level 2 (weights discarded) and, every step, merges the LoRA into the base and loads
  the full weights into vLLM (`sync_weights`); hybridrl's vLLM sleeps at level 1 (weights to CPU memory) and
  serves the LoRA adapter itself. TRL offers no other way with PEFT in colocate mode.
- vLLM's batch: TRL fixes max_num_batched_tokens at 4096 and max_num_seqs at the micro-batch x
  steps_per_generation; the run's max_concurrency and engine_args do not reach it.
- importance sampling: TRL corrects for the vLLM/trainer mismatch by default (a second forward over the batch for
  the old logprobs, sequences masked above 3.0); it follows the run's rollout_is instead: off -> no correction and
  no extra forward, truncate / mask -> token_truncate / token_mask at rollout_is_threshold.
- advantages: TRL divides by the group's sample std plus 1e-4; hybridrl by the population std plus 1e-6.
- the optimizer: TRL's default AdamW implementation (transformers' `optim`), the same update as hybridrl's
  torch AdamW; the checks hybridrl runs every step (logprob gap, memory) have no TRL counterpart.
On the CPU (the tests) TRL generates with transformers, fp32, no vLLM.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.atomic import write_text
from hybridrl.study.run_config import RunConfig
from hybridrl.task import data as gsm8k

REWARD_FUNCTION = "hybridrl.task.data.shaped_reward"
# TRL's timer names, as its profiling_context writes them ("<TrainerClass>.<name>"), kept without the class
TIMER_PREFIX = "profiling/Time taken: "


@dataclass(frozen=True)
class PeerOptions:
    """The measurement's own settings: `gradient_checkpointing` None keeps TRL's default; `lr` None the run's;
    `vllm_sleep` False keeps vLLM awake beside the model."""

    steps: int
    micro_batch: int
    device: str
    gradient_checkpointing: bool | None = None
    lr: float | None = None
    vllm_sleep: bool = True


def check_options(run: RunConfig, opts: PeerOptions) -> None:
    """ValueError with one line for what TRL cannot be asked to do as the run does."""
    batch = run.prompts_per_step * run.group_size
    if batch % opts.micro_batch:
        raise ValueError(f"micro_batch {opts.micro_batch} does not divide the step's {batch} completions "
                         f"({run.prompts_per_step} prompts x {run.group_size})")
    if opts.device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, not {opts.device!r}")
    if opts.device == "cuda" and run.tp != 1:
        raise ValueError(f"the run's engine has tp {run.tp}: the TRL peer mirrors one-GPU runs (colocated vLLM at "
                         "TP 1)")
    if run.lora.init_b_std > 0:
        raise ValueError(f"lora.init_b_std {run.lora.init_b_std}: TRL builds its adapter as the identity (B = 0) and "
                         "cannot start from a drawn one; mirror a run with init_b_std 0")


def grpo_settings(run: RunConfig, opts: PeerOptions, out_dir: Path) -> dict[str, Any]:
    """GRPOConfig's keyword arguments doing the run's work (the module docstring says where they differ)."""
    accum = run.prompts_per_step * run.group_size // opts.micro_batch
    cuda = opts.device == "cuda"
    s = run.sampling
    kw: dict[str, Any] = dict(
        output_dir=str(out_dir), max_steps=opts.steps, seed=run.seed,
        per_device_train_batch_size=opts.micro_batch, gradient_accumulation_steps=accum,
        steps_per_generation=accum, num_iterations=1, num_generations=run.group_size,
        max_completion_length=run.max_new_tokens, shuffle_dataset=False,
        temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0),  # TRL: 0 keeps all (hybridrl: -1)
        learning_rate=opts.lr if opts.lr is not None else run.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=run.weight_decay, max_grad_norm=run.grad_clip,
        loss_type="dapo", epsilon=run.clip_eps, beta=run.kl_coef, scale_rewards="group",
        bf16=cuda, use_cpu=not cuda, model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"},
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, use_vllm=cuda,
    )
    if opts.gradient_checkpointing is not None:
        kw["gradient_checkpointing"] = opts.gradient_checkpointing
    if s.ignore_eos:  # vLLM's SamplingParams know ignore_eos; transformers' generate a minimum length
        kw["generation_kwargs"] = {"ignore_eos": True} if cuda else {"min_new_tokens": run.max_new_tokens}
    if cuda:
        kw.update(vllm_mode="colocate", vllm_enable_sleep_mode=opts.vllm_sleep, vllm_tensor_parallel_size=1,
                  vllm_gpu_memory_utilization=run.gpu_memory_utilization,
                  vllm_importance_sampling_correction=run.rollout_is != "off")
        if run.rollout_is != "off":
            kw.update(vllm_importance_sampling_mode=f"token_{run.rollout_is}",
                      vllm_importance_sampling_clip_max=run.rollout_is_threshold)
    return kw


def differences(run: RunConfig, kw: dict[str, Any]) -> list[dict[str, str]]:
    """Each TRL setting that is not what the run does, with the reason, for the result file."""
    out = [
        {"setting": "lr_scheduler_type", "trl": "constant", "hybridrl": "constant",
         "why": "TRL's default (linear decay to 0) set to hybridrl's constant rate"},
        {"setting": "micro-batching", "trl": f"{kw['per_device_train_batch_size']} completions a forward, padded, "
         f"{kw['gradient_accumulation_steps']} accumulated", "hybridrl": f"micro_batch_tokens "
         f"{run.micro_batch_tokens}, packed {run.pack_sequences}", "why": "TRL sizes micro-batches in rows and pads"},
        {"setting": "advantage std", "trl": "sample std + 1e-4", "hybridrl": "population std + 1e-6",
         "why": "TRL's formula; no setting changes it"},
    ]
    if kw["learning_rate"] != run.lr:
        out.append({"setting": "learning_rate", "trl": f"{kw['learning_rate']:g}", "hybridrl": f"{run.lr:g}",
                    "why": "the measurement's lr (issue 51 asks 1e-3 for the peer)"})
    out.append({"setting": "output head", "trl": "the model's full logits over the vocabulary",
                "hybridrl": "chunked head, no full logits" if run.chunked_head else "the model's full logits",
                "why": "TRL computes logprobs from the logits it is given"})
    kept = ("everything stays on the GPU (engine_sleep false)" if not run.engine_sleep else
            f"LoRA and optimizer state to pinned CPU memory, frozen base keep_base_on_gpu {run.keep_base_on_gpu}")
    out.append({"setting": "trainer between steps", "trl": "model and optimizer state stay on the GPU",
                "hybridrl": kept, "why": "TRL's colocate mode sleeps vLLM only"})
    gc = kw.get("gradient_checkpointing")
    out.append({"setting": "gradient_checkpointing", "trl": "on (TRL's default)" if gc is None else str(gc).lower(),
                "hybridrl": "off", "why": "TRL's default and off are both measured"})
    if kw.get("use_vllm"):
        out += [
            {"setting": "vllm sleep", "trl": ("level 2" if kw.get("vllm_enable_sleep_mode") else "off, awake") +
             ", merged weights loaded every step", "hybridrl": f"engine {run.engine}, " +
             (f"sleep level {run.vllm_sleep_level}" if run.engine_sleep else "awake (engine_sleep false)") +
             ", LoRA served as an adapter", "why": "TRL's colocate mode with PEFT has no other path"},
            {"setting": "vllm batch", "trl": "max_num_batched_tokens 4096, max_num_seqs "
             f"{kw['per_device_train_batch_size'] * kw['steps_per_generation']}",
             "hybridrl": f"max_concurrency {run.max_concurrency}, engine_args {list(run.engine_args)}",
             "why": "fixed by TRL"},
        ]
    else:
        out.append({"setting": "generation", "trl": "transformers generate (CPU, no vLLM)",
                    "hybridrl": f"engine {run.engine}", "why": "vLLM colocate needs a GPU"})
    return out


def step_dataset(problems: list[dict[str, Any]], run: RunConfig, steps: int) -> list[dict[str, str]]:
    """The problems steps 1..steps of the run ask, in order, as TRL's prompt rows (prompt text and answer)."""
    rows = []
    for step in range(1, steps + 1):
        for i in gsm8k.step_problems(len(problems), run.seed, step, run.prompts_per_step):
            rows.append({"prompt": gsm8k.prompt_text(problems[i]["question"]), "answer": problems[i]["answer"]})
    return rows


def prompt_dataset(rows: list[dict[str, str]]) -> Any:
    """TRL's train dataset of the rows, fingerprinted from their JSON. Left to itself, `datasets` hashes the Arrow
    table with dill, which pickles by value any module outside site-packages and the interpreter's prefix: on the
    GPU machine pyarrow is such a module (an overlay under /tmp/envs), and its MonthDayNano type does not pickle."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    return Dataset(InMemoryTable.from_pylist(rows), fingerprint=digest)


def project_reward(format_reward: float, sink: list[float]) -> Callable[..., list[float]]:
    """hybridrl's reward as a TRL reward function (TRL passes the dataset's columns by name); each value also goes
    to `sink`, so that the record shows what TRL trained on."""
    def hybridrl_reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        rewards = [gsm8k.shaped_reward(c, a, format_reward) for c, a in zip(completions, answer, strict=True)]
        sink.extend(rewards)
        return rewards
    return hybridrl_reward


@contextmanager
def trl_timers(sink: Callable[[str, float], None]) -> Iterator[None]:
    """TRL's own timers (trl.extras.profiling: generate, sync_weights, rewards, logprobs, loss) handed to `sink`
    as they close. TRL sends them only to wandb, mlflow or trackio; this taps the one method they all pass."""
    from trl.extras import profiling

    original = profiling.ProfilingContext._log_metrics

    def log_metrics(self: Any, duration: float) -> None:
        sink(self.name.split(".", 1)[-1], duration)
        original(self, duration)

    profiling.ProfilingContext._log_metrics = log_metrics  # type: ignore[method-assign]
    try:
        yield
    finally:
        profiling.ProfilingContext._log_metrics = original  # type: ignore[method-assign]


def adapter_state(model: Any) -> dict[str, Any]:
    """The LoRA weights, copied to the CPU in fp32."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if "lora_" in n}


def _sync(device: str) -> None:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


def step_recorder(device: str, rewards: list[float]) -> Any:
    """A transformers TrainerCallback timing each optimizer step and its optimizer call, gathering TRL's timers
    and its logged metrics per step, and the adapter before and after training."""
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.timers: defaultdict[str, float] = defaultdict(float)
            self.before: dict[str, Any] = {}
            self.after: dict[str, Any] = {}
            self._t0 = self._opt0 = 0.0
            self._optimizer_s = 0.0

        def timer(self, name: str, seconds: float) -> None:
            self.timers[name] += seconds

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            self.before = adapter_state(model)

        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.timers.clear()
            rewards.clear()
            _sync(device)
            self._t0 = time.perf_counter()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            _sync(device)
            self._opt0 = time.perf_counter()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            _sync(device)
            self._optimizer_s = time.perf_counter() - self._opt0

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            _sync(device)
            step_s = time.perf_counter() - self._t0
            timers = dict(self.timers)
            prepare = timers.get("_prepare_inputs", 0.0)
            self.steps.append({
                "step": state.global_step, "step_s": step_s, "optimizer_s": self._optimizer_s,
                # _prepare_inputs: generation, rewards, advantages (and old logprobs where asked); the rest of the
                # step is the forward, backward and optimizer step
                "generate_s": timers.get("vLLM.generate", timers.get("transformers.generate")),
                "sync_weights_s": timers.get("sync_weights"), "prepare_s": prepare, "train_s": step_s - prepare,
                "timers": timers, "rewards": list(rewards), "trl_log": {}})

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **_: Any) -> None:
            if self.steps and self.steps[-1]["step"] == state.global_step and logs:
                self.steps[-1]["trl_log"].update({k: v for k, v in logs.items() if _plain(v)})

        def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            self.after = adapter_state(model)

    return StepRecorder()


def _plain(v: Any) -> bool:
    return isinstance(v, (int, str)) or (isinstance(v, float) and math.isfinite(v))


def adapter_change(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """How far training moved the LoRA weights: largest absolute change, and lora_B's norm before and after (PEFT
    starts it at zero, so a trained adapter has a nonzero one)."""
    import torch

    if not before or before.keys() != after.keys():
        raise RuntimeError("the LoRA weights were not found before and after training (is the model a PEFT model?)")
    change = max(float((after[n] - before[n]).abs().max()) for n in before)

    def b_norm(state: dict[str, Any]) -> float:
        return float(torch.sqrt(sum((p.double() ** 2).sum() for n, p in state.items() if "lora_B" in n)))

    return {"tensors": len(before), "max_abs_change": change, "changed": change > 0,
            "lora_b_norm_before": b_norm(before), "lora_b_norm_after": b_norm(after)}


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("trl", "transformers", "peft", "accelerate", "datasets", "pyarrow", "dill", "torch", "vllm"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def main(run_id: str, run: RunConfig, model_dir: Path, data_dir: Path, out: Path, opts: PeerOptions,
         workdir: Path) -> dict[str, Any]:
    """Train `opts.steps` GRPO steps with trl.GRPOTrainer on the run's work; write and return the record."""
    check_options(run, opts)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model directory {model_dir} holds no config.json (build it: python -m hybridrl "
                                "model)")
    problems = gsm8k.read_jsonl(data_dir / "train.jsonl")
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    settings = grpo_settings(run, opts, workdir)
    lora = run.lora
    peft_config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    rewards: list[float] = []
    recorder = step_recorder(opts.device, rewards)
    t0 = time.perf_counter()
    with trl_timers(recorder.timer):
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=project_reward(run.format_reward, rewards),
                              args=GRPOConfig(**settings), train_dataset=prompt_dataset(step_dataset(
                                  problems, run, opts.steps)), peft_config=peft_config, callbacks=[recorder])
        build_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t1
    report = {
        "tool": "peer-trl", "run_id": run_id, "device": opts.device, "versions": _versions(),
        "reward_function": REWARD_FUNCTION, "format_reward": run.format_reward,
        "batch": {"prompts": run.prompts_per_step, "group_size": run.group_size,
                  "max_new_tokens": run.max_new_tokens},
        "settings": {k: v for k, v in settings.items() if k != "output_dir"},
        "differences": differences(run, settings), "build_s": build_s, "train_s": train_s,
        "steps": recorder.steps, "adapter": adapter_change(recorder.before, recorder.after),
    }
    write_text(out, json.dumps(report, indent=1) + "\n")
    return report
