"""Model FLOPs of one GRPO update and the model FLOP utilisation (MFU) they give against the GPU's peak.

The count (also in README.md, "Trainer throughput and MFU"):

    FLOPs = passes x (2 x N_active x T  +  2 x L x n_heads x head_dim x sum_i s_i^2)

- T is every token the trainer runs (prompt + completion of every sample, no padding), s_i one sample's length;
- N_active is the parameters each token multiplies: per layer the attention projections (q, k, v, o) and
  the MLP, which for a mixture of experts is the router plus the top-k routed experts (and shared experts where
  the config has them), plus the output head (vocab x hidden); the embedding lookup is no matmul and counts 0;
- attention scores QK^T and the weighted sum AV cost 2 x 2 x n_heads x head_dim per query-key pair, half of the
  pairs under the causal mask: 2 x n_heads x head_dim x s^2 per layer;
- passes: 3 for the policy's forward and backward (backward = 2 x forward, the usual MFU convention, though
  LoRA skips the frozen weights' gradients), plus 1 for the reference forward when kl_coef > 0.
  LoRA's own matmuls (rank r << hidden) are left out.

These are the model's FLOPs, not the kernels': the trainers' chunked head (chunked_head.py) runs the output head at
the completion targets alone and computes its logits twice (in the forward and again in the backward), and the
count still takes the head at every token over the three passes. So it depends on the shape and the batch alone,
and MFU with and without the chunked head compares their update times.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl import gpu_specs


@dataclass(frozen=True)
class FlopShape:
    """What the FLOP count needs from a causal LM's config.json."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    mlp_params_per_layer: tuple[int, ...]  # active MLP parameters of each layer (routed top-k for MoE layers)

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies in one forward: attention and active MLP of every layer, output head."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return self.layers * (q_o + k_v) + sum(self.mlp_params_per_layer) + self.vocab * self.hidden


def moe_layers(cfg: dict[str, Any], layers: int) -> list[bool]:
    n_exp = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if n_exp == 0:
        return [False] * layers
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def flop_shape(cfg: dict[str, Any]) -> FlopShape:
    """From an HF config dict (llama, qwen2, qwen3, qwen3_moe, qwen2_moe)."""
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    mlp = []
    for moe in moe_layers(cfg, layers):
        if moe:
            n_exp = int(cfg.get("num_experts") or cfg.get("num_local_experts"))
            routed = 3 * hidden * int(cfg["moe_intermediate_size"]) * int(cfg["num_experts_per_tok"])
            shared = 3 * hidden * int(cfg.get("shared_expert_intermediate_size") or 0)
            gate = hidden if cfg.get("shared_expert_intermediate_size") else 0  # qwen2_moe's shared-expert gate
            mlp.append(hidden * n_exp + routed + shared + gate)
        else:
            mlp.append(3 * hidden * int(cfg["intermediate_size"]))  # gated MLP: gate, up, down
    return FlopShape(layers=layers, hidden=hidden, heads=heads,
                     kv_heads=int(cfg.get("num_key_value_heads") or heads),
                     head_dim=int(cfg.get("head_dim") or hidden // heads),
                     vocab=int(cfg["vocab_size"]), mlp_params_per_layer=tuple(mlp))


def read_flop_shape(model_dir: str | Path) -> FlopShape:
    return flop_shape(json.loads((Path(model_dir) / "config.json").read_text()))


def forward_flops(shape: FlopShape, seq_lens: Sequence[int]) -> float:
    """Model FLOPs of one forward over sequences of these lengths: the weights' matmuls and attention's."""
    forward = 2.0 * shape.active_params * sum(seq_lens)
    return forward + 2.0 * shape.layers * shape.heads * shape.head_dim * sum(float(s) ** 2 for s in seq_lens)


def update_flops(shape: FlopShape, seq_lens: Sequence[int], kl: bool = False) -> float:
    """Model FLOPs of one update over sequences of these lengths (prompt + completion each)."""
    return forward_flops(shape, seq_lens) * (3 + (1 if kl else 0))


def peak_flops(device_name: str | None) -> float | None:
    """The GPU's dense bf16 peak (hybridrl.gpu_specs); None for a CPU or a GPU not in the table."""
    found = gpu_specs.spec(device_name)
    return found.peak_bf16_flops if found else None


def device_name(device: Any) -> str | None:
    """torch's name of a CUDA device; None on CPU."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(dev)


def perf_metrics(flops: float, train_tokens: int, seconds: float, n_gpus: int,
                 device: str | None) -> dict[str, float]:
    """perf/mfu (NaN without a known peak: the record holds null), perf/train_tok_s and perf/train_tok_s_per_gpu
    over `seconds` of update (forward, backward, optimizer; no adapter export), and the FLOP count itself."""
    if seconds <= 0:
        return {"perf/mfu": math.nan, "perf/train_tok_s": math.nan, "perf/train_tok_s_per_gpu": math.nan,
                "perf/update_flops": flops}
    peak = peak_flops(device)
    gpus = max(n_gpus, 1)
    return {
        "perf/mfu": flops / seconds / (peak * gpus) if peak else math.nan,
        "perf/train_tok_s": train_tokens / seconds,
        "perf/train_tok_s_per_gpu": train_tokens / seconds / gpus,
        "perf/update_flops": flops,
    }


def update_perf(shape: FlopShape, samples: Sequence[Any], seconds: float, n_gpus: int, device: Any,
                kl: bool = False) -> dict[str, float]:
    """perf_metrics for one update over trainer Samples (completion tokens are the trained tokens)."""
    lens = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    trained = sum(len(s.completion_ids) for s in samples)
    return perf_metrics(update_flops(shape, lens, kl), trained, seconds, n_gpus, device_name(device))
