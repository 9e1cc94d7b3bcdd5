"""LoRA on megatron-core's own parallel linears, one adapter per HF projection.

Each adapter is built from megatron's ColumnParallelLinear/RowParallelLinear, so the TP collectives that
make forward and backward exact live inside megatron's autograd functions and nothing is synced by hand:
  column-parallel base (x full, output split):
      A = ColumnParallelLinear(in -> r), then gather     A split on r, output gathered to full r
      B = ColumnParallelLinear(r -> out)                 B split on out, like the base output
  row-parallel base (x split on in, output all-reduced):
      A = RowParallelLinear(in -> r)                     A split on in, output all-reduced to full r
      B = ColumnParallelLinear(r -> out), then gather    B split on out, output gathered to full out
An adapter's output is added to the base output by a forward hook; for the fused linear_qkv and
linear_fc1 the q/k/v (gate/up) deltas are first arranged in the fused per-rank layout.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch import nn
from torch.nn import functional as F

from hybridrl.trainers.megatron.mapping import LORA_SITES, lora_a_split_dim, shard
from hybridrl.trainers.megatron.spec import ArchSpec


def _no_init(_: torch.Tensor) -> None:  # weights are set explicitly after construction
    return None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim over the TP group; backward keeps this rank's slice.

    megatron's gather_from_tensor_model_parallel_region does the same but allocates its buffer on
    torch.cuda.current_device(), which fails with gloo on the CPU; list all_gather works on both backends."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(x) for _ in range(group.size())]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        tp = parallel_state.get_tensor_model_parallel_world_size()
        return grad.chunk(tp, dim=-1)[parallel_state.get_tensor_model_parallel_rank()].contiguous()


def _gather(x: torch.Tensor) -> torch.Tensor:
    return x if parallel_state.get_tensor_model_parallel_world_size() == 1 else _GatherLastDim.apply(x)


class LoraAdapter(nn.Module):
    def __init__(self, kind: str, in_features: int, out_features: int, rank: int, alpha: float,
                 config: object) -> None:
        super().__init__()
        self.kind = kind
        self.scaling = alpha / rank
        if kind == "column":
            self.A = ColumnParallelLinear(in_features, rank, config=config, init_method=_no_init, bias=False)
        else:
            self.A = RowParallelLinear(in_features, rank, config=config, init_method=_no_init, bias=False,
                                       input_is_parallel=True, skip_bias_add=True)
        self.B = ColumnParallelLinear(rank, out_features, config=config, init_method=_no_init, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the weights stay fp32 (the optimizer's copy); the matmuls run in the activations' dtype, as autocast runs
        # PEFT's: casting each [tokens, hidden] input up to fp32 instead cost more than the matmuls and put them on
        # fp32 kernels (trainer-profile, H200, 2026-11-24)
        wa, wb = self.A.weight.to(x.dtype), self.B.weight.to(x.dtype)
        if self.kind == "column":
            h, _ = self.A(x, weight=wa)
            h = _gather(h)  # full r for every rank's B shard
        else:  # RowParallelLinear's forward with input_is_parallel, on the cast weight
            h = reduce_from_tensor_model_parallel_region(F.linear(x, wa))
        y, _ = self.B(h, weight=wb)
        if self.kind == "row":
            y = _gather(y)  # the row-parallel base output is full width
        return y * self.scaling


class LoraSite(nn.Module):
    """The adapters on one base linear, and how their outputs line up with the base's local output."""

    def __init__(self, fused: str, adapters: dict[str, LoraAdapter], local_sizes: dict[str, int],
                 group_split: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        self.fused = fused  # "qkv", "gate_up" or "single"
        self.adapters = nn.ModuleDict(adapters)
        self.local_sizes = local_sizes  # per projection, the base's local output width
        self.group_split = group_split  # qkv: (local groups, q width per group, head dim)
        self.enabled = True

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        def part(proj: str) -> torch.Tensor:
            if proj in self.adapters:
                return self.adapters[proj](x)
            return x.new_zeros(*x.shape[:-1], self.local_sizes[proj])

        if self.fused == "qkv":
            g, qw, d = self.group_split  # type: ignore[misc]
            q, k, v = (part(p) for p in ("q_proj", "k_proj", "v_proj"))
            lead = q.shape[:-1]
            return torch.cat([q.reshape(*lead, g, qw), k.reshape(*lead, g, d), v.reshape(*lead, g, d)],
                             dim=-1).reshape(*lead, -1)
        if self.fused == "gate_up":
            return torch.cat([part("gate_proj"), part("up_proj")], dim=-1)
        (only,) = self.adapters.values()
        return only(x)


def _hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
    site: LoraSite = module.lora  # type: ignore[assignment]
    if not site.enabled:
        return output
    out, bias = output
    return out + site.delta(args[0]).to(out.dtype), bias


def _lora_config(config: object) -> object:
    # adapters keep fp32 weights whatever the base dtype; LoraAdapter.forward computes in the input's dtype
    cfg = copy.copy(config)
    cfg.params_dtype = torch.float32  # type: ignore[attr-defined]
    cfg.bf16 = False  # type: ignore[attr-defined]
    cfg.fp16 = False  # type: ignore[attr-defined]
    return cfg


def _full_a(seed: int, layer: int, proj_index: int, rank: int, in_features: int) -> torch.Tensor:
    """PEFT's default A init (kaiming_uniform, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), made on every rank
    from the same seed and then split, so the adapter does not depend on the TP size."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + proj_index)
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=gen, dtype=torch.float32) * 2 - 1) * bound


def apply_lora(model: nn.Module, spec: ArchSpec, rank: int, alpha: float, targets: list[str] | tuple[str, ...],
               seed: int = 0) -> dict[tuple[int, str], LoraAdapter]:
    """Attach adapters (A init as PEFT, B = 0) and freeze every base parameter.

    Returns {(layer index, HF projection): adapter}. MoE experts get none: transformers 5.x keeps them as
    fused 3-D parameters that PEFT's target_modules do not match, so the engines would not apply them.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cfg = _lora_config(model.config)
    h, d = spec.hidden_size, spec.head_dim
    full = {"q_proj": (h, spec.num_heads * d), "k_proj": (h, spec.num_kv_heads * d),
            "v_proj": (h, spec.num_kv_heads * d), "o_proj": (spec.num_heads * d, h),
            "gate_proj": (h, spec.ffn_hidden_size), "up_proj": (h, spec.ffn_hidden_size),
            "down_proj": (spec.ffn_hidden_size, h)}
    adapters: dict[tuple[int, str], LoraAdapter] = {}
    for i, layer in enumerate(model.decoder.layers):
        sites: dict[str, dict[str, LoraAdapter]] = {}
        for proj in targets:
            path, _, kind = LORA_SITES[proj]
            if path.startswith("mlp.") and spec.layer_is_moe(i):
                continue
            fin, fout = full[proj]
            ad = LoraAdapter(kind, fin, fout, rank, alpha, cfg)
            with torch.no_grad():
                a = _full_a(seed, i, list(full).index(proj), rank, fin)
                ad.A.weight.copy_(shard(a, lora_a_split_dim(proj), tp, tp_rank))
                ad.B.weight.zero_()
            adapters[(i, proj)] = ad
            sites.setdefault(path, {})[proj] = ad
        for path, ads in sites.items():
            base = layer.get_submodule(path)
            if path.endswith("linear_qkv"):
                g = spec.num_kv_heads // tp
                qw = (spec.num_heads // spec.num_kv_heads) * d
                site = LoraSite("qkv", ads, {"q_proj": g * qw, "k_proj": g * d, "v_proj": g * d}, (g, qw, d))
            elif path.endswith("linear_fc1"):
                n = spec.ffn_hidden_size // tp
                site = LoraSite("gate_up", ads, {"gate_proj": n, "up_proj": n})
            else:
                site = LoraSite("single", ads, {})
            base.add_module("lora", site)
            base.register_forward_hook(_hook)
    return adapters


def lora_parameters(adapters: dict[tuple[int, str], LoraAdapter]) -> list[nn.Parameter]:
    return [p for ad in adapters.values() for p in (ad.A.weight, ad.B.weight)]


@contextlib.contextmanager
def lora_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone (the KL reference policy)."""
    sites = [m for m in model.modules() if isinstance(m, LoraSite)]
    for s in sites:
        s.enabled = False
    try:
        yield
    finally:
        for s in sites:
            s.enabled = True
