"""One TP rank's share of the policy: the Megatron model with LoRA, AdamW on the adapters, the GRPO step,
export, and offload to pinned CPU memory. Needs torch.distributed and megatron's model-parallel state."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from hybridrl import nvml
from hybridrl.engines.gpus import nvml_indices, visible_devices
from hybridrl.study.run_config import RunConfig
from hybridrl.task.rl import LOGSOFTMAX_CHUNK_BYTES, logit_chunks, token_logprobs_entropy
from hybridrl.trainers import update_memory
from hybridrl.trainers.adapter_files import HostStaging, StateWriter, write_adapter_dir
from hybridrl.trainers.base import Sample, lora_b_norm
from hybridrl.trainers.chunked_head import completion_logprobs
from hybridrl.trainers.flops import read_flop_shape, update_perf
from hybridrl.trainers.grpo import Batch, grpo_backward, split_batch
from hybridrl.trainers.megatron import export
from hybridrl.trainers.megatron.comms import ReloadableGroups
from hybridrl.trainers.megatron.dispatch import expert_parallel_dispatchers, use_gather_dispatch
from hybridrl.trainers.megatron.experts import experts_impl
from hybridrl.trainers.megatron.lora import apply_lora, lora_disabled, lora_parameters
from hybridrl.trainers.megatron.model import PackedRows, build_model, load_hf_weights
from hybridrl.trainers.megatron.spec import MegatronSetupError, check_parallel, effective_targets, read_spec
from hybridrl.trainers.offload import optimizer_state_to, optimizer_state_to_cpu


def init_parallel(tp: int, device: torch.device, ep: int = 1) -> None:
    """Process group (NCCL on CUDA, gloo on CPU) from torchrun's env, then megatron's TP and EP groups: tp * ep
    processes, each EP rank holding its share of the experts and a replica of everything else."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != tp * ep:
        raise MegatronSetupError(f"world size {dist.get_world_size()} != train_tp {tp} x train_ep {ep}: the Megatron "
                                 "trainer runs one process per TP x EP rank and no data parallelism")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                 create_gloo_process_groups=False)


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, chunk_bytes: int = LOGSOFTMAX_CHUNK_BYTES) -> torch.Tensor:
    """Entropy of softmax(logits) per position, logits [B, T, V/tp] -> [B, T] in fp32, the vocabulary split over the
    TP group: log Z - E[x] with x shifted by the global max. Three all-reduces of one value per position; the fp32
    work goes in chunks of at most chunk_bytes, as token_logprobs' does."""
    group = parallel_state.get_tensor_model_parallel_group()
    top = logits.amax(dim=-1).float()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    z = torch.empty_like(top)
    ex = torch.empty_like(top)
    for r, c in logit_chunks(logits, chunk_bytes):
        x = logits[r, c].float() - top[r, c].unsqueeze(-1)  # a new buffer: logits stay as the loss reads them
        e = x.exp()
        z[r, c] = e.sum(dim=-1)
        ex[r, c] = e.mul_(x).sum(dim=-1)
    dist.all_reduce(z, group=group)
    dist.all_reduce(ex, group=group)
    return z.log() - ex / z


def hidden_and_head(hidden_states: torch.Tensor, output_layer: torch.nn.Module, output_weight: torch.Tensor | None,
                    **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTModel's output_processor for the chunked head: the decoder's final hidden states [s, b, H] and this rank's
    rows of the output head (the embedding's where they are tied), in place of the logits."""
    return hidden_states, output_layer.weight if output_weight is None else output_weight


class MegatronPolicy:
    def __init__(self, model_dir: str | Path, run: RunConfig, device: torch.device,
                 megatron_permute: bool = False) -> None:
        """megatron_permute: MoE tokens permuted by megatron's own dispatcher (atomic scatters) instead of
        hybridrl's gathers (dispatch.py); a benchmark's before-and-after, not a run setting."""
        lora = run.lora
        if lora.dropout != 0.0:
            raise MegatronSetupError("lora.dropout must be 0 for the Megatron trainer")
        self.run = run
        self.device = device
        self.model_dir = str(model_dir)
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        # expert parallelism: the experts split over ep ranks, each of which runs the whole batch or (ep_batch split)
        # its share of it (ExpertParallelDispatcher); the adapters and the optimizer are replicas, kept equal by
        # summing or averaging their gradients
        self.ep = parallel_state.get_expert_model_parallel_world_size()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.split = self.ep > 1 and run.ep_batch == "split"
        # the one rank that writes files and prints (TP rank 0 of EP rank 0)
        self.writer = parallel_state.get_tensor_model_parallel_rank() == 0 and self.ep_rank == 0
        self.spec = read_spec(model_dir)
        check_parallel(self.spec, self.tp, lora.rank, list(lora.target_modules), self.ep)
        self.targets = effective_targets(self.spec, list(lora.target_modules))
        dropped = sorted(set(lora.target_modules) - set(self.targets))
        if dropped and self.writer:
            print(f"hybridrl megatron: {self.spec.model_type} is MoE; LoRA on {', '.join(self.targets)} only, "
                  f"{', '.join(dropped)} not adapted", flush=True)
        self.rank, self.alpha = lora.rank, lora.alpha
        # bf16 base on the GPU (LoRA weights stay fp32); fp32 on the CPU. train_dtype overrides (parity checks).
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
            run.train_dtype or ("bf16" if device.type == "cuda" else "fp32")]
        self.model = build_model(self.spec, self.tp, dtype, self.ep)
        load_hf_weights(self.model, self.spec, model_dir, parallel_state.get_tensor_model_parallel_rank(), self.tp,
                        self.ep_rank, self.ep)
        self.adapters = apply_lora(self.model, self.spec, self.rank, self.alpha, self.targets,
                                   seed=run.seed)
        self.model.to(device)  # after the adapters exist, so they move too
        # grouped_mm or loop for MoE models (GroupedExperts on these weights), None for dense ones
        self.experts_impl = experts_impl(self.model)
        # which MoE token permutation the update uses: gathers (dispatch.py) or megatron's; None for dense models
        dispatchers = use_gather_dispatch(self.model, on=not megatron_permute,
                                          masked=run.ep_dispatch == "masked" and self.ep > 1)
        self.moe_permute = ("megatron" if megatron_permute else "gathers") if dispatchers else None
        self.split_dispatchers = expert_parallel_dispatchers(self.model) if self.split else []
        self.params = lora_parameters(self.adapters)
        self.optimizer = torch.optim.AdamW(self.params, lr=run.lr, weight_decay=run.weight_decay)
        # built once here: importing peft costs seconds, which should not land in the first step
        self.adapter_config = export.adapter_config(self.rank, self.alpha, self.targets, self.model_dir)
        self._pinned: dict[int, torch.Tensor] = {}
        self.state_writer = StateWriter()  # TP rank 0's optimizer.pt, written while the loop goes on
        self.staging = HostStaging()  # the export's host buffers, reused (TP 1)
        self.flop_shape = read_flop_shape(model_dir)
        self.offloaded = False
        self.keep_base = run.keep_base_on_gpu is not False  # auto: kept unless release_base says otherwise
        # run.release_comms: the groups' communicators freed while offloaded (comms.py); nothing to free at TP 1
        self.comms = (ReloadableGroups(self.tp, "nccl" if device.type == "cuda" else "gloo", [self], self.model,
                                       self.ep)
                      if run.release_comms and self.tp * self.ep > 1 else None)

    # -- forward ---------------------------------------------------------------------------------------
    def logprobs(self, batch: Batch, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """grpo.LogprobFn: per-token log p(target) [B, T-1] in fp32 and, if asked, the entropy at each position,
        from the packed row when batch.packed is set; the vocabulary may be split over TP ranks. With
        run.chunked_head the head runs at the completion targets alone (chunked_head.py), no logits held."""
        for d in self.split_dispatchers:  # each EP rank's tokens in this forward; None: every rank the same batch
            d.counts = batch.split_tokens
        p = batch.packed
        if p is None:
            b, t = batch.inputs.shape
            pos = torch.arange(t, device=batch.inputs.device).unsqueeze(0).expand(b, t)
            inputs: dict[str, Any] = dict(input_ids=batch.inputs, position_ids=pos, attention_mask=None)
        else:
            inputs = dict(input_ids=p.ids, position_ids=p.positions, attention_mask=None,
                          packed_seq_params=PackedRows.of(p))
        if self.run.chunked_head:
            hidden, weight = self.model(**inputs, output_processor=hidden_and_head)  # [s, b, H], [V/tp, H]
            at = batch.completion_at()
            # the position that predicts each completion target in the flat positions: s-major [s * b], packed [N]
            index = at[1] * hidden.shape[1] + at[0] if p is None else p.cu_seqlens[at[0]].long() + at[1]
            split = dict(group=parallel_state.get_tensor_model_parallel_group(),
                         vocab_start=parallel_state.get_tensor_model_parallel_rank() * weight.shape[0])
            return completion_logprobs(hidden.reshape(-1, hidden.shape[-1]), index, at, batch.targets, weight,
                                       entropy, **(split if self.tp > 1 else {}))
        logits = self.model(**inputs)  # [B, T, V/tp]; packed [1, N, V/tp]
        targets = batch.targets if p is None else p.targets
        if p is not None:
            logits = logits[:, :-1]
        if self.tp == 1:
            logp, ent = token_logprobs_entropy(logits, targets, entropy=entropy)
        else:
            # first: megatron's cross entropy works in place on fp32 logits (.float() of fp32 is no copy)
            ent = vocab_parallel_entropy(logits) if entropy else None
            logp = -vocab_parallel_cross_entropy(logits.float(), targets)
        if p is None:
            return logp, ent
        return p.unpack(logp), None if ent is None else p.unpack(ent)

    # -- the GRPO step ---------------------------------------------------------------------------------
    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step on the whole batch (token-mean loss, micro-batched); returns metrics."""
        update_memory.start(self.device)
        self.onload()  # not timed as part of the update; a no-op unless offloaded
        t0 = time.perf_counter()
        metrics = self.backward(samples)
        metrics["train/grad_norm"] = self.optimizer_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # MFU and tokens/s over this update alone (the loop's perf/update_actor_tok_s spans the update_actor phase)
        metrics.update(update_perf(self.flop_shape, samples, time.perf_counter() - t0, self.tp * self.ep, self.device,
                                   kl=self.run.kl_coef > 0))
        metrics["train/keep_base_on_gpu"] = self.keep_base
        metrics["train/experts_impl"] = self.experts_impl
        metrics["train/comms_remade"] = None if self.comms is None else self.comms.generation
        metrics["train/chunked_head"] = self.run.chunked_head
        metrics.update(update_memory.taken(self.device))
        return metrics

    def backward(self, samples: list[Sample]) -> dict[str, float]:
        """Forward and backward over the batch; leaves the LoRA gradients in .grad."""
        if not samples:
            raise ValueError("step() got no samples")
        if self.offloaded:
            self.onload()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # padded: sorting by length keeps padding low (packed rows have none); the loss is a token mean over the
        # whole batch either way
        order = samples if self.run.pack_sequences else sorted(
            samples, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))
        group = parallel_state.get_data_parallel_group() if self.ep > 1 else None
        shard = split_batch(order, self.run, self.ep, self.ep_rank, group) if self.split else None
        metrics = grpo_backward(order, self.run, self.device, self.logprobs, lambda: lora_disabled(self.model),
                                shard=shard)
        self._reduce_replica_grads()
        return metrics

    def _reduce_replica_grads(self) -> None:
        """At EP > 1 the replicas' LoRA gradients become one (an all-reduce of a flat copy). A split batch's ranks
        each hold their share's part of the gradient: the sum is the batch's. Otherwise every rank computed the
        same gradient from the same batch, and the mean keeps the replicas' steps identical where GPU kernels round
        differently from rank to rank."""
        if self.ep == 1:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
        if not self.split:
            flat.div_(self.ep)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def optimizer_step(self) -> float:
        """Clip by the global grad norm, one AdamW step, drop the gradients; returns the pre-clip norm."""
        norm = self.clip_grads(self.run.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def clip_grads(self, max_norm: float) -> float:
        """Global L2 norm over all TP shards (every LoRA tensor is split, none replicated), then clip."""
        grads = [p.grad for p in self.params if p.grad is not None]
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for g in grads:
            sq += g.float().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(sq, group=parallel_state.get_tensor_model_parallel_group())
        norm = float(sq.sqrt())
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        return norm

    # -- state -----------------------------------------------------------------------------------------
    def save(self, out_dir: Path) -> float:
        """Collective: gathers shards on every rank; TP rank 0 writes the PEFT dir and starts writing optimizer.pt
        beside it (flush() waits for that). Returns the norm of the adapter's B matrices (train/lora_norm: zero, the
        identity adapter no engine can show applied)."""
        weights = export.gather_full(self.adapters, staging=self.staging)
        self.state_writer.wait()  # the last state's write reads the staging buffers the moments go to next
        opt = export.optimizer_state(self.adapters, self.optimizer, self.staging)
        if self.writer:  # EP ranks hold the same adapter: one of them writes it
            write_adapter_dir(Path(out_dir), weights, self.adapter_config)
            self.state_writer.submit(Path(out_dir), opt)
        if self.tp > 1:
            dist.barrier(group=parallel_state.get_tensor_model_parallel_group())
        # at TP 1 on the device (one fused norm); TP > 1 splits B over the ranks, so from the gathered copy
        return lora_b_norm(export.named_params(self.adapters) if self.tp == 1 else weights.items())

    def flush(self) -> float:
        """Wait for the last step's optimizer.pt (TP rank 0; other ranks write none); the seconds waited."""
        return self.state_writer.wait()

    def resume(self, adapter_dir: Path) -> None:
        self.onload()
        export.load_adapter_dir(self.adapters, self.optimizer, adapter_dir)

    # -- colocate: weights and optimizer state to pinned CPU memory between steps --------------------
    def offload(self) -> None:
        if self.device.type == "cuda" and not self.offloaded:
            self._to_host()
        if self.comms is not None:  # after the tensors: their copies need no communicator
            self.comms.release()

    def _to_host(self) -> None:
        for p in self.model.parameters():
            if not p.requires_grad and self.keep_base:
                continue
            buf = self._pinned.get(id(p))
            if buf is None:
                buf = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                buf.copy_(p.data, non_blocking=True)
                self._pinned[id(p)] = buf
            elif p.requires_grad:  # the frozen base never changes: its pinned copy is still good
                buf.copy_(p.data, non_blocking=True)
            p.data = buf
        optimizer_state_to_cpu(self.optimizer)
        if not self.keep_base:
            self._move_buffers("cpu")
        torch.cuda.synchronize(self.device)
        # cuBLAS keeps per-handle workspaces outside the caching allocator's free list
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
        self.offloaded = True

    def release_base(self) -> None:
        """From now on the frozen base leaves the GPU at every offload too; at once if offloaded already."""
        if not self.keep_base:
            return
        self.keep_base = False
        if self.offloaded and self.device.type == "cuda":
            self._to_host()

    def onload(self) -> None:
        """Weights, optimizer state and released groups back; a no-op for what is already in place."""
        if self.comms is not None:
            self.comms.restore()
        if self.device.type != "cuda" or not self.offloaded:
            return
        for p in self.model.parameters():
            p.data = p.data.to(self.device, non_blocking=True)
        optimizer_state_to(self.optimizer, self.device)
        self._move_buffers(self.device)
        torch.cuda.synchronize(self.device)
        self.offloaded = False

    def _move_buffers(self, device: torch.device | str) -> None:
        for mod in self.model.modules():
            for name, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[name] = b.to(device)

    def gpu_memory(self) -> dict[str, float]:
        """What this rank holds on its GPU now (gpu_memory_of)."""
        return gpu_memory_of(self.device)


def gpu_memory_of(device: torch.device) -> dict[str, float]:
    """What this process holds on `device` now: torch's reserved bytes and, where NVML sees our pid, the process's
    total (CUDA context and NCCL buffers included); nothing off CUDA."""
    if device.type != "cuda":
        return {}
    out = {"mem/trainer_reserved_gb": torch.cuda.memory_reserved(device) / nvml.GB}
    used = _nvml_gb(device)
    if used is not None:
        out["mem/trainer_residual_gb"] = used
    return out


def _nvml_gb(device: torch.device) -> float | None:
    """NVML's charge to this process on `device`; None where NVML is absent or cannot see us."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    visible = visible_devices()
    if visible is not None:
        mapped = nvml_indices()
        if mapped is None or idx >= len(mapped):  # GPU UUIDs: no cheap map to an NVML index
            return None
        idx = mapped[idx]
    used = nvml.process_used_gb(indices=[idx])
    # 0 where NVML lists no process of ours (another pid namespace): torch's counter still stands
    return used or None
