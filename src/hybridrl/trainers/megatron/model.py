"""A megatron-core GPTModel built from an HF checkpoint: local layer spec (no Transformer Engine), torch SDPA
as core attention, HF's RoPE frequencies, and weights loaded shard by shard for this TP rank.

parallel_state.initialize_model_parallel must have run before build_model()."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from safetensors import safe_open

from hybridrl.trainers.megatron import mapping, rope
from hybridrl.trainers.megatron.experts import GroupedExperts
from hybridrl.trainers.megatron.spec import ArchSpec
from hybridrl.trainers.packing import Packed, varlen_causal_attention


@dataclass
class PackedRows(PackedSeqParams):
    """A packed row in megatron's ordinary [s, b=1] layout (not 'thd', whose RoPE loops over the sequences):
    RoPE reads `positions` per token (HFRotaryEmbedding) and SDPACoreAttention keeps the sequences apart."""

    positions: torch.Tensor | None = None

    @classmethod
    def of(cls, packed: Packed) -> PackedRows:
        return cls(qkv_format="sbhd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
                   max_seqlen_q=packed.max_len, max_seqlen_kv=packed.max_len, positions=packed.positions[0])


class SDPACoreAttention(MegatronModule):
    """Causal attention through torch's scaled_dot_product_attention.

    Same call signature as megatron's local DotProductAttention, which materialises the full [b, n, s, s]
    score matrix; SDPA picks a fused kernel instead. Padded batches are right-padded, so the causal mask alone
    keeps real tokens from attending to padding; a packed row (PackedRows) gets variable-length attention.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: Any,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None, **_: Any) -> None:
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None,
                **_: Any) -> torch.Tensor:
        if attention_bias is not None or (packed_seq_params is not None
                                          and not isinstance(packed_seq_params, PackedRows)):
            raise NotImplementedError("SDPACoreAttention takes plain causal batches and PackedRows only")
        if packed_seq_params is not None:  # [N, 1, heads, dim], one packed row
            out = varlen_causal_attention(query[:, 0], key[:, 0], value[:, 0], packed_seq_params.cu_seqlens_q,
                                          packed_seq_params.max_seqlen_q, self.scale)
            return out.reshape(out.shape[0], 1, -1)
        # megatron layout [s, b, heads, dim] -> SDPA layout [b, heads, s, dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.heads != self.groups:
            rep = self.heads // self.groups
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             dropout_p=self.dropout if self.training else 0.0)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class CPUSafeTopKRouter(TopKRouter):
    """TopKRouter whose gating leaves the weight on the device it is on (upstream moves it to CUDA)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        from megatron.core.transformer.moe.moe_utils import router_gating_linear

        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return router_gating_linear(input, self.weight, self.bias, dtype)


def transformer_config(spec: ArchSpec, tp: int, dtype: torch.dtype, ep: int = 1) -> TransformerConfig:
    """megatron's config for this architecture at TP tp and expert parallelism ep (MoE only)."""
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        # built on the CPU and loaded from the checkpoint; moved to the device afterwards
        use_cpu_initialization=True,
        perform_initialization=False,
        # the fused kernels need apex/TE or CUDA
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        rotary_interleaved=False,
    )
    if spec.is_moe:
        kw.update(
            num_moe_experts=spec.num_experts,
            moe_router_topk=spec.moe_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_layer_freq=[1 if m else 0 for m in spec.moe_layers],
            # HF: softmax over all experts, top-k, renormalise if norm_topk_prob. Megatron's default
            # (top-k, then softmax over those k) equals the renormalised form; pre_softmax is the other.
            moe_router_pre_softmax=not spec.moe_norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            # each EP rank builds num_experts / ep of the experts (MoELayer reads the EP group's size and rank)
            expert_model_parallel_size=ep,
        )
    return TransformerConfig(**kw)


def _layer_spec(spec: ArchSpec, moe: bool) -> ModuleSpec:
    layer = get_gpt_layer_local_spec(num_experts=spec.num_experts if moe else None, moe_grouped_gemm=False,
                                     qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if moe:
        # the local MoE spec is partial(MoELayer, submodules=...); swap in the device-safe router and the
        # grouped-GEMM experts (the local spec's SequentialMLP loops over experts in Python)
        mlp = layer.submodules.mlp
        if mlp.func is not MoELayer:  # type: ignore[attr-defined]
            raise RuntimeError(f"unexpected MoE spec {mlp!r} from megatron-core")
        mlp.keywords["submodules"] = MoESubmodules(  # type: ignore[attr-defined]
            experts=GroupedExperts, shared_experts=None, router=CPUSafeTopKRouter)
    return layer


def _block_spec(spec: ArchSpec) -> TransformerBlockSubmodules:
    """One layer spec per layer, so MoE models with dense layers (mlp_only_layers) map one to one."""
    layers = [_layer_spec(spec, spec.layer_is_moe(i)) for i in range(spec.num_layers)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=layers[0].submodules.input_layernorm)


def build_model(spec: ArchSpec, tp: int, dtype: torch.dtype, ep: int = 1) -> GPTModel:
    """An uninitialised GPTModel (weights on the CPU) for this rank's TP shard and, at ep > 1, its experts."""
    rope.install()
    config = transformer_config(spec, tp, dtype, ep)
    model = GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(spec),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope["rope_theta"]),
    )
    # megatron's torch-norm fallback builds its RMSNorms in torch's default dtype (fp32); beside bf16 activations
    # torch.rms_norm then leaves its fused kernel for casts and five kernels a norm (trainer-profile, H200)
    for mod in model.modules():
        if isinstance(mod, torch.nn.RMSNorm):
            mod.to(dtype)
    emb = rope.HFRotaryEmbedding(kv_channels=spec.head_dim, rotary_percent=1.0, rotary_interleaved=False,
                                 rotary_base=int(spec.rope["rope_theta"]), use_cpu_initialization=True)
    # a buffer (upstream keeps a plain attribute), so .to(device) moves it with the model
    del emb.inv_freq
    emb.register_buffer("inv_freq", rope.hf_inv_freq(spec), persistent=False)
    model.rotary_pos_emb = emb
    return model


class HFCheckpoint:
    """Lazy tensor access to an HF safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        index = d / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {k: d / v for k, v in weight_map.items()}
        elif (d / "model.safetensors").exists():
            with safe_open(str(d / "model.safetensors"), "pt") as f:
                self.files = {k: d / "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{d}: no model.safetensors or model.safetensors.index.json")
        self._open: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def keys(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), "pt")
        return self._open[path].get_tensor(name)

    def close(self) -> None:
        self._open.clear()


@torch.no_grad()
def load_hf_weights(model: GPTModel, spec: ArchSpec, model_dir: str | Path, tp_rank: int, tp_size: int,
                    ep_rank: int = 0, ep_size: int = 1) -> None:
    """Copy this rank's shard of every checkpoint tensor into the model; every parameter must be set."""
    ckpt = HFCheckpoint(model_dir)
    try:
        wanted = dict(model.named_parameters())
        loaded = mapping.hf_to_megatron(spec, ckpt, tp_rank, tp_size, ep_rank, ep_size)
        missing = sorted(set(wanted) - set(loaded))
        extra = sorted(set(loaded) - set(wanted))
        if missing or extra:
            raise RuntimeError(f"weight mapping mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, tensor in loaded.items():
            param = wanted[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise RuntimeError(f"{name}: checkpoint shard {tuple(tensor.shape)} != model {tuple(param.shape)}")
            param.copy_(tensor.to(param.dtype))
    finally:
        ckpt.close()
