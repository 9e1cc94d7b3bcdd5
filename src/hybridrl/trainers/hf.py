"""GRPO + LoRA with Hugging Face transformers and PEFT, on CPU or one GPU."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import torch

from hybridrl.run.checks import model_family
from hybridrl.study.run_config import RunConfig
from hybridrl.task.rl import token_logprobs_entropy
from hybridrl.trainers import grouped_mm, update_memory
from hybridrl.trainers.adapter_files import (
    OPTIMIZER_FILE,
    HostStaging,
    StateWriter,
    optimizer_to_host,
    peft_config_json,
    to_host,
    write_adapter_dir,
)
from hybridrl.trainers.base import Sample, TrainResult, lora_b_norm
from hybridrl.trainers.chunked_head import completion_logprobs
from hybridrl.trainers.flops import read_flop_shape, update_perf
from hybridrl.trainers.grpo import Batch, grpo_backward
from hybridrl.trainers.hf_fast import fuse_lora_outputs, fuse_rms_norms, keep_adapter_inputs
from hybridrl.trainers.offload import optimizer_state_to, optimizer_state_to_cpu
from hybridrl.trainers.packing import varlen_causal_attention

PACKED_ATTENTION = "hybridrl_packed"  # the attention implementation registered with transformers for packed rows
# causal LMs whose logits are their lm_head on the decoder's last hidden state, with no scaling or capping
PLAIN_HEAD_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for packed rows: causal within each sequence of cu_seq_lens_q; a
    forward without it (right-padded rows, where the causal mask suffices) goes to SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and (kwargs.get("sliding_window") or dropout):
        raise ValueError(f"{type(module).__name__}: packed sequences take full causal attention without dropout; "
                         "this model has a sliding window or attention dropout: set pack_sequences: false")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [1, heads, N, D] -> [N, heads, D]
    out = varlen_causal_attention(q, k, v, cu, int(kwargs["max_length_q"]), scaling)  # type: ignore[arg-type]
    return out.unsqueeze(0), None  # [1, N, heads, D], as the interface returns


def register_packed_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def experts_implementation(model_dir: Path, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """from_pretrained's experts_implementation for a mixture-of-experts checkpoint, {} for a dense one.

    grouped_mm runs all experts' tokens as one grouped GEMM; transformers' eager is a Python loop over the
    experts (8x slower on the issue-15 MoE shape). Asked for explicitly so a changed transformers default
    cannot switch it silently; eager where torch's grouped_mm does not run (e.g. no CPU kernel before 2.9)."""
    config = json.loads((model_dir / "config.json").read_text())
    if model_family(config) != "moe":
        return {}
    return {"experts_implementation": "grouped_mm" if grouped_mm.kernel_runs(device.type, dtype) else "eager"}


def plain_head(causal_lm: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, output head) of a transformers causal LM whose logits are head(decoder(...).last_hidden_state)
    alone, for the chunked head (chunked_head.py); None for any other, which keeps the model's own logits."""
    head = causal_lm.get_output_embeddings()
    decoder = causal_lm.base_model
    if (causal_lm.config.model_type not in PLAIN_HEAD_TYPES or type(head) is not torch.nn.Linear
            or head.bias is not None or decoder is causal_lm):
        return None
    return decoder, head


def peft_state_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """PEFT's names for the adapter's tensors in adapter_model.safetensors, each with its parameter: found once,
    since PEFT's get_peft_model_state_dict walks the whole model's state_dict every time."""
    from peft import get_peft_model_state_dict

    trained = {p.data_ptr(): p for p in model.parameters() if p.requires_grad}
    out = {}
    for name, t in get_peft_model_state_dict(model).items():
        p = trained.get(t.data_ptr())
        if p is None or p.shape != t.shape:
            raise ValueError(f"PEFT's adapter tensor {name} is none of the model's trained parameters")
        out[name] = p
    return out


class HFTrainer:
    """GRPO + LoRA on transformers + PEFT in this process. fuse_lora: add each adapter's output inside its last
    matmul (hf_fast.fuse_lora_outputs); False keeps PEFT's own forward, for the benchmark's before-and-after."""

    def __init__(self, model_dir: Path, run: RunConfig, device: str | None = None, fuse_lora: bool = True) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.run = run
        self.device = torch.device(device or ("cuda" if run.device == "cuda" else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        experts = experts_implementation(Path(model_dir), self.device, dtype)
        attention: dict[str, str] = {}
        if run.pack_sequences:
            register_packed_attention()
            attention = {"attn_implementation": PACKED_ATTENTION}
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **experts, **attention)
        # what transformers settled on for the MoE experts (grouped_mm or eager); None for a dense model
        self.experts_impl: str | None = base.config._experts_implementation if experts else None
        lora = run.lora
        cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                         target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
        torch.manual_seed(run.seed)
        self.model = get_peft_model(base, cfg).to(self.device)
        # LoRA weights train in fp32 even when the frozen base is bf16
        for p in self.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        keep_adapter_inputs(self.model)
        if fuse_lora:
            fuse_lora_outputs(self.model)
        fuse_rms_norms(self.model)
        # run.chunked_head: the decoder's hidden states and the head's logprobs chunk by chunk, no full logits
        self.head = plain_head(self.model.get_base_model()) if run.chunked_head else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # adapter_config.json as PEFT's save_pretrained writes it (for inference), built once
        config = copy.deepcopy(self.model.peft_config["default"])
        config.inference_mode = True
        config.base_model_name_or_path = config.base_model_name_or_path or str(model_dir)
        self.adapter_config = peft_config_json(config)
        self.adapter_params = peft_state_params(self.model)
        self.optimizer = torch.optim.AdamW(self.params, lr=run.lr, weight_decay=run.weight_decay)
        self.flop_shape = read_flop_shape(model_dir)
        self._pinned: dict[tuple[int, str], torch.Tensor] = {}  # a parameter's or buffer's pinned CPU copy
        self.state_writer = StateWriter()
        self.staging = HostStaging()
        self.offloaded = False
        self.keep_base = run.keep_base_on_gpu is not False  # auto: kept unless release_base says otherwise

    # -- the step --------------------------------------------------------------------------------
    def _logprobs(self, batch: Batch, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """grpo.LogprobFn: per-token logprobs [B, T-1] and, if asked, the entropy at each position (with the
        chunked head at the completion targets alone)."""
        p = batch.packed
        # packed: no attention mask: packed_attention keeps the sequences apart; RoPE restarts in each
        inputs = (dict(input_ids=batch.ids, attention_mask=batch.attention) if p is None else
                  dict(input_ids=p.ids, position_ids=p.positions, cu_seq_lens_q=p.cu_seqlens,
                       cu_seq_lens_k=p.cu_seqlens, max_length_q=p.max_len, max_length_k=p.max_len))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            if self.head is not None:
                decoder, head = self.head
                hidden = decoder(**inputs, use_cache=False).last_hidden_state  # [B, T, H]; packed [1, N, H]
                at = batch.completion_at()
                # the position that predicts each completion target, in the flat [B * T] or packed [N] positions
                index = at[1] + (at[0] * batch.ids.shape[1] if p is None else p.cu_seqlens[at[0]].long())
                return completion_logprobs(hidden.reshape(-1, hidden.shape[-1]), index, at, batch.targets,
                                           head.weight, entropy)
            logits = self.model(**inputs).logits[:, :-1]
        logp, ent = token_logprobs_entropy(logits, batch.targets if p is None else p.targets, entropy=entropy)
        if p is None:
            return logp, ent
        return p.unpack(logp), None if ent is None else p.unpack(ent)

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step on the batch (logprobs, loss, backward, clip, AdamW), no export; its metrics with
        the pre-clip gradient norm."""
        if self.offloaded:
            self.onload()
        self.model.train()
        update_memory.start(self.device)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer.zero_grad(set_to_none=True)
        metrics = grpo_backward(samples, self.run, self.device, self._logprobs, self.model.disable_adapter, pad)
        metrics["train/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, self.run.grad_clip))
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {**metrics, **update_memory.taken(self.device)}

    def step(self, step: int, samples: list[Sample], out_dir: Path) -> TrainResult:
        if self.offloaded:
            self.onload()  # not timed as part of the update
        t0 = time.perf_counter()
        metrics = self.update(samples)
        update_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.save(out_dir)
        save_s = time.perf_counter() - t0
        return TrainResult(out_dir, {
            **metrics,
            **update_perf(self.flop_shape, samples, update_s, 1, self.device, kl=self.run.kl_coef > 0),
            "train/lora_norm": lora_b_norm(self.adapter_params.items()),  # on the device: one fused norm
            "train/keep_base_on_gpu": self.keep_base,
            "train/experts_impl": self.experts_impl,
            "train/chunked_head": self.head is not None,
            "timing_s/save_adapter": save_s,
        })

    # -- state -----------------------------------------------------------------------------------
    def save(self, out_dir: Path) -> None:
        """The adapter (PEFT's names and files) into out_dir, and its optimizer state started on the writer's
        thread (flush waits for it)."""
        weights = to_host(self.adapter_params, staging=self.staging, slot="weights")
        self.state_writer.wait()  # the last state's write reads the staging buffer the copy below overwrites
        optimizer = optimizer_to_host(self.optimizer.state_dict(), self.staging)  # the next update changes these
        write_adapter_dir(out_dir, weights, self.adapter_config)
        self.state_writer.submit(out_dir, optimizer)

    def flush(self) -> float:
        return self.state_writer.wait()

    def resume(self, adapter_dir: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        if self.offloaded:
            self.onload()
        state = load_file(str(adapter_dir / "adapter_model.safetensors"), device=str(self.device))
        set_peft_model_state_dict(self.model, state)
        for p in self.params:
            p.data = p.data.float()
        opt = adapter_dir / OPTIMIZER_FILE
        if opt.exists():
            self.optimizer.load_state_dict(torch.load(opt, map_location=self.device))

    # -- colocate: to pinned CPU memory and back with asynchronous copies ------------------------------
    def offload(self) -> None:
        if self.device.type != "cuda" or self.offloaded:
            return
        for p in self.model.parameters():
            if not p.requires_grad and self.keep_base:
                continue
            p.data = self._to_pinned((id(p), ""), p.data, fresh=p.requires_grad)
        for mod in self.model.modules():  # RoPE frequencies and the like
            for name, b in mod._buffers.items():
                if b is not None and b.is_cuda and not self.keep_base:
                    mod._buffers[name] = self._to_pinned((id(mod), name), b, fresh=False)
        optimizer_state_to_cpu(self.optimizer)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.offloaded = True

    def release_base(self) -> None:
        """From now on the frozen base leaves the GPU at every offload too; at once if offloaded already."""
        if not self.keep_base:
            return
        self.keep_base = False
        if self.offloaded:
            self.offloaded = False
            self.offload()

    def onload(self) -> None:
        if self.device.type != "cuda" or not self.offloaded:
            return
        for p in self.model.parameters():
            if not p.data.is_cuda:  # the pinned copy stays in _pinned: a frozen tensor's serves the next offload
                p.data = p.data.to(self.device, non_blocking=True)
        for mod in self.model.modules():
            for name, b in mod._buffers.items():
                if b is not None and not b.is_cuda:
                    mod._buffers[name] = b.to(self.device, non_blocking=True)
        optimizer_state_to(self.optimizer, self.device)
        torch.cuda.synchronize(self.device)
        self.offloaded = False

    def _to_pinned(self, key: tuple[int, str], t: torch.Tensor, fresh: bool) -> torch.Tensor:
        """t's pinned CPU copy; an existing copy of a frozen tensor is reused without copying (fresh=False)."""
        buf = self._pinned.get(key)
        if buf is None:
            buf = self._pinned[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            fresh = True
        if fresh:
            buf.copy_(t, non_blocking=True)
        return buf

    def gpu_pids(self) -> list[int]:
        return [os.getpid()]  # the HF trainer lives in the controller

    def ports(self) -> dict[str, int]:
        return {}  # one process: nothing to meet on

    def close(self) -> None:
        self.state_writer.close()
        self.offload()
