"""Prompt plus generation against the model's positions, checked before any engine starts.

An engine refuses a request whose prompt and max_tokens exceed its context only when the request arrives, after
minutes of start-up. `validate` checks what the study alone says (max_new_tokens against the model spec's
positions) and, where the data and the model are already built, the prompts too; the run checks the prompts it
will send at data load, before it builds an engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridrl.engines.base import context_length
from hybridrl.study.config import ConfigError, Study, dataset_name
from hybridrl.study.run_config import RunConfig
from hybridrl.task.data import prompt_text, read_jsonl, step_problems


def positions(spec: dict[str, Any], built: Path | None = None) -> int | None:
    """The model's context from its study spec, else from its built config.json; None where neither says."""
    if "max_position_embeddings" in spec:
        return context_length(spec)
    if built is not None and (built / "config.json").is_file():
        return context_length(json.loads((built / "config.json").read_text()))
    return None


def check_budget(where: str, run: RunConfig, context: int, when: str) -> None:
    """What the study alone shows: a generation that leaves no position for even a one-token prompt."""
    for key, tokens in _budgets(run):
        if tokens >= context:
            raise ConfigError(f"{where}: {key} {tokens} leaves no room for a prompt in the {context} positions "
                              f"the engines give model {run.model}; give it at most {context - 1} (checked {when})")


def check_prompts(where: str, run: RunConfig, problems: list[dict[str, Any]],
                  test_problems: list[dict[str, Any]] | None, tokenizer: Any, context: int, when: str) -> None:
    """The longest prompt the run sends (its steps' problems, and the eval slice where it evaluates) plus the
    tokens it may generate after it, against the model's context. `where` names the run in the message, `when`
    says where the check ran."""
    sent = sorted({i for step in range(1, run.steps + 1)
                   for i in step_problems(len(problems), run.seed, step, run.prompts_per_step)})
    budgets = dict(_budgets(run))
    sets = [("max_new_tokens", "train", [(i, problems[i]) for i in sent])]
    if "eval_max_new_tokens" in budgets and test_problems:
        sets.append(("eval_max_new_tokens", "test", list(enumerate(test_problems[:run.eval_problems]))))
    for key, split, rows in sets:
        longest, index = max((len(tokenizer(prompt_text(p["question"]))["input_ids"]), i) for i, p in rows)
        if longest + budgets[key] > context:
            raise ConfigError(f"{where}: {key} {budgets[key]} + the longest prompt it sends ({longest} tokens, "
                              f"problem {index + 1} of the {split} split) = {longest + budgets[key]}, beyond the "
                              f"{context} positions the engines give model {run.model}; give {key} at most "
                              f"{context - longest} (checked {when})")


def _budgets(run: RunConfig) -> list[tuple[str, int]]:
    """The most tokens each kind of request may generate: rollouts, and evals where the run evaluates."""
    budgets = [("max_new_tokens", run.max_new_tokens)]
    if run.eval_every:
        budgets.append(("eval_max_new_tokens", run.eval_max_new_tokens or run.max_new_tokens))
    return budgets


def check_study(study: Study, resources: Path, source: str = "config") -> None:
    """validate's check: every run's generation against its model's positions; with the prompts where the data
    (resources/data/<dataset>/) and the model's tokenizer (resources/models/<model>/) are built."""
    data = resources / "data" / dataset_name(study.data)
    splits: dict[str, list[dict[str, Any]] | None] = {}
    tokenizers: dict[str, Any] = {}
    for rid, run in study.runs.items():
        built, where = resources / "models" / run.model, f"{source}: run {rid}"
        context = positions(study.models[run.model], built)
        if context is None:
            continue  # nothing says the model's positions until it is built (a download)
        if not ((data / "train.jsonl").is_file() and (built / "config.json").is_file()):
            check_budget(where, run, context, "at validate, without the prompts: those are checked once data and "
                         "model are built, at the run's data load")
            continue
        if not splits:
            splits["train"] = read_jsonl(data / "train.jsonl")
            splits["test"] = read_jsonl(data / "test.jsonl") if (data / "test.jsonl").is_file() else None
        if run.model not in tokenizers:
            from transformers import AutoTokenizer

            tokenizers[run.model] = AutoTokenizer.from_pretrained(built)
        check_prompts(where, run, splits["train"], splits["test"], tokenizers[run.model], context,
                      f"at validate, on the built data in {data} and tokenizer in {built}")
