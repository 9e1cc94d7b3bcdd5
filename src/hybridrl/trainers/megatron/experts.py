"""MoE experts as one grouped GEMM per projection, for megatron-core without Transformer Engine.

megatron-core 0.19's local spec runs experts with SequentialMLP, a Python loop of two GEMMs per expert (256
small kernels per layer for 128 experts); its grouped `GroupedMLP` is gone and `moe_grouped_gemm` needs TE.
GroupedExperts keeps every local expert's weights stacked in two parameters and multiplies all experts'
tokens at once with torch's grouped matmul (`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`).

Weight layout, per expert exactly as SequentialMLP's `local_experts.<e>` holds it on this TP rank:
    fc1_weight [E, 2 * ffn / tp, hidden]   rows [gate shard; up shard]  (linear_fc1.weight, column-parallel)
    fc2_weight [E, hidden, ffn / tp]                                   (linear_fc2.weight, row-parallel)
Like SequentialMLP with explicit expert communication, the module itself does no TP collective: the token
dispatcher gathers the tokens before and reduce-scatters the partial outputs after.

With `foreign_rows` (an expert-parallel dispatcher that keeps every token's rows, dispatch.py's masked) the rows
after the last local expert's belong to other ranks: the grouped kernel leaves them unwritten, in its output and in
its input's gradient, so they are masked to zero before and after each projection, which keeps whatever they hold
out of the outputs and of every gradient.

Where the grouped kernel cannot run (no such op in this torch, a dtype or device it does not take, or strides
that are not 16-byte multiples) the same weights go through an exact per-expert loop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from hybridrl.trainers import grouped_mm

GROUPED, LOOP = "grouped_mm", "loop"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward rejects expanded or
    strided gradients (a .sum() upstream gives stride 0), which its stride checks treat as an error."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GroupedExperts(MegatronModule):
    """Drop-in for SequentialMLP (same constructor and forward as MoELayer calls them), gated SiLU experts."""

    foreign_rows = False  # rows past the local experts' may come (dispatch.py's masked): they are masked out

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules: Any = None,
                 pg_collection: Any = None, name: str | None = None) -> None:
        super().__init__(config=config)
        if not config.gated_linear_unit or config.activation_func is not F.silu:
            raise ValueError("GroupedExperts implements gated SiLU (SwiGLU) experts only")
        if config.add_bias_linear or config.moe_apply_probs_on_input or config.moe_latent_size is not None:
            raise ValueError("GroupedExperts supports no expert biases, probs on input or latent MoE")
        if config.fp8 or config.fp4:
            raise ValueError("GroupedExperts runs in bf16/fp16/fp32, not fp8/fp4")
        tp_group = getattr(pg_collection, "expt_tp", None)
        tp = tp_group.size() if tp_group is not None else parallel_state.get_expert_tensor_parallel_world_size()
        ffn = config.moe_ffn_hidden_size
        if ffn % tp:
            raise ValueError(f"moe_ffn_hidden_size {ffn} does not split over expert TP {tp}")
        self.num_local_experts = num_local_experts
        self.ffn = ffn // tp
        hidden = config.hidden_size
        dev = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.fc1_weight = torch.nn.Parameter(torch.empty(num_local_experts, 2 * self.ffn, hidden,
                                                         dtype=config.params_dtype, device=dev))
        self.fc2_weight = torch.nn.Parameter(torch.empty(num_local_experts, hidden, self.ffn,
                                                         dtype=config.params_dtype, device=dev))
        if config.perform_initialization:
            with torch.no_grad():
                for e in range(num_local_experts):
                    config.init_method(self.fc1_weight[e])
                    config.output_layer_init_method(self.fc2_weight[e])
        # TP metadata as megatron's parallel linears set it (the fc1 stride 2: gate and up per rank)
        for p, dim, stride in ((self.fc1_weight, 1, 2), (self.fc2_weight, 2, 1)):
            p.tensor_model_parallel = tp > 1  # type: ignore[attr-defined]
            p.partition_dim = dim  # type: ignore[attr-defined]
            p.partition_stride = stride  # type: ignore[attr-defined]
            p.allreduce = False  # type: ignore[attr-defined]  # megatron's mark of an expert parameter

    def impl(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> str:
        """GROUPED or LOOP: what forward runs for weights on `device` in `dtype` (default: where they are)."""
        device = device or self.fc1_weight.device
        dtype = dtype or self.fc1_weight.dtype
        align = 16 // torch.empty((), dtype=dtype).element_size()
        # grouped_mm wants every operand's leading stride a multiple of 16 bytes: hidden, ffn/tp and 2*ffn/tp
        aligned = self.config.hidden_size % align == 0 and self.ffn % align == 0
        return GROUPED if aligned and grouped_mm.kernel_runs(device.type, dtype) else LOOP

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
        x = permuted_local_hidden_states
        if self.impl(x.device, x.dtype) == GROUPED and x.shape[0] > 0:
            # cumulative ends; the last equals the row count, so no output row is left unwritten. Made where the
            # counts are: hybridrl's dispatcher keeps them on the GPU, so the layer need not wait for it
            offs = tokens_per_expert.cumsum(0).to(device=x.device, dtype=torch.int32)
            if x.data_ptr() % 16:  # the kernel reads 16-byte aligned rows; a fresh copy is aligned
                x = x.clone()
            mm = grouped_mm.grouped_mm_fn()
            own = (torch.arange(x.shape[0], device=x.device) < offs[-1]).unsqueeze(-1) if self.foreign_rows else None
            # each kernel leaves the rows past offs[-1] unwritten going forward and, for its input's gradient, going
            # back: masking its input as well as its output keeps whatever those rows hold out of both directions
            h = _ContiguousGrad.apply(mm(self._own(own, x), self.fc1_weight.transpose(1, 2), offs=offs))
            h = self._own(own, self._activate(self._own(own, h), permuted_probs))
            out = self._own(own, _ContiguousGrad.apply(mm(h, self.fc2_weight.transpose(1, 2), offs=offs)))
            return out, None
        counts = tokens_per_expert.to("cpu", torch.int64)
        if not self.foreign_rows:
            return self.loop_forward(x, counts, permuted_probs), None
        n = int(counts.sum())
        out = self.loop_forward(x[:n], counts, permuted_probs[:n])
        return torch.cat([out, out.new_zeros(x.shape[0] - n, out.shape[-1])]), None

    @staticmethod
    def _own(own: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        """rows with those past the local experts' (own False) set to zero; all of them where own is None."""
        return rows if own is None else torch.where(own, rows, rows.new_zeros(()))

    def loop_forward(self, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The per-expert reference: SequentialMLP's arithmetic on the stacked weights."""
        sizes = counts.tolist()
        outs = []
        for e, (xe, pe) in enumerate(zip(x.split(sizes), probs.split(sizes), strict=True)):
            h = self._activate(xe @ self.fc1_weight[e].t(), pe)
            outs.append(h @ self.fc2_weight[e].t())
        return torch.cat(outs, dim=0)

    @staticmethod
    def _activate(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, scaled by the routing prob in the prob's dtype, then back (as megatron's MLP)."""
        gate, up = torch.chunk(h, 2, dim=-1)
        act = F.silu(gate) * up
        return (act * probs.unsqueeze(-1)).to(act.dtype)

    def backward_dw(self) -> None:
        """No delayed weight-gradient pass: gradients are computed in the ordinary backward."""


def experts_impl(model: torch.nn.Module) -> str | None:
    """What the model's MoE experts run (GROUPED or LOOP), from their weights' device and dtype; None if dense."""
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            return m.impl()
    return None
