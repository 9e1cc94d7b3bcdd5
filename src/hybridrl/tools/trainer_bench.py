"""Trainer benchmark: one fixed synthetic batch per shape, both trainers, best and median of N updates.

    python -m hybridrl trainer-bench --shape qwen3-0.6b --trainer hf megatron --updates 5 --out bench.json

An update is what the loop's update_actor and save_adapter phases time: logprobs, loss, backward, optimizer step
and the adapter export the engine loads (`update_s`); `compute_s` is the same without the export, timed by the
trainer, and is what perf/mfu and the tokens/s read; per update, `save_s_all` is the export and `other_s_all` the
rest (for Megatron the job's round trip to its worker processes). `state_s_all` is the wait after each update for
the optimizer state (the loop's save_state phase): written on a thread, it overlaps the engine's transition in a
run, but nothing here, so the next update starts only once it is on disk. The first update is a warm-up and is left
out. Peak memory is NVML's reading of the GPUs (sampled every 50 ms during the updates), torch's peak where NVML is
absent, None on CPU. The model is a random-init checkpoint of the shape (no download), built once under --workdir;
--vocab gives it another vocabulary (151936: Qwen3's, as the study models have; the shapes keep the
768 their first results were measured with).
Micro-batches are packed (pack_sequences) unless --no-pack; --varied draws each completion's length, where padding
would cost. --chunked-head runs the trainers with the chunked output head (chunked_head true) instead of the
model's full logits, the output head's
before-and-after within one lease. --ep N trains a MoE shape's Megatron update sharded over N GPUs by expert
parallelism (train_ep N: each GPU holds 1/N of the experts); its tokens/s per GPU divides by N.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridrl import atomic
from hybridrl.atomic import atomic_dir
from hybridrl.run.provenance import git_info, host_info
from hybridrl.run.telemetry import MemorySampler
from hybridrl.study.run_config import RunConfig, RunLora
from hybridrl.trainers.base import Sample


@dataclass(frozen=True)
class Shape:
    """A model shape and the batch it is benchmarked on."""

    arch: str  # HF config class prefix: qwen3 or qwen3_moe
    config: dict[str, Any]
    samples: int
    prompt: int
    completion: int
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    extra: dict[str, Any] = field(default_factory=dict)


# The studies' two shapes, as the study configs build them (config/gpu-h200.yaml qwen3-0.6b-random-v768 and
# config/gpu-4xh200-moe.yaml qwen3-30b-a3b-random: their tokenizer gives a vocab of 768), with their
# batches (128 x 256 and 64 x 256 completion tokens after a 128-token prompt); `tiny` is for CPU tests.
SHAPES: dict[str, Shape] = {
    "qwen3-0.6b": Shape("qwen3", dict(
        vocab_size=768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True),
        samples=128, prompt=128, completion=256),
    "qwen3-30b-a3b": Shape("qwen3_moe", dict(
        vocab_size=768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False),
        samples=64, prompt=128, completion=256, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    "tiny": Shape("qwen3", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True),
        samples=4, prompt=6, completion=5),
    "tiny-moe": Shape("qwen3_moe", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False),
        samples=4, prompt=6, completion=5, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
}
_CONFIG_CLASSES = {"qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}


def shape_of(name: str, vocab: int | None = None) -> Shape:
    """The named shape, with `vocab` output rows where given; ValueError naming the known shapes otherwise."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    if vocab is None:
        return SHAPES[name]
    if vocab < 3:  # the batch draws token ids from 2 up: 0 and 1 are the tokenizer's pad and eos
        raise ValueError(f"--vocab must be at least 3, got {vocab}")
    return replace(SHAPES[name], config={**SHAPES[name].config, "vocab_size": vocab})


def shape_model(workdir: Path, name: str, shape: Shape, device: str) -> Path:
    """The shape's random checkpoint under workdir (built on first use): model-NAME, or model-NAME-vVOCAB for a
    vocabulary other than the shape's own, so that the two never share a directory."""
    vocab = shape.config["vocab_size"]
    suffix = "" if vocab == SHAPES[name].config["vocab_size"] else f"-v{vocab}"
    return random_model(workdir / f"model-{name}{suffix}", shape, "bfloat16" if device == "cuda" else "float32")


def random_model(path: Path, shape: Shape, dtype: str, isolate: bool | None = None) -> Path:
    """A random-init checkpoint of the shape with a word-level tokenizer over its vocab; reused if present.

    isolate (default: where there is a GPU, whose shapes are the large ones) builds it in a child process, whose
    memory the host gets back before a trainer loads it: the 61 GB MoE build and a trainer in one process passed
    the host's 128 GiB twice. Written to a temporary directory and renamed when whole: a write that
    failed half way (the disk filled at that shape) leaves no config.json a later call would take for a checkpoint.
    """
    if (path / "config.json").exists():
        return path
    import torch

    if not (torch.cuda.is_available() if isolate is None else isolate):
        _build_random_model(path, shape, dtype)
        return path
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=_build_random_model, args=(path, shape, dtype))
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not (path / "config.json").exists():
        raise RuntimeError(f"building the random checkpoint {path} failed in its own process (exit code "
                           f"{proc.exitcode}; -9 is the host's out-of-memory kill); its error is printed above")
    return path


def _build_random_model(path: Path, shape: Shape, dtype: str) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models

    cfg = getattr(transformers, _CONFIG_CLASSES[shape.arch])(**shape.config)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # a 30B random init on the CPU takes minutes
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    vocab = shape.config["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp)
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1").save_pretrained(tmp)


def fixed_batch(vocab: int, n: int, prompt: int, completion: int, seed: int = 0,
                varied: bool = False) -> list[Sample]:
    """The same samples for every trainer and every update: random ids, advantages of both signs. varied: each
    completion's length is drawn uniformly from completion // 8 .. completion, as sampled answers differ."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        c = rng.randint(max(1, completion // 8), completion) if varied else completion
        out.append(Sample(prompt_ids=[rng.randrange(2, vocab) for _ in range(prompt)],
                          completion_ids=[rng.randrange(2, vocab) for _ in range(c)],
                          engine_logprobs=[-1.0] * c, advantage=rng.gauss(0, 1)))
    return out


class PeakMemory:
    """Highest NVML reading of used GPU memory (GB) while active, from the run's own sampler (this process's
    GPUs, 50 Hz); torch's peak where NVML sees no GPU."""

    def __init__(self, device: str) -> None:
        self.device, self.peak_gb = device, None
        self._sampler: MemorySampler | None = None

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()
            self._sampler = MemorySampler().start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sampler is None:
            return
        self.peak_gb = self._sampler.take().get("mem/peak_gb")
        self._sampler.close()
        if self.peak_gb is None:
            import torch

            from hybridrl import nvml

            self.peak_gb = torch.cuda.max_memory_allocated() / nvml.GB


def bench_run(shape: Shape, trainer: str, device: str, micro_batch: int, micro_batch_tokens: int | None,
              pack: bool = True, chunked_head: bool = False, ep: int = 1,
              ep_dispatch: str = "host_read", ep_batch: str = "replicated") -> RunConfig:
    return RunConfig(model="bench", trainer=trainer, device=device, seed=0, lr=1e-5, weight_decay=0.0, train_ep=ep,
                     ep_dispatch=ep_dispatch, ep_batch=ep_batch,
                     clip_eps=0.2, kl_coef=0.0, grad_clip=1.0, micro_batch=micro_batch,
                     micro_batch_tokens=micro_batch_tokens, pack_sequences=pack, chunked_head=chunked_head,
                     lora=RunLora(rank=8, alpha=16.0, dropout=0.0, target_modules=shape.lora_targets))


def build_trainer(kind: str, model: Path, run: RunConfig, workdir: Path, peft_lora: bool,
                  megatron_permute: bool) -> Any:
    if kind == "hf":
        from hybridrl.trainers.hf import HFTrainer

        return HFTrainer(model, run, fuse_lora=not peft_lora)
    from hybridrl.trainers.megatron.trainer import MegatronTrainer

    return MegatronTrainer(model, run, workdir / kind, megatron_permute=megatron_permute)


def bench_trainer(kind: str, model: Path, run: RunConfig, samples: list[Sample], updates: int,
                  workdir: Path, peft_lora: bool = False, megatron_permute: bool = False,
                  profile_to: Path | None = None) -> dict[str, Any]:
    """Warm-up plus `updates` updates of one trainer on `samples`; best and median figures. peft_lora: the HF
    trainer with PEFT's own adapter forward; megatron_permute: the Megatron trainer with megatron's own MoE token
    permutation (each the change its trainer is compared with in one lease); profile_to: one more Megatron update
    after the timed ones, under torch.profiler in every worker (tables to PROFILE_TO-rankK.txt)."""
    load_before = os.getloadavg()  # a host busy with something else slows these launch-bound updates
    t0 = time.perf_counter()
    trainer = build_trainer(kind, model, run, workdir, peft_lora, megatron_permute)
    start_s = time.perf_counter() - t0
    ranks = len(trainer.gpu_pids()) if kind == "megatron" else 1  # the worker processes (train_tp x train_ep)
    update_s, compute_s, save_s, state_s, mfu = [], [], [], [], []
    metrics: dict[str, Any] = {}
    profile_error = None
    try:
        with PeakMemory(run.device) as mem:
            for i in _progress(range(updates + 1), f"{kind}: a warm-up, then {updates} timed updates"):
                t0 = time.perf_counter()
                metrics = trainer.step(i + 1, samples, workdir / kind / f"adapter-{i + 1}").metrics
                t1 = time.perf_counter()
                trainer.flush()
                if i == 0:
                    continue  # warm-up: kernels, allocator, first export
                update_s.append(t1 - t0)
                state_s.append(time.perf_counter() - t1)
                compute_s.append(metrics["perf/train_tokens"] / metrics["perf/train_tok_s"])
                save_s.append(metrics["timing_s/save_adapter"])
                mfu.append(metrics["perf/mfu"])  # NaN without a known peak (CPU)
        if profile_to is not None:  # after the timed updates, so that the profiler's cost is in none of them
            from hybridrl.trainers.megatron.trainer import MegatronWorkerError

            trainer.profile_to = profile_to
            try:
                trainer.step(updates + 2, samples, workdir / kind / f"adapter-{updates + 2}")
            except MegatronWorkerError as exc:  # the timed figures stand without the profile: say why it is missing
                profile_error = str(exc).splitlines()[0]
    finally:
        trainer.close()
    tokens = metrics["perf/train_tokens"]
    best, median = min(compute_s), statistics.median(compute_s)
    gpus = run.train_tp * run.train_ep if kind == "megatron" else 1
    return {
        "start_s": start_s, "ranks": ranks,
        "update_s_best": min(update_s), "update_s_median": statistics.median(update_s),
        "compute_s_best": best, "compute_s_median": median, "update_s_all": update_s,
        # an update = compute + adapter export + the rest (the Megatron job's round trip, the step's own Python)
        "compute_s_all": compute_s, "save_s_all": save_s, "state_s_all": state_s,
        "other_s_all": [u - c - s for u, c, s in zip(update_s, compute_s, save_s, strict=True)],
        "completion_tok_s_best": tokens / best, "completion_tok_s_median": tokens / median,
        "completion_tok_s_per_gpu_median": tokens / median / gpus,
        "mfu_best": None if any(math.isnan(m) for m in mfu) else max(mfu),
        "mfu_median": None if any(math.isnan(m) for m in mfu) else statistics.median(mfu),
        "update_flops": metrics["perf/update_flops"], "peak_gb": mem.peak_gb, "last_loss": metrics["train/loss"],
        "experts_impl": metrics.get("train/experts_impl"), "moe_permute": getattr(trainer, "moe_permute", None),
        # whether the output head ran chunked (the HF trainer keeps the full logits for a head it does not know)
        "chunked_head": metrics.get("train/chunked_head"),
        "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": os.getloadavg(),
        "profile": None if profile_to is None else sorted(p.name for p in profile_to.parent.glob(
            f"{profile_to.name}-rank*.txt")),
        "profile_error": profile_error,
    }


def _progress(steps: range, description: str) -> Any:
    """The steps, with a progress bar on stderr (a 48-layer update takes seconds; stdout keeps the JSON alone)."""
    from rich.console import Console
    from rich.progress import track

    return track(steps, description=description, console=Console(stderr=True), transient=True)


def summary_table(report: dict[str, Any], trainers: list[str]) -> Any:
    """A rich table of each trainer's medians: the update and its parts, completion tokens/s, MFU, peak memory."""
    from rich.table import Table

    head = ", chunked head" if report.get("chunked_head") else ""
    table = Table(title=f"trainer-bench {report['shape']} (vocab {report.get('vocab', '?')}{head}): "
                        f"{report['samples']} samples, micro-batch {report['micro_batch']}, {report['updates']} "
                        f"timed updates, {report['device']}")
    # seconds (medians), completion tokens/s over the compute
    for col in ("trainer", "update s", "compute s", "export s", "rest s", "state s", "tok/s", "MFU", "peak GB"):
        table.add_column(col, justify="right")
    for kind in trainers:
        r = report[kind]
        table.add_row(kind, *(f"{statistics.median(r[k]):.3f}" for k in ("update_s_all", "compute_s_all",
                                                                          "save_s_all", "other_s_all",
                                                                          "state_s_all")),
                      f"{r['completion_tok_s_median']:,.0f}",
                      "-" if r["mfu_median"] is None else f"{100 * r['mfu_median']:.1f}%",
                      "-" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}")
    return table


def check_megatron_permute(shape_name: str, trainers: list[str]) -> None:
    """ValueError unless --megatron-permute would change something: the Megatron trainer alone, on a MoE shape."""
    if trainers != ["megatron"]:
        raise ValueError("--megatron-permute changes the megatron trainer only: give --trainer megatron")
    if "num_experts" not in shape_of(shape_name).config:
        moe = ", ".join(name for name, s in SHAPES.items() if "num_experts" in s.config)
        raise ValueError(f"--megatron-permute changes MoE layers only, and {shape_name} has none (MoE shapes: {moe})")


def check_device(device: str) -> None:
    """ValueError where the device asked for is not here (torch asserts deep inside the first transfer)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU on this machine")


def check_ep(shape_name: str, trainers: list[str], ep: int) -> None:
    """ValueError unless --ep N can shard the update: the Megatron trainer alone, a MoE shape whose experts N
    divides."""
    if ep < 1:
        raise ValueError(f"--ep must be at least 1, got {ep}")
    if ep == 1:
        return
    if trainers != ["megatron"]:
        raise ValueError("--ep shards the megatron trainer only: give --trainer megatron")
    experts = shape_of(shape_name).config.get("num_experts")
    if not experts:
        moe = ", ".join(name for name, s in SHAPES.items() if "num_experts" in s.config)
        raise ValueError(f"--ep splits the experts of a MoE shape, and {shape_name} has none (MoE shapes: {moe})")
    if experts % ep:
        raise ValueError(f"--ep {ep} does not divide {shape_name}'s {experts} experts")


def check_options(shape_name: str, trainers: list[str], peft_lora: bool, megatron_permute: bool = False,
                  ep: int = 1, ep_dispatch: str = "host_read", ep_batch: str = "replicated",
                  profile: bool = False) -> None:
    """ValueError for options that do not go together; checked before anything is built."""
    if peft_lora and trainers != ["hf"]:
        raise ValueError("--peft-lora changes the hf trainer only: give --trainer hf")
    if megatron_permute:
        check_megatron_permute(shape_name, trainers)
    check_ep(shape_name, trainers, ep)
    if ep_dispatch != "host_read" and (ep == 1 or megatron_permute):
        raise ValueError(f"--ep-dispatch {ep_dispatch} changes how hybridrl's gathers pick an expert-parallel rank's "
                         "rows: give --ep 2 or more, without --megatron-permute")
    if ep_batch != "replicated" and ep == 1:
        raise ValueError(f"--ep-batch {ep_batch} splits the batch over expert-parallel ranks: give --ep 2 or more")
    if profile and trainers != ["megatron"]:
        raise ValueError("--profile profiles an update in the megatron trainer's workers: give --trainer megatron "
                         "(trainer-profile profiles the hf trainer)")


def main(shape_name: str, trainers: list[str], updates: int, device: str, workdir: Path, out: Path | None,
         micro_batch: int = 8, micro_batch_tokens: int | None = None, samples: int | None = None,
         pack: bool = True, varied: bool = False, peft_lora: bool = False,
         megatron_permute: bool = False, vocab: int | None = None, chunked_head: bool = False,
         ep: int = 1, ep_dispatch: str = "host_read", ep_batch: str = "replicated",
         profile: bool = False) -> dict[str, Any]:
    """Benchmark the trainers on the shape's fixed batch; prints and returns one JSON object (and writes it).
    ep: the Megatron trainer's expert parallelism (train_ep), on that many GPUs; ep_dispatch and ep_batch: how its
    ranks pick their experts' rows and share the batch (RunConfig's keys of those names); profile: one more
    Megatron update under torch.profiler, its tables beside `out` (OUT.profile-rankK.txt; in workdir without out)."""
    import torch

    from hybridrl.trainers.flops import device_name

    if updates < 1:
        raise ValueError("--updates must be at least 1")
    check_options(shape_name, trainers, peft_lora, megatron_permute, ep, ep_dispatch, ep_batch, profile)
    shape = shape_of(shape_name, vocab)
    workdir.mkdir(parents=True, exist_ok=True)
    model = shape_model(workdir, shape_name, shape, device)
    n = samples or shape.samples
    batch = fixed_batch(shape.config["vocab_size"], n, shape.prompt, shape.completion, varied=varied)
    report: dict[str, Any] = {
        "shape": shape_name, "vocab": shape.config["vocab_size"], "samples": n, "prompt": shape.prompt,
        "completion": shape.completion, "lengths": "varied" if varied else "fixed",
        "completion_tokens": sum(len(x.completion_ids) for x in batch),
        "updates": updates, "micro_batch": micro_batch, "micro_batch_tokens": micro_batch_tokens,
        "pack_sequences": pack, "peft_lora": peft_lora, "megatron_permute": megatron_permute,
        "chunked_head": chunked_head, "train_ep": ep, "ep_dispatch": ep_dispatch, "ep_batch": ep_batch,
        "device": device_name(device) or "cpu", "torch": torch.__version__, "lora_targets": list(shape.lora_targets),
        # the same code's update moved by tens of percent between two leases' hosts: say which ran it
        "host": host_info(), "git": git_info(),
    }
    for kind in trainers:
        run = bench_run(shape, kind, device, micro_batch, micro_batch_tokens, pack, chunked_head, ep, ep_dispatch,
                        ep_batch)
        at = None if not profile else out.with_suffix(".profile") if out is not None else workdir / "bench.profile"
        report[kind] = bench_trainer(kind, model, run, batch, updates, workdir, peft_lora, megatron_permute, at)
        if device == "cuda":
            torch.cuda.empty_cache()
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(out, text + "\n")
    from rich.console import Console

    Console(stderr=True, width=120).print(summary_table(report, trainers))  # a pipe gets 80 columns: too few
    return report
