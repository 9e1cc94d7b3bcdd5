"""A warm-started policy: supervised next-token training of a random-init model on the study's own training split
(prompt -> worked answer -> EOS) for a token budget, then its greedy accuracy on the test split.

A random-init policy never emits EOS and is never right, so its rollouts run to max_new_tokens and its rewards are
a format bonus. After a warm start the rollouts stop at EOS with ragged lengths and some groups hold both right and
wrong answers, as with a real checkpoint. The result is recorded next to the checkpoint (WARM_START_FILE).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridrl.task import data as gsm8k

WARM_START_FILE = "warm_start.json"
DEFAULTS = {"tokens": 200_000, "lr": 3e-3, "batch_size": 32, "warmup_frac": 0.05, "eval_problems": 64,
            "max_new_tokens": 64, "seed": 0, "target_accuracy": None, "check_tokens": None, "check_problems": 128}


def settings(spec: dict[str, Any]) -> dict[str, Any]:
    """The model spec's `warm_start` mapping over DEFAULTS."""
    return {**DEFAULTS, **spec}


def examples(rows: list[dict[str, Any]], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + EOS) per problem; the prompt is tokenized alone, exactly as the rollout sends it."""
    out = []
    for row in rows:
        prompt = tokenizer(gsm8k.prompt_text(row["question"]))["input_ids"]
        answer = tokenizer(" " + row["answer"])["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt, answer))
    return out


def batch_tensors(batch: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    """input_ids, attention_mask and labels (-100 on the prompt and the padding: the loss is on the answer)."""
    import torch

    width = max(len(p) + len(a) for p, a in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (p, a) in enumerate(batch):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p):n] = torch.tensor(a)
        mask[i, :n] = 1
    return ids, mask, labels


def pretrain(model: Any, tokenizer: Any, rows: list[dict[str, Any]], cfg: dict[str, Any], device: str,
             log: Any = print, check: Callable[[], float] | None = None) -> dict[str, Any]:
    """Train until `cfg["tokens"]` tokens (prompt and answer, no padding) went through the model; AdamW with
    linear warm-up and cosine decay over that budget. With `check`, every `cfg["check_tokens"]` tokens: stop early
    once check() (an accuracy) reaches `cfg["target_accuracy"]`. Returns what was done, the checks included."""
    import torch

    data = examples(rows, tokenizer)
    rng = random.Random(cfg["seed"])
    per_batch = sum(len(p) + len(a) for p, a in data) / len(data) * cfg["batch_size"]
    total_steps = max(1, math.ceil(cfg["tokens"] / per_batch))
    warmup = max(1, int(total_steps * cfg["warmup_frac"]))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / total_steps, 1.0)))))
    model.train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu",
                                                                                                   enabled=False)
    seen, step, t0, loss_ema, order, checks, reached = 0, 0, time.perf_counter(), None, [], [], False
    next_check = cfg["check_tokens"]
    while seen < cfg["tokens"]:
        if len(order) < cfg["batch_size"]:
            order += rng.sample(range(len(data)), len(data))
        batch = [data[i] for i in order[:cfg["batch_size"]]]
        del order[:cfg["batch_size"]]
        ids, mask, labels = (t.to(device) for t in batch_tensors(batch, tokenizer.pad_token_id))
        with autocast:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        seen += int(mask.sum())
        step += 1
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        if step % 25 == 0 or seen >= cfg["tokens"]:
            log(f"warm start: step {step}/{total_steps}, {seen:,} tokens, loss {loss_ema:.3f}, "
                f"{time.perf_counter() - t0:.0f} s")
        if check is not None and seen >= next_check and seen < cfg["tokens"]:
            next_check += cfg["check_tokens"]
            model.eval()
            checks.append({"tokens": seen, "accuracy": check()})
            model.train()
            log(f"warm start: held-out accuracy {checks[-1]['accuracy']:.3f} after {seen:,} tokens "
                f"(target {cfg['target_accuracy']})")
            reached = checks[-1]["accuracy"] >= cfg["target_accuracy"]
            if reached:
                break
    model.eval()
    return {"tokens": seen, "steps": step, "seconds": round(time.perf_counter() - t0, 1), "final_loss": loss_ema,
            "checks": checks, "stopped_at_target": reached}


def greedy_accuracy(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int, device: str,
                    batch_size: int = 32) -> dict[str, Any]:
    """Greedy completions of the problems with HF generate; the share answered right (hybridrl.task.data.reward) and the
    share that stopped at EOS before max_new_tokens."""
    import torch

    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    correct, stopped, lengths = 0, 0, []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = [tokenizer(gsm8k.prompt_text(r["question"]))["input_ids"] for r in chunk]
        width = max(len(p) for p in prompts)
        # left padding, so that every row's next token comes right after its own prompt
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=list(eos_ids), pad_token_id=tokenizer.pad_token_id)
        for row, generated in zip(chunk, out[:, width:].tolist(), strict=True):
            end = next((i for i, t in enumerate(generated) if t in eos_ids), None)
            stopped += end is not None
            tokens = generated[:end] if end is not None else generated
            lengths.append(len(tokens))
            correct += gsm8k.reward(tokenizer.decode(tokens, skip_special_tokens=True), row["answer"]) == 1.0
    n = len(rows)
    return {"accuracy": correct / n if n else None, "eos_share": stopped / n if n else None,
            "response_length_mean": sum(lengths) / n if n else None, "problems": n}


def warm_start(model: Any, tokenizer: Any, train_rows: list[dict[str, Any]], test_rows: list[dict[str, Any]],
               spec: dict[str, Any], out_dir: Path, log: Any = print) -> dict[str, Any]:
    """Pretrain `model` in place, measure it on the first `eval_problems` test problems and write WARM_START_FILE.

    With `target_accuracy`, the last `check_problems` train problems are held out of the training and checked
    every `check_tokens` (default a fifth of the budget); training stops once they reach the target, so a token
    budget need not be tuned per model and GPU. The test split is only measured, never used to stop.
    Runs on the GPU where there is one; the model stays in float32 while it trains (bf16 autocast on the GPU)."""
    import torch

    cfg = settings(spec)
    device = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg["seed"])
    model.to(device=device, dtype=torch.float32)
    check = None
    if cfg["target_accuracy"] is not None:
        if len(train_rows) <= cfg["check_problems"]:
            raise ValueError(f"warm_start.check_problems ({cfg['check_problems']}) must be fewer than the train "
                             f"split's {len(train_rows)} problems")
        cfg["check_tokens"] = cfg["check_tokens"] or max(1, cfg["tokens"] // 5)
        train_rows, held_out = train_rows[:-cfg["check_problems"]], train_rows[-cfg["check_problems"]:]

        def check() -> float:
            return greedy_accuracy(model, tokenizer, held_out, cfg["max_new_tokens"], device)["accuracy"]

    done = pretrain(model, tokenizer, train_rows, cfg, device, log, check)
    t0 = time.perf_counter()
    evaluated = greedy_accuracy(model, tokenizer, test_rows[:cfg["eval_problems"]], cfg["max_new_tokens"], device)
    result = {"settings": cfg, "device": device, **done, "base_accuracy": evaluated.pop("accuracy"),
              "eval_split": "test", "eval_decoding": "greedy (HF generate)", **evaluated,
              "eval_seconds": round(time.perf_counter() - t0, 1)}
    (out_dir / WARM_START_FILE).write_text(json.dumps(result, indent=2) + "\n")
    log(f"warm start: base accuracy {result['base_accuracy']:.3f} on {evaluated['problems']} test problems, "
        f"{evaluated['eos_share']:.0%} stopped at EOS, after {done['tokens']:,} tokens in {done['seconds']:.0f} s")
    model.to("cpu")
    return result
