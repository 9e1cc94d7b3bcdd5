"""Megatron + LoRA against HF + PEFT on the same checkpoint, adapter and batch.

Used by the CPU tests (gloo, TP = 1 and 2, and EP = 2 for the MoE) and runnable on a GPU box:
    python -m hybridrl.tools.megatron_parity --tp 2 [--device cuda] [--archs llama,qwen3] WORKDIR
    python -m hybridrl.tools.megatron_parity --ep 2 --archs qwen3_moe WORKDIR
Each side reports per-token logprobs before the update, the LoRA gradients (full tensors under PEFT names),
the weights and logprobs after one AdamW step, and (Megatron) the exported adapter, which HF + PEFT
reloads to reproduce the logits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hybridrl.engines.server import free_port
from hybridrl.study.run_config import RunConfig
from hybridrl.task.rl import policy_loss, token_logprobs_entropy
from hybridrl.trainers.base import Sample
from hybridrl.trainers.grpo import Batch, pad_batch
from hybridrl.trainers.packing import pack

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")


def tiny_checkpoint(kind: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random HF model (hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 128) in fp32."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=128, intermediate_size=96,
                                  max_position_embeddings=256, initializer_range=0.05)
    if kind == "llama":
        cfg = LlamaConfig(**common, **overrides)
    elif kind == "qwen2":
        cfg = Qwen2Config(**common, **overrides)  # q/k/v biases
    elif kind == "qwen3":
        # head_dim != hidden / heads and tied embeddings, as in the small Qwen3 models
        cfg = Qwen3Config(**common, **{"head_dim": 24, "tie_word_embeddings": True, **overrides})
    elif kind == "qwen3_moe":
        # layer 1 dense, so both MoE and dense MLPs are covered
        cfg = Qwen3MoeConfig(**common, **{"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 32, "norm_topk_prob": True,
                                          "mlp_only_layers": [1], **overrides})
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if kind == "qwen2":  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.normal_(0, 0.05)
    model.save_pretrained(path)
    return path


def default_run(tp: int = 1, ep: int = 1, **over: Any) -> RunConfig:
    return RunConfig.model_validate({
        "model": "parity", "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0}, "lr": 1e-2, "weight_decay": 0.01,
        "clip_eps": 0.2, "kl_coef": 0.05, "grad_clip": 1.0, "seed": 0, "train_tp": tp, "train_ep": ep,
        "device": "cpu", "micro_batch": 4, **over})


def random_adapter(model_dir: Path, adapter_dir: Path, run: RunConfig, seed: int = 1) -> Path:
    """A PEFT adapter with random A and B (B = 0 would hide A's gradients), on the projections the Megatron
    trainer adapts for this model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hybridrl.trainers.megatron.spec import effective_targets, read_spec

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = run.lora
    torch.manual_seed(seed)
    targets = effective_targets(read_spec(model_dir), list(lora.target_modules))
    cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                     target_modules=targets, init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    model.save_pretrained(adapter_dir)
    return adapter_dir


def make_samples(vocab: int, n: int = 6, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(3, 7), rng.randint(2, 6)
        out.append(Sample(prompt_ids=[rng.randrange(vocab) for _ in range(p)],
                          completion_ids=[rng.randrange(vocab) for _ in range(c)],
                          engine_logprobs=[-rng.uniform(3.0, 6.0) for _ in range(c)],
                          advantage=rng.gauss(0.0, 1.0)))
    return out


def _per_sample(logp: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [logp[i][mask[i]].detach().float().cpu() for i in range(logp.shape[0])]


def _peft_name(name: str) -> str:
    return name.replace(".default", "")


def hf_logits(model_dir: Path, adapter_dir: Path, samples: list[Sample]) -> torch.Tensor:
    """Logits [B, T-1, V] of HF + the PEFT adapter loaded from disk (right-padded batch)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    batch = pad_batch(samples)
    ids, attn = batch.ids, batch.attention
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()


def hf_side(model_dir: Path, adapter_dir: Path, samples: list[Sample], run: RunConfig) -> dict[str, Any]:
    """The reference: HF + PEFT, whole batch at once, torch AdamW."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    params = {_peft_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=run.lr, weight_decay=run.weight_decay)
    batch = pad_batch(samples)
    ids, attn, mask = batch.ids, batch.attention, batch.mask

    def logprobs(entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_logprobs_entropy(model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:],
                                      entropy=entropy)

    model.train()
    logp, entropy = logprobs(entropy=True)
    ref = None
    if run.kl_coef > 0:
        with torch.no_grad(), model.disable_adapter():
            ref, _ = logprobs()
    adv = torch.tensor([s.advantage for s in samples])
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, run.clip_eps, ref, run.kl_coef)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), run.grad_clip))
    opt.step()
    with torch.no_grad():
        after, _ = logprobs()
    return {"logp": _per_sample(logp, mask), "grads": grads, "grad_norm": norm, "loss": float(loss),
            "kl": float(stats["train/kl"]), "entropy": float((entropy * mask).sum() / mask.sum()),
            "weights_after": {n: p.detach().clone() for n, p in params.items()},
            "logp_after": _per_sample(after, mask)}


def megatron_side(model_dir: Path, adapter_dir: Path, samples: list[Sample], run: RunConfig,
                  export_dir: Path, device: torch.device | None = None) -> dict[str, Any]:
    """Same as hf_side on Megatron (parallel state must be initialised); every rank returns full tensors."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hybridrl.trainers.megatron import export
    from hybridrl.trainers.megatron.policy import MegatronPolicy

    device = device or torch.device("cpu")
    policy = MegatronPolicy(model_dir, run.model_copy(update={"train_dtype": "fp32"}), device)
    policy.resume(adapter_dir)
    padded = pad_batch(samples)
    batch = replace(padded, packed=pack(samples) if run.pack_sequences else None).to(device)
    padded = padded.to(device)
    inputs, mask = batch.inputs, batch.mask

    def per_sample(b: Batch = batch) -> list[torch.Tensor]:
        with torch.no_grad():
            return _per_sample(policy.logprobs(b)[0], mask)

    before = per_sample()
    before_padded = per_sample(padded)  # the other layout: packed and padded forwards agree
    metrics = policy.backward(samples)
    names = [n for n, _, _ in export._entries(policy.adapters)]
    grads = export.gather_full(policy.adapters, {n: p.grad for n, (_, p, _) in
                                                 zip(names, export._entries(policy.adapters), strict=True)})
    grads = {k: v.cpu() for k, v in grads.items()}
    norm = policy.optimizer_step()
    after = per_sample()
    policy.save(export_dir)
    policy.flush()
    with torch.no_grad():
        b, t = inputs.shape
        pos = torch.arange(t, device=device).expand(b, t)
        logits = policy.model(input_ids=inputs, position_ids=pos, attention_mask=None)
    if policy.tp > 1:
        parts = [torch.empty_like(logits) for _ in range(policy.tp)]
        dist.all_gather(parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return {"logp": before, "logp_padded": before_padded, "grads": grads, "grad_norm": norm,
            "loss": metrics["train/loss"], "entropy": metrics["train/entropy"],
            "kl": metrics["train/kl"], "weights_after": export.gather_full(policy.adapters),
            "logp_after": after, "logits_after": logits.float().cpu(), "experts_impl": policy.experts_impl,
            "ep": policy.ep, "local_experts": _local_experts(policy), "masked_rows": _masked_rows(policy),
            "split": policy.split}


def _masked_rows(policy: Any) -> list[bool]:
    """Whether each MoE layer's dispatcher keeps every token's rows (ep_dispatch masked)."""
    return [bool(getattr(m.token_dispatcher, "masked", False)) for m in policy.model.modules()
            if hasattr(m, "token_dispatcher")]


def _local_experts(policy: Any) -> int | None:
    """How many experts the first MoE layer holds on this rank (None for a dense model)."""
    from hybridrl.trainers.megatron.experts import GroupedExperts

    return next((m.num_local_experts for m in policy.model.modules() if isinstance(m, GroupedExperts)), None)


def reload_gap(model_dir: Path, adapter_dir: Path, samples: list[Sample], logits: torch.Tensor) -> float:
    """Worst logit gap, over real (non-padding) positions, between HF + the exported adapter and Megatron."""
    reload = hf_logits(model_dir, adapter_dir, samples)
    valid = pad_batch(samples).attention[:, 1:].bool()  # input position t is real iff token t+1 exists
    return float((reload - logits)[valid].abs().max())


def compare(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    """Worst absolute logprob gaps, worst relative gradient error, worst weight gap after the step."""
    def logp_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))

    if set(ref["grads"]) != set(got["grads"]):
        raise AssertionError(f"adapter tensors differ: only HF {sorted(set(ref['grads']) - set(got['grads']))[:3]}, "
                             f"only Megatron {sorted(set(got['grads']) - set(ref['grads']))[:3]}")
    rel = max(float((got["grads"][k] - g).norm() / g.norm().clamp(min=1e-12)) for k, g in ref["grads"].items())
    return {"logp": logp_gap(ref["logp"], got["logp"]), "grad_rel": rel,
            "grad_norm_rel": abs(got["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-12),
            "loss": abs(got["loss"] - ref["loss"]), "entropy": abs(got["entropy"] - ref["entropy"]),
            **weight_gaps(ref, got),
            "logp_after": logp_gap(ref["logp_after"], got["logp_after"])}


# AdamW's first step moves an entry by lr * g / (|g| + eps), eps 1e-8. Where the reference gradient is within 100 eps
# of zero, fp32 rounding of the sum that makes g (about 1e-10 either way) decides that step, up to lr of it: such
# entries are held only to the step's own bound, every other entry to a tight one
NEAR_ZERO_GRAD = 1e-6


def weight_gaps(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    """Worst weight gap after the step over entries whose reference gradient is clear of zero (weights_after),
    over the rest (weights_after_near_zero_grad), and the share of entries in the first set."""
    clear_gap = near_gap = 0.0
    clear = total = 0
    for k, v in ref["weights_after"].items():
        diff = (got["weights_after"][k] - v).abs()
        held = ref["grads"][k].abs() > NEAR_ZERO_GRAD
        clear, total = clear + int(held.sum()), total + held.numel()
        clear_gap = max(clear_gap, float(diff[held].max()) if held.any() else 0.0)
        near_gap = max(near_gap, float(diff[~held].max()) if (~held).any() else 0.0)
    return {"weights_after": clear_gap, "weights_after_near_zero_grad": near_gap,
            "weights_clear_share": clear / max(total, 1)}


def _group_main(rank: int, tp: int, port: int, cases: list[dict[str, Any]], out_path: str,
                device_type: str = "cpu", ep: int = 1) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=tp * ep)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             create_gloo_process_groups=False)
    try:
        results = {}
        for case in cases:
            results[case["name"]] = megatron_side(Path(case["model_dir"]), Path(case["adapter_dir"]),
                                                  case["samples"], case["run"], Path(case["export_dir"]), device)
        if rank == 0:
            torch.save(results, out_path)
        elif ep > 1:  # EP ranks are replicas of everything but the experts: the last one's results beside rank 0's
            torch.save(results, f"{out_path}.rank{rank}")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_megatron_group(tp: int, cases: list[dict[str, Any]], out_path: Path,
                       device_type: str = "cpu", ep: int = 1) -> dict[str, Any]:
    """megatron_side for each case in a fresh group of tp x ep processes: gloo on the CPU, NCCL on GPUs
    (CPU with tp x ep == 1: in this process). At ep > 1 the other ranks' results are at out_path.rank<R>."""
    if tp * ep == 1 and device_type == "cpu":
        _group_main(0, 1, free_port(), cases, str(out_path))
    else:
        import torch.multiprocessing as mp

        mp.start_processes(_group_main, args=(tp, free_port(), cases, str(out_path), device_type, ep),
                           nprocs=tp * ep, start_method="spawn", join=True)
    return torch.load(out_path, weights_only=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE archs only; with --tp 1)")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where Megatron runs (fp32 either way)")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    cases, refs = [], {}
    for arch in args.archs.split(","):
        d = args.workdir / arch
        run = default_run(args.tp, args.ep)
        tiny_checkpoint(arch, d / "model")
        random_adapter(d / "model", d / "adapter", run)
        samples = make_samples(128)
        refs[arch] = hf_side(d / "model", d / "adapter", samples, run)
        cases.append({"name": arch, "model_dir": str(d / "model"), "adapter_dir": str(d / "adapter"),
                      "samples": samples, "run": run, "export_dir": str(d / f"export-tp{args.tp}-ep{args.ep}")})
    got = run_megatron_group(args.tp, cases, args.workdir / f"megatron-tp{args.tp}-ep{args.ep}.pt", args.device,
                             args.ep)
    report = {}
    for case in cases:
        name = case["name"]
        report[name] = compare(refs[name], got[name])
        report[name]["reload_logits"] = reload_gap(Path(case["model_dir"]), Path(case["export_dir"]),
                                                   case["samples"], got[name]["logits_after"])
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
