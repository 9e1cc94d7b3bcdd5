"""LoRA on megatron-core's parallel linears, one adapter per HF projection, added to each base output by a
forward hook.

The adapters of one base linear (q/k/v on linear_qkv, gate/up on linear_fc1) run as one site: one matmul for
their stacked A, and one addmm that adds h @ B^T, with B the adapters' block diagonal arranged in the fused
layout and scaled, into the base output. Per-adapter matmuls, a scaled copy and a concatenation of each delta
and a separate add cost the host more launches than the GPU work they did (trainer-profile on an H200).
TP ranks hold these shards (the collectives are megatron's autograd mappings, plus _GatherLastDim):
  column-parallel base (x full, output split):
      A split on r: h = gather(x @ A^T), full r      B split on out, like the base output
  row-parallel base (x split on in, output all-reduced):
      A split on in: h = all-reduce(x @ A^T)         B split on out: gather(h @ B^T) is full width
h is used by every rank's own B shard, so its gradient is summed over the ranks (copy_to region) before the
gather's or the reduce's backward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from torch import nn

from hybridrl.trainers.megatron.mapping import LORA_SITES, lora_a_split_dim, projection_dims, shard
from hybridrl.trainers.megatron.spec import ArchSpec


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


class _Weight(nn.Module):
    """A bare `weight` parameter, so an adapter's tensors keep the names lora.A.weight and lora.B.weight."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.float32))


class LoraAdapter(nn.Module):
    """One projection's adapter: this TP rank's shards of A [r, in] and B [out, r], fp32 (the optimizer's
    copy); the site casts them to the activations' dtype, as autocast casts PEFT's."""

    def __init__(self, kind: str, in_features: int, out_features: int, rank: int, alpha: float, tp: int) -> None:
        super().__init__()
        self.kind = kind
        self.scaling = alpha / rank
        self.A = _Weight(rank // tp, in_features) if kind == "column" else _Weight(rank, in_features // tp)
        self.B = _Weight(out_features // tp, rank)


def _qkv_rows(groups: int, q_width: int, head_dim: int) -> torch.Tensor:
    """Rows of [q; k; v] (each rank's local shards, one after another) in linear_qkv's per-group order."""
    q_all, k_all = groups * q_width, groups * head_dim
    rows = []
    for j in range(groups):
        rows += range(j * q_width, (j + 1) * q_width)
        rows += range(q_all + j * head_dim, q_all + (j + 1) * head_dim)
        rows += range(q_all + k_all + j * head_dim, q_all + k_all + (j + 1) * head_dim)
    return torch.tensor(rows)


def _gathered_columns(n_adapters: int, rank: int, tp: int) -> torch.Tensor:
    """For each column of the gathered h (rank-major: every rank's r/tp of each adapter), its column in the
    adapters' block diagonal of B (adapter-major, each adapter's full r)."""
    part = rank // tp
    return torch.tensor([k * rank + i * part + m for i in range(tp) for k in range(n_adapters) for m in range(part)])


class LoraSite(nn.Module):
    """The adapters on one base linear, and how their outputs line up with the base's local output."""

    def __init__(self, kind: str, adapters: dict[str, LoraAdapter], widths: dict[str, int], rank: int,
                 row_order: torch.Tensor | None = None) -> None:
        super().__init__()
        self.kind = kind  # "column" or "row", as the base linear
        self.adapters = nn.ModuleDict(adapters)
        self.widths = widths  # every projection of the base's local output, in its order: adapted or not
        self.order = [p for p in widths if p in adapters]  # A's rows and B's blocks follow the output layout
        (self.scaling,) = {ad.scaling for ad in adapters.values()}
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        if kind == "row" and len(adapters) != 1:
            raise ValueError("a row-parallel base has one projection")
        cols = _gathered_columns(len(adapters), rank, self.tp) if kind == "column" and self.tp > 1 else None
        # index buffers move with the model (onload/offload); not part of any checkpoint
        self.register_buffer("row_order", row_order, persistent=False)
        self.register_buffer("col_order", cols, persistent=False)
        self.enabled = True

    def fused_a(self, dtype: torch.dtype) -> torch.Tensor:
        """[adapters x r (this rank's share), in]: the A shards stacked, in dtype."""
        a = [self.adapters[p].A.weight for p in self.order]
        return (torch.cat(a) if len(a) > 1 else a[0]).to(dtype)

    def fused_b(self, dtype: torch.dtype) -> torch.Tensor:
        """[local out, adapters x r]: the B shards as one block diagonal, zero rows for an unadapted projection,
        in the base's output layout, times the LoRA scaling, in dtype."""
        ref = next(iter(self.adapters.values())).B.weight
        blocks = [self.adapters[p].B.weight if p in self.adapters else ref.new_zeros(w, 0)
                  for p, w in self.widths.items()]
        b = torch.block_diag(*blocks) if len(blocks) > 1 else blocks[0]
        if self.row_order is not None:
            b = b.index_select(0, self.row_order)
        if self.col_order is not None:
            b = b.index_select(1, self.col_order)
        return (b * self.scaling).to(dtype)

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + the adapters' delta for input x ([s, b, in] -> [s, b, local out])."""
        x2 = x.reshape(-1, x.shape[-1])
        if self.tp > 1 and self.kind == "column":
            x2 = copy_to_tensor_model_parallel_region(x2)  # x is whole on every rank: its gradient sums theirs
        h = x2 @ self.fused_a(x.dtype).t()
        b = self.fused_b(x.dtype)
        if self.tp > 1:
            h = _GatherLastDim.apply(h) if self.kind == "column" else reduce_from_tensor_model_parallel_region(h)
            h = copy_to_tensor_model_parallel_region(h)
            if self.kind == "row":  # this rank's slice of the full-width output
                return out + _GatherLastDim.apply(h @ b.t()).view_as(out)
        return torch.addmm(out.reshape(-1, out.shape[-1]), h, b.t()).view_as(out)


def _hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
    site: LoraSite = module.lora  # type: ignore[assignment]
    if not site.enabled:
        return output
    out, bias = output
    return site.add_to(args[0], out), bias


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
    d = spec.head_dim
    adapters: dict[tuple[int, str], LoraAdapter] = {}
    for i, layer in enumerate(model.decoder.layers):
        sites: dict[str, dict[str, LoraAdapter]] = {}
        for proj in targets:
            path, _, kind = LORA_SITES[proj]
            if path.startswith("mlp.") and spec.layer_is_moe(i):
                continue
            fin, fout = projection_dims(spec, proj)
            ad = LoraAdapter(kind, fin, fout, rank, alpha, tp)
            with torch.no_grad():
                a = _full_a(seed, i, list(LORA_SITES).index(proj), rank, fin)
                ad.A.weight.copy_(shard(a, lora_a_split_dim(proj), tp, tp_rank))
                ad.B.weight.zero_()
            adapters[(i, proj)] = ad
            sites.setdefault(path, {})[proj] = ad
        for path, ads in sites.items():
            base = layer.get_submodule(path)
            if path.endswith("linear_qkv"):
                g = spec.num_kv_heads // tp
                qw = (spec.num_heads // spec.num_kv_heads) * d
                site = LoraSite("column", ads, {"q_proj": g * qw, "k_proj": g * d, "v_proj": g * d}, rank,
                                _qkv_rows(g, qw, d))
            elif path.endswith("linear_fc1"):
                n = spec.ffn_hidden_size // tp
                site = LoraSite("column", ads, {"gate_proj": n, "up_proj": n}, rank)
            else:
                (proj,) = ads
                site = LoraSite("row", ads, {proj: projection_dims(spec, proj)[1]}, rank)
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
