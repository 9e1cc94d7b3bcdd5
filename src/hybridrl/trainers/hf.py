"""GRPO + LoRA with Hugging Face transformers and PEFT, on CPU or one GPU."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from hybridrl.atomic import atomic_dir
from hybridrl.rl import LogprobGaps, policy_loss, token_logprobs
from hybridrl.run_config import RunConfig
from hybridrl.trainers.base import Sample, TrainResult

OPTIMIZER_FILE = "optimizer.pt"


def pad_batch(samples: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> input ids [B, T], attention mask [B, T], completion mask over targets [B, T-1] (right padded)."""
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    target_mask = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
    for i, (s, seq) in enumerate(zip(samples, seqs, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        # target position t predicts token t+1; completion tokens start at len(prompt)
        target_mask[i, len(s.prompt_ids) - 1 : len(seq) - 1] = True
    return ids, attn, target_mask


class HFTrainer:
    def __init__(self, model_dir: Path, run: RunConfig, device: str | None = None) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.run = run
        self.device = torch.device(device or ("cuda" if run.device == "cuda" else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        lora = run.lora
        cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                         target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
        torch.manual_seed(run.seed)
        self.model = get_peft_model(base, cfg).to(self.device)
        # LoRA weights train in fp32 even when the frozen base is bf16
        for p in self.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=run.lr, weight_decay=run.weight_decay)
        self.micro_batch = run.micro_batch

    # -- the step --------------------------------------------------------------------------------
    def _logprobs(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        return token_logprobs(logits, ids[:, 1:])

    def step(self, step: int, samples: list[Sample], out_dir: Path) -> TrainResult:
        self.model.train()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        n_tokens = sum(len(s.completion_ids) for s in samples)
        totals = {"loss": 0.0, "train/kl": 0.0, "train/clipfrac": 0.0}
        gaps = LogprobGaps()
        self.optimizer.zero_grad(set_to_none=True)
        for lo in range(0, len(samples), self.micro_batch):
            chunk = samples[lo : lo + self.micro_batch]
            ids, attn, mask = (t.to(self.device) for t in pad_batch(chunk, pad))
            logp = self._logprobs(ids, attn)
            old = logp.detach()  # one update per batch: the sampling policy is the current one
            ref = None
            if self.run.kl_coef > 0:
                with torch.no_grad(), self.model.disable_adapter():
                    ref = self._logprobs(ids, attn)
            adv = torch.tensor([s.advantage for s in chunk], device=self.device)
            loss, stats = policy_loss(logp, old, adv, mask, self.run.clip_eps, ref, self.run.kl_coef)
            weight = mask.sum().item() / max(n_tokens, 1)  # token-level mean over the whole batch
            (loss * weight).backward()
            totals["loss"] += loss.item() * weight
            totals["train/kl"] += stats["train/kl"] * weight
            totals["train/clipfrac"] += stats["train/clipfrac"] * weight
            gaps.add(old, mask, [s.engine_logprobs for s in chunk])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.run.grad_clip)
        self.optimizer.step()
        t0 = time.perf_counter()
        self.save(out_dir)
        save_s = time.perf_counter() - t0
        return TrainResult(out_dir, {
            "train/loss": totals["loss"],
            "train/grad_norm": float(grad_norm),
            "train/kl": totals["train/kl"] if self.run.kl_coef > 0 else math.nan,
            "train/clipfrac": totals["train/clipfrac"],
            "perf/train_tokens": float(n_tokens),
            **gaps.metrics(n_tokens),
            "train/lora_norm": self.lora_norm(),
            "timing_s/save_adapter": save_s,
        })

    def lora_norm(self) -> float:
        """Norm of the LoRA B matrices: zero means the adapter is still the identity."""
        return float(sum(p.detach().float().pow(2).sum() for n, p in self.model.named_parameters()
                         if "lora_B" in n) ** 0.5)

    # -- state -----------------------------------------------------------------------------------
    def save(self, out_dir: Path) -> None:
        with atomic_dir(out_dir) as tmp:
            self.model.save_pretrained(tmp)
            torch.save(self.optimizer.state_dict(), tmp / OPTIMIZER_FILE)

    def resume(self, adapter_dir: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = load_file(str(adapter_dir / "adapter_model.safetensors"), device=str(self.device))
        set_peft_model_state_dict(self.model, state)
        for p in self.params:
            p.data = p.data.float()
        opt = adapter_dir / OPTIMIZER_FILE
        if opt.exists():
            self.optimizer.load_state_dict(torch.load(opt, map_location=self.device))

    def offload(self) -> None:
        if self.device.type == "cuda":
            self._move("cpu")

    def onload(self) -> None:
        if self.device.type == "cuda":
            self._move(self.device)

    def gpu_pids(self) -> list[int]:
        return [os.getpid()]  # the HF trainer lives in the controller

    def _move(self, device: str | torch.device) -> None:
        self.model.to(device)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.to(device, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.offload()
