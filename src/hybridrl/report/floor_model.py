"""The physical floor of each phase of a step, from the model's shape and the GPU: the least time the hardware could
take for the bytes and FLOPs the phase cannot avoid.

- Decode: each token step reads the weights it multiplies and the KV cache of every sequence still running (a
  group's shared prompt once: its completions are consecutive requests), over the HBM bandwidth; or, where that is
  less, its FLOPs over the bf16 peak (the larger of the two is the step's floor).
  At TP > 1 a GPU reads its shard of the weights (1/TP) and of the KV heads (ceil(kv_heads / TP)).
  A mixture of experts reads, per layer, the experts that some sequence of the step routes to: with B sequences each
  picking top-k of E experts independently and uniformly, E x (1 - (1 - k/E)^B) of them on average (the
  assumption: uniform routing; a router that favours a few experts reads fewer).
- Prefill: the prompts' FLOPs over the peak (each group's prompt once: its completions share it through the prefix
  cache), and at least one read of the weights.
- Update: the recorded perf/update_flops over the peak of the trainer's GPUs (the inverse of MFU).
- Copies: the bytes a phase moves between host and device over the bandwidth measured at the run's start.
Weights are bf16 (2 bytes), LoRA weights and their AdamW moments fp32 (4 bytes each); norms and biases are left out
(under 0.1% of these models' parameters), which keeps every figure a floor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from hybridrl.trainers.flops import FlopShape, flop_shape, forward_flops, moe_layers

BF16, FP32 = 2, 4
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape(FlopShape):
    """What the floors need from a causal LM's config.json (llama, qwen2, qwen3, qwen3_moe): the FLOP count's
    shape (its active_params per token among it) and what the weights' and KV cache's bytes need besides."""

    tied: bool
    intermediate: int  # dense MLP width
    moe: tuple[bool, ...]  # per layer: sparse (experts) or dense
    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int

    @property
    def attention_params(self) -> int:
        return 2 * self.hidden * self.head_dim * (self.heads + self.kv_heads)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    def _sparse_fixed(self) -> int:
        """A sparse layer's MLP parameters every token reads: the router and any shared expert (and its gate)."""
        shared = 3 * self.hidden * self.shared_intermediate + (self.hidden if self.shared_intermediate else 0)
        return self.hidden * self.experts + shared

    def mlp_params(self, experts_read: float | None = None) -> float:
        """MLP parameters of all layers: every expert (experts_read None), or that many experts per sparse layer."""
        dense = 3 * self.hidden * self.intermediate
        n = self.experts if experts_read is None else experts_read
        return sum(self._sparse_fixed() + n * self.expert_params if m else dense for m in self.moe)

    @property
    def weight_params(self) -> int:
        """Every weight the engine or the trainer holds: embedding, layers (all experts), output head."""
        head = 0 if self.tied else self.vocab * self.hidden
        return int(self.vocab * self.hidden + head + self.layers * self.attention_params + self.mlp_params())

    def decode_params(self, batch: float) -> float:
        """Weights one decode step of `batch` sequences reads: attention, the MLPs (experts routed to) and the
        head; the embedding lookup reads a row a token (nothing to speak of)."""
        return self.layers * self.attention_params + self.mlp_params(self.experts_read(batch)) \
            + self.vocab * self.hidden

    def experts_read(self, batch: float) -> float:
        """Distinct experts a sparse layer reads for `batch` sequences of one step, under uniform routing."""
        if not self.experts:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** batch)

    def kv_bytes_per_token(self, tp: int) -> int:
        """K and V of one token over every layer, on one GPU of TP (KV heads split, at least one a GPU)."""
        return 2 * self.layers * math.ceil(self.kv_heads / tp) * self.head_dim * BF16

    def lora_params(self, modules: Sequence[str], rank: int) -> int | None:
        """LoRA A and B of every targeted module of every layer (rank x (in + out)); None for a module it cannot
        size."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        sizes = {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                 "o_proj": (q, self.hidden)}
        total = 0
        for name in modules:
            if name in sizes:
                total += self.layers * rank * sum(sizes[name])
            elif name in MLP_MODULES:  # per dense layer, and per expert of a sparse one
                for sparse in self.moe:
                    width, copies = (self.expert_intermediate, self.experts) if sparse else (self.intermediate, 1)
                    total += copies * rank * (self.hidden + width)
            else:
                return None
        return total


def shape_of(cfg: Mapping[str, Any]) -> Shape:
    """From a config.json's shape keys (KeyError for one it lacks)."""
    fs = flop_shape(dict(cfg))
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    sparse = moe_layers(dict(cfg), fs.layers)
    return Shape(**{f.name: getattr(fs, f.name) for f in fields(FlopShape)},
                 tied=bool(cfg.get("tie_word_embeddings", False)),
                 intermediate=int(cfg.get("intermediate_size") or 0), moe=tuple(sparse), experts=experts,
                 top_k=int(cfg.get("num_experts_per_tok") or 0),
                 expert_intermediate=int(cfg.get("moe_intermediate_size") or 0),
                 shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0))


@dataclass(frozen=True)
class Gen:
    """A rollout's floor: its prefill and its decode steps, in seconds, and what they rest on."""

    prefill_s: float
    decode_s: float
    decode_steps: int
    bytes_per_step: float  # mean over the decode steps, one GPU

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


def gen_floor(shape: Shape, prompts: Sequence[int], completions: Sequence[int], group_size: int, tp: int,
              hbm: float, peak: float) -> Gen:
    """The floor of one rollout of these requests (prompt and completion tokens each) on one GPU of TP."""
    groups = max(group_size, 1)
    prefill_flops = forward_flops(shape, prompts) / groups
    prefill = max(prefill_flops / tp / peak, shape.decode_params(len(prompts)) * BF16 / tp / hbm)
    kv_token = shape.kv_bytes_per_token(tp)
    attention = 4.0 * shape.layers * shape.heads * shape.head_dim / tp  # QK^T and AV per context token
    decode = total_bytes = 0.0
    steps = max(completions, default=0) - 1  # the first token of each comes out of the prefill
    for t in range(1, steps + 1):
        live = [i for i, c in enumerate(completions) if c > t]
        context = sum(prompts[i] + t for i in live)  # every query attends to its whole context
        # the KV read: each sequence's own tokens, and its group's shared prompt once (a kernel may share it)
        kv_read = len(live) * t + sum(prompts[g * groups] for g in {i // groups for i in live})
        step_bytes = shape.decode_params(len(live)) * BF16 / tp + kv_read * kv_token
        step_flops = 2.0 * shape.active_params * len(live) / tp + attention * context
        decode += max(step_bytes / hbm, step_flops / peak)
        total_bytes += step_bytes
    return Gen(prefill, decode, max(steps, 0), total_bytes / steps if steps > 0 else 0.0)
