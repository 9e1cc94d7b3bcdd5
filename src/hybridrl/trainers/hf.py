"""GRPO + LoRA with Hugging Face transformers and PEFT, on CPU or one GPU."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from hybridrl.atomic import atomic_dir
from hybridrl.rl import token_logprobs
from hybridrl.run_config import RunConfig
from hybridrl.trainers.base import Sample, TrainResult
from hybridrl.trainers.grpo import Batch, grpo_backward

OPTIMIZER_FILE = "optimizer.pt"


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

    # -- the step --------------------------------------------------------------------------------
    def _logprobs(self, batch: Batch) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(input_ids=batch.ids, attention_mask=batch.attention).logits[:, :-1]
        return token_logprobs(logits, batch.targets)

    def step(self, step: int, samples: list[Sample], out_dir: Path) -> TrainResult:
        self.model.train()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer.zero_grad(set_to_none=True)
        metrics = grpo_backward(samples, self.run, self.device, self._logprobs, self.model.disable_adapter, pad)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.run.grad_clip)
        self.optimizer.step()
        t0 = time.perf_counter()
        self.save(out_dir)
        save_s = time.perf_counter() - t0
        return TrainResult(out_dir, {
            **metrics,
            "train/grad_norm": float(grad_norm),
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
