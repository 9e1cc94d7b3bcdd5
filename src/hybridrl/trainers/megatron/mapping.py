"""HF <-> Megatron weight layout, as pure tensor functions (no process group needed).

Megatron fuses q, k and v into one column-parallel `linear_qkv` laid out per query group
([q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]) and each TP rank holds whole groups.
It fuses gate and up into `linear_fc1`, where each rank holds [its gate rows; its up rows], so the full
tensor interleaves gate/up per TP rank. Embedding and output layer are split along the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from hybridrl.trainers.megatron.spec import ArchSpec


class TensorSource(Protocol):
    def get(self, name: str) -> torch.Tensor: ...

    def __contains__(self, name: str) -> bool: ...


def shard(t: torch.Tensor, dim: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """The tp_rank-th of tp_size equal contiguous slices along dim."""
    if t.shape[dim] % tp_size:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split into {tp_size} shards")
    return t.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int,
                    tp_size: int = 1, tp_rank: int = 0) -> torch.Tensor:
    """HF q/k/v ([heads*d, ...], [groups*d, ...]) -> this rank's fused linear_qkv rows."""
    d = k.shape[0] // num_groups
    rest = q.shape[1:]
    per_group = torch.cat([q.reshape(num_groups, (num_heads // num_groups) * d, *rest),
                           k.reshape(num_groups, d, *rest),
                           v.reshape(num_groups, d, *rest)], dim=1)
    return shard(per_group, 0, tp_size, tp_rank).reshape(-1, *rest)


def qkv_from_megatron(shards: list[torch.Tensor], num_heads: int, num_groups: int,
                      head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused linear_qkv shards of all TP ranks (in rank order) -> HF q, k, v."""
    full = torch.cat(shards, dim=0)
    rest = full.shape[1:]
    qpg = num_heads // num_groups
    g = full.reshape(num_groups, (qpg + 2) * head_dim, *rest)
    q, k, v = g.split([qpg * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def gate_up_to_megatron(gate: torch.Tensor, up: torch.Tensor, tp_size: int = 1, tp_rank: int = 0) -> torch.Tensor:
    """HF gate/up [ffn, ...] -> this rank's linear_fc1 rows [gate shard; up shard]."""
    return torch.cat([shard(gate, 0, tp_size, tp_rank), shard(up, 0, tp_size, tp_rank)], dim=0)


def gate_up_from_megatron(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
    return torch.cat(gates, dim=0), torch.cat(ups, dim=0)


def _experts(src: TensorSource, layer: int, n_experts: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """Per-expert (gate, up, down) [out, in] from either checkpoint layout.

    transformers 5.x keeps Qwen3-MoE experts as fused 3-D tensors (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]); older checkpoints and some 5.x savers write one tensor per expert.
    """
    p = f"model.layers.{layer}.mlp.experts"
    if f"{p}.gate_up_proj" in src:
        gate_up = src.get(f"{p}.gate_up_proj")
        down = src.get(f"{p}.down_proj")
        if gate_up.shape[0] != n_experts:
            raise ValueError(f"{p}.gate_up_proj has {gate_up.shape[0]} experts, config says {n_experts}")
        hidden = down.shape[1]
        if gate_up.shape[1] == hidden and gate_up.shape[2] != hidden:  # stored [E, in, out]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)

        def fused(e: int) -> tuple[torch.Tensor, ...]:
            g, u = gate_up[e].chunk(2, dim=0)
            return g, u, down[e]
        return fused

    def split(e: int) -> tuple[torch.Tensor, ...]:
        return tuple(src.get(f"{p}.{e}.{n}_proj.weight") for n in ("gate", "up", "down"))
    return split


def local_experts(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """The experts EP rank ep_rank holds: a contiguous block of num_experts / ep_size, as megatron's MoELayer
    numbers its local experts (ep_rank * num_local + i)."""
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over expert parallelism {ep_size}")
    n = num_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)


def hf_to_megatron(spec: ArchSpec, src: TensorSource, tp_rank: int = 0, tp_size: int = 1,
                   ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Every Megatron parameter of this rank's shard, by Megatron name (of the experts, this EP rank's only)."""
    out: dict[str, torch.Tensor] = {}
    out["embedding.word_embeddings.weight"] = shard(src.get("model.embed_tokens.weight"), 0, tp_size, tp_rank)
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}", f"decoder.layers.{i}"
        out[f"{m}.input_layernorm.weight"] = src.get(f"{h}.input_layernorm.weight")
        out[f"{m}.pre_mlp_layernorm.weight"] = src.get(f"{h}.post_attention_layernorm.weight")
        q, k, v = (src.get(f"{h}.self_attn.{n}_proj.weight") for n in "qkv")
        out[f"{m}.self_attention.linear_qkv.weight"] = qkv_to_megatron(
            q, k, v, spec.num_heads, spec.num_kv_heads, tp_size, tp_rank)
        if spec.qkv_bias:
            qb, kb, vb = (src.get(f"{h}.self_attn.{n}_proj.bias") for n in "qkv")
            out[f"{m}.self_attention.linear_qkv.bias"] = qkv_to_megatron(
                qb, kb, vb, spec.num_heads, spec.num_kv_heads, tp_size, tp_rank)
        if spec.qk_norm:
            out[f"{m}.self_attention.q_layernorm.weight"] = src.get(f"{h}.self_attn.q_norm.weight")
            out[f"{m}.self_attention.k_layernorm.weight"] = src.get(f"{h}.self_attn.k_norm.weight")
        out[f"{m}.self_attention.linear_proj.weight"] = shard(
            src.get(f"{h}.self_attn.o_proj.weight"), 1, tp_size, tp_rank)
        if spec.layer_is_moe(i):
            out[f"{m}.mlp.router.weight"] = src.get(f"{h}.mlp.gate.weight")
            expert = _experts(src, i, spec.num_experts)
            fc1, fc2 = [], []
            for e in local_experts(spec.num_experts, ep_rank, ep_size):
                g, u, d = expert(e)
                fc1.append(gate_up_to_megatron(g, u, tp_size, tp_rank))
                fc2.append(shard(d, 1, tp_size, tp_rank))
            # GroupedExperts: all experts stacked, each as SequentialMLP's linear_fc1 / linear_fc2 would hold it
            out[f"{m}.mlp.experts.fc1_weight"] = torch.stack(fc1)
            out[f"{m}.mlp.experts.fc2_weight"] = torch.stack(fc2)
        else:
            out[f"{m}.mlp.linear_fc1.weight"] = gate_up_to_megatron(
                src.get(f"{h}.mlp.gate_proj.weight"), src.get(f"{h}.mlp.up_proj.weight"), tp_size, tp_rank)
            out[f"{m}.mlp.linear_fc2.weight"] = shard(src.get(f"{h}.mlp.down_proj.weight"), 1, tp_size, tp_rank)
    out["decoder.final_layernorm.weight"] = src.get("model.norm.weight")
    if not spec.tie_embeddings:
        out["output_layer.weight"] = shard(src.get("lm_head.weight"), 0, tp_size, tp_rank)
    return out


def megatron_to_hf(spec: ArchSpec, shards: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Inverse of hf_to_megatron: the state dicts of all TP ranks (rank order) -> HF names.

    MoE experts come back one tensor per expert (the older, per-expert checkpoint naming)."""
    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    first = shards[0]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0)}
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}", f"decoder.layers.{i}"
        out[f"{h}.input_layernorm.weight"] = first[f"{m}.input_layernorm.weight"]
        out[f"{h}.post_attention_layernorm.weight"] = first[f"{m}.pre_mlp_layernorm.weight"]
        names = [f"{m}.self_attention.linear_qkv.weight"] + (
            [f"{m}.self_attention.linear_qkv.bias"] if spec.qkv_bias else [])
        for name, suffix in zip(names, ("weight", "bias"), strict=False):
            q, k, v = qkv_from_megatron([s[name] for s in shards], spec.num_heads, spec.num_kv_heads,
                                        spec.head_dim)
            for n, t in zip("qkv", (q, k, v), strict=True):
                out[f"{h}.self_attn.{n}_proj.{suffix}"] = t
        if spec.qk_norm:
            out[f"{h}.self_attn.q_norm.weight"] = first[f"{m}.self_attention.q_layernorm.weight"]
            out[f"{h}.self_attn.k_norm.weight"] = first[f"{m}.self_attention.k_layernorm.weight"]
        out[f"{h}.self_attn.o_proj.weight"] = cat(f"{m}.self_attention.linear_proj.weight", 1)
        if spec.layer_is_moe(i):
            out[f"{h}.mlp.gate.weight"] = first[f"{m}.mlp.router.weight"]
            x = f"{m}.mlp.experts"
            for e in range(spec.num_experts):
                g, u = gate_up_from_megatron([s[f"{x}.fc1_weight"][e] for s in shards])
                out[f"{h}.mlp.experts.{e}.gate_proj.weight"] = g
                out[f"{h}.mlp.experts.{e}.up_proj.weight"] = u
                out[f"{h}.mlp.experts.{e}.down_proj.weight"] = torch.cat([s[f"{x}.fc2_weight"][e] for s in shards], 1)
        else:
            g, u = gate_up_from_megatron([s[f"{m}.mlp.linear_fc1.weight"] for s in shards])
            out[f"{h}.mlp.gate_proj.weight"] = g
            out[f"{h}.mlp.up_proj.weight"] = u
            out[f"{h}.mlp.down_proj.weight"] = cat(f"{m}.mlp.linear_fc2.weight", 1)
    out["model.norm.weight"] = first["decoder.final_layernorm.weight"]
    if not spec.tie_embeddings:
        out["lm_head.weight"] = cat("output_layer.weight", 0)
    return out


# LoRA: one adapter per HF projection. Where it sits in Megatron, and how its A is split over TP ranks.
#   column-parallel base (q, k, v, gate, up): A [r, in] split on dim 0 (r), B [out, r] split on dim 0
#   row-parallel base (o, down):              A [r, in] split on dim 1 (in), B [out, r] split on dim 0
LORA_SITES = {
    "q_proj": ("self_attention.linear_qkv", "self_attn", "column"),
    "k_proj": ("self_attention.linear_qkv", "self_attn", "column"),
    "v_proj": ("self_attention.linear_qkv", "self_attn", "column"),
    "o_proj": ("self_attention.linear_proj", "self_attn", "row"),
    "gate_proj": ("mlp.linear_fc1", "mlp", "column"),
    "up_proj": ("mlp.linear_fc1", "mlp", "column"),
    "down_proj": ("mlp.linear_fc2", "mlp", "row"),
}


def projection_dims(spec: ArchSpec, proj: str) -> tuple[int, int]:
    """(in_features, out_features) of an HF projection, unsplit."""
    h, d = spec.hidden_size, spec.head_dim
    return {"q_proj": (h, spec.num_heads * d), "k_proj": (h, spec.num_kv_heads * d),
            "v_proj": (h, spec.num_kv_heads * d), "o_proj": (spec.num_heads * d, h),
            "gate_proj": (h, spec.ffn_hidden_size), "up_proj": (h, spec.ffn_hidden_size),
            "down_proj": (spec.ffn_hidden_size, h)}[proj]


def lora_a_split_dim(proj: str) -> int:
    return 0 if LORA_SITES[proj][2] == "column" else 1


def peft_key(layer: int, proj: str, which: str) -> str:
    """Tensor name in a PEFT adapter_model.safetensors (no adapter name), e.g. ...q_proj.lora_A.weight."""
    return f"base_model.model.model.layers.{layer}.{LORA_SITES[proj][1]}.{proj}.lora_{which}.weight"
