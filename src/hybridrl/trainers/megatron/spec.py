"""What the Megatron trainer needs to know about an HF checkpoint, and the checks that run before any
process starts. Imports neither megatron nor torch.distributed, so the controller can call it cheaply."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# HF projection names a LoRA adapter may target (PEFT's target_modules), one adapter per name
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# rope types whose inverse frequencies are fixed and carry no attention scaling
_ROPE_TYPES = ("default", "linear", "llama3")


class MegatronSetupError(ValueError):
    """Input the Megatron trainer cannot run with; the message names the cause."""


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    norm_eps: float
    rope: dict[str, Any]  # HF rope parameters (rope_type, rope_theta, ...)
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    # mixture of experts (qwen3_moe); moe_layers[i] says whether layer i is sparse
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = field(default_factory=tuple)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]


def _get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5.x keeps rope_theta inside rope_parameters; 4.x had rope_theta + rope_scaling
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_theta" not in rope:
        rope["rope_theta"] = cfg.get("rope_theta", 10000.0)
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def read_spec(model_dir: str | Path) -> ArchSpec:
    """Read config.json of an HF checkpoint; MegatronSetupError for anything this trainer cannot build."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise MegatronSetupError(f"{model_dir}: no config.json; expected a Hugging Face checkpoint directory")
    cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        archs = ", ".join(cfg.get("architectures") or []) or "unknown"
        raise MegatronSetupError(
            f"{model_dir}: model_type {model_type!r} ({archs}) is not supported by the Megatron trainer; "
            f"supported: {', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())}")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    rope = _rope(cfg)
    if rope["rope_type"] not in _ROPE_TYPES:
        raise MegatronSetupError(f"{model_dir}: rope_type {rope['rope_type']!r} is not supported "
                                 f"(supported: {', '.join(_ROPE_TYPES)})")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise MegatronSetupError(f"{model_dir}: attention_bias/mlp_bias on every projection is not supported")
    if cfg.get("use_sliding_window"):
        raise MegatronSetupError(f"{model_dir}: sliding-window attention is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise MegatronSetupError(f"{model_dir}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    kw: dict[str, Any] = dict(
        model_type=model_type,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_get(cfg, "head_dim", default=hidden // heads)),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        norm_eps=float(_get(cfg, "rms_norm_eps", default=1e-6)),
        rope=rope,
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", default=4096)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    if model_type == "qwen3_moe":
        n_exp = int(_get(cfg, "num_experts", "num_local_experts"))
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or [])
        kw.update(
            num_experts=n_exp,
            moe_topk=int(cfg["num_experts_per_tok"]),
            moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
            moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            moe_layers=tuple(i not in dense and n_exp > 0 and (i + 1) % step == 0
                             for i in range(kw["num_layers"])),
        )
    return ArchSpec(**kw)


ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def check_expert_parallel(spec: ArchSpec, ep: int) -> None:
    """train_ep: each of ep ranks holds num_experts / ep experts; everything else is replicated on every rank."""
    if ep < 1:
        raise MegatronSetupError(f"train_ep must be >= 1, got {ep}")
    if ep == 1:
        return
    if not spec.is_moe:
        raise MegatronSetupError(f"train_ep={ep}: expert parallelism splits the experts of a mixture-of-experts "
                                 f"model, and {spec.model_type} has none; use train_ep 1")
    if spec.num_experts % ep:
        raise MegatronSetupError(f"train_ep={ep} does not divide num_experts={spec.num_experts}; choose an EP size "
                                 "that does")


def effective_targets(spec: ArchSpec, targets: list[str] | tuple[str, ...]) -> list[str]:
    """The projections that actually get an adapter.

    For MoE models only attention: with transformers 5.x, PEFT turns gate/up/down targets of a Qwen3-MoE model
    into LoRA on the fused 3-D expert parameters (target_parameters), a layout the engines' LoRA loaders do
    not share, and it then leaves dense MLP layers unadapted. An attention-only adapter loads everywhere.
    """
    if not spec.is_moe:
        return list(targets)
    kept = [t for t in targets if t in ATTENTION_TARGETS]
    if not kept:
        raise MegatronSetupError(f"{spec.model_type}: LoRA on MoE models covers {', '.join(ATTENTION_TARGETS)} "
                                 f"only, and lora.target_modules {list(targets)} names none of them")
    return kept


def check_parallel(spec: ArchSpec, tp: int, lora_rank: int, target_modules: list[str] | tuple[str, ...],
                   ep: int = 1) -> None:
    """The sizes a TP degree and an expert-parallel degree must divide, and the LoRA settings this trainer
    supports."""
    if tp < 1:
        raise MegatronSetupError(f"train_tp must be >= 1, got {tp}")
    check_expert_parallel(spec, ep)
    for what, n in (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads),
                    ("vocab_size", spec.vocab_size), ("intermediate_size", spec.ffn_hidden_size)):
        if n % tp:
            raise MegatronSetupError(f"train_tp={tp} does not divide {what}={n}; choose a TP size that does")
    if spec.is_moe and tp > 1:
        raise MegatronSetupError(
            f"{spec.model_type}: mixture-of-experts models train at train_tp=1 only (megatron-core's MoE layer "
            "needs sequence parallelism at TP>1, which its non-Transformer-Engine norms do not support); shard them "
            "over GPUs with train_ep instead")
    if lora_rank < 1:
        raise MegatronSetupError(f"lora.rank must be >= 1, got {lora_rank}")
    if lora_rank % tp:
        raise MegatronSetupError(f"lora.rank={lora_rank} is not divisible by train_tp={tp} "
                                 "(LoRA A is split over TP ranks along the rank dimension)")
    bad = [t for t in target_modules if t not in LORA_TARGETS]
    if bad or not target_modules:
        raise MegatronSetupError(f"lora.target_modules {list(target_modules)}: the Megatron trainer adapts "
                                 f"only {', '.join(LORA_TARGETS)}")
