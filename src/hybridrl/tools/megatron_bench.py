"""Trainer throughput on one batch, Megatron against HF + PEFT, and Megatron's residual GPU memory after
offload (what it keeps while the engine runs in colocate).

    python -m hybridrl.tools.megatron_bench WORKDIR [--tp 2] [--model DIR] [--samples 64] [--steps 3]
        [--release-comms]

Without --model it makes a random-init Qwen3 checkpoint (about 1 B parameters, bf16) in WORKDIR. Prints one
JSON object: per trainer the median step time over the steps after the first, completion tokens/s, and for
Megatron the NVML-measured memory of rank 0 after offload().
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hybridrl.study.run_config import RunConfig, RunLora
from hybridrl.tools.trainer_bench import Shape, fixed_batch, random_model
from hybridrl.trainers.base import Sample, Trainer

# a random Qwen3 of about 1 B parameters (hidden 2048, 24 layers, 16 heads, 8 kv heads); the batch comes from `main`
QWEN3_1B = Shape("qwen3", dict(
    vocab_size=32768, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, intermediate_size=6144, max_position_embeddings=4096, tie_word_embeddings=True),
    samples=64, prompt=128, completion=256)


def _time_steps(trainer: Trainer, samples: list[Sample], steps: int, out: Path) -> dict[str, float]:
    import torch

    times, last = [], {}
    for i in range(steps):
        trainer.onload()
        t0 = time.perf_counter()
        last = trainer.step(i + 1, samples, out / f"step{i + 1}").metrics
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = times[1:] or times
    tokens = sum(len(s.completion_ids) for s in samples)
    return {"step_s_median": statistics.median(steady), "step_s_all": times,
            "completion_tok_s": tokens / statistics.median(steady), "last_loss": last.get("train/loss")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--release-comms", action="store_true",
                    help="the run key release_comms: the ranks' process groups freed at offload (TP > 1)")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.model or random_model(args.workdir / "model", QWEN3_1B, "bfloat16")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    samples = fixed_batch(vocab, args.samples, args.prompt, args.completion)
    run = RunConfig(model="bench", lora=RunLora(rank=8, alpha=16.0, dropout=0.0), lr=1e-5, weight_decay=0.0,
                    clip_eps=0.2, kl_coef=0.0, grad_clip=1.0, seed=0, train_tp=args.tp, device="cuda",
                    micro_batch=args.micro_batch, release_comms=args.release_comms)
    report: dict[str, Any] = {"tp": args.tp, "samples": args.samples, "prompt": args.prompt,
                              "completion": args.completion, "micro_batch": args.micro_batch,
                              "release_comms": args.release_comms}

    from hybridrl.trainers.megatron.trainer import MegatronTrainer

    t0 = time.perf_counter()
    mt = MegatronTrainer(model, run, args.workdir / f"megatron-tp{args.tp}")
    try:
        report["megatron"] = {"start_s": time.perf_counter() - t0, "load_s": mt.load_s,
                              **_time_steps(mt, samples, args.steps, args.workdir / "adapters-megatron")}
        t1 = time.perf_counter()
        mt.offload()
        report["megatron"]["offload_s"] = time.perf_counter() - t1
        report["megatron"]["after_offload"] = mt.last_memory
        t1 = time.perf_counter()
        mt.onload()
        report["megatron"]["onload_s"] = time.perf_counter() - t1
        # before the model and any collective, then with the model loaded: what of the residual is not the groups'
        report["megatron"]["at_start"] = mt.start_memory
    finally:
        mt.close()
    if not args.skip_hf and args.tp == 1:
        import torch

        from hybridrl.trainers.hf import HFTrainer

        hf = HFTrainer(model, run)
        report["hf"] = _time_steps(hf, samples, args.steps, args.workdir / "adapters-hf")
        hf.close()
        del hf
        torch.cuda.empty_cache()
        report["megatron_over_hf"] = report["megatron"]["completion_tok_s"] / report["hf"]["completion_tok_s"]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
