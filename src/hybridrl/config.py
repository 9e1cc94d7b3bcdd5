"""Study config: schema validation, defaults, one resolved dict per run and its run id."""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"

# Filled in under every run before the study's own `defaults` and the run's overrides.
BUILTIN_RUN: dict[str, Any] = {
    "engine": "vllm",
    "placement": "split",
    "trainer": "hf",
    "device": "cuda",
    "tp": 1,
    "train_tp": 1,
    "train_gpus": 1,
    "steps": 5,
    "prompts_per_step": 8,
    "group_size": 4,
    "max_new_tokens": 128,
    "max_concurrency": 64,
    "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": False},
    "lora": {
        "rank": 8,
        "alpha": 16,
        "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
    "lr": 1e-4,
    "weight_decay": 0.0,
    "clip_eps": 0.2,
    "format_reward": 0.1,
    "kl_coef": 0.0,
    "grad_clip": 1.0,
    "seed": 0,
    "retries": 2,
    "stream_fraction": 0.125,
    "shared_pool": False,
    "client_ceiling_s": 2.0,
    "request_timeout_s": 600.0,
    "startup_timeout_s": 900.0,
    "engine_args": [],
    "sglang_release": "kv_cache",
    "vllm_sleep_level": 1,
    "gpu_memory_utilization": 0.5,
    "ballast_gb": 0.0,
    "ballast_s": 0.0,
}


class ConfigError(ValueError):
    """A study config that cannot be run; the message names the offending key."""


@dataclass(frozen=True)
class Study:
    name: str
    data: dict[str, Any]
    models: dict[str, dict[str, Any]]
    engine_envs: dict[str, dict[str, Any]]
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # run_id -> resolved run


def _key_path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "<top level>"


def _describe(error: jsonschema.ValidationError) -> str:
    where = _key_path(error)
    if error.validator == "additionalProperties":
        props = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(props))
        hints = [m for e in extra for m in difflib.get_close_matches(e, props, n=1)]
        hint = f"; did you mean {', '.join(repr(h) for h in hints)}?" if hints else f" (known keys: {', '.join(props)})"
        return f"unknown key {', '.join(repr(e) for e in extra)} in {where}{hint}"
    return f"{where}: {error.message}"


def validate(raw: dict[str, Any], source: str = "config") -> None:
    """Raise ConfigError naming the first offending key, before anything runs."""
    schema = yaml.safe_load(SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(raw), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        # the deepest error names the key most precisely
        best = jsonschema.exceptions.best_match(errors)
        raise ConfigError(f"{source}: {_describe(best)}")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def run_id(run: dict[str, Any]) -> str:
    """Readable prefix plus a short hash of the resolved run, so one changed parameter changes one id."""
    digest = hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:8]
    prefix = run.get("name") or f"{run['engine']}-{run['placement']}-{run['trainer']}-{run['model']}"
    return f"{prefix}-{digest}"


def _check_run(run: dict[str, Any], models: dict[str, Any], where: str) -> None:
    if run.get("model") not in models:
        raise ConfigError(f"{where}.model: {run.get('model')!r} is not defined under models "
                          f"(defined: {', '.join(models)})")
    if run["placement"] == "colocate" and run["device"] != "cuda":
        raise ConfigError(f"{where}.placement: colocate needs device: cuda (sleep mode is GPU-only)")
    if run["engine"] == "sglang" and run["device"] != "cuda":
        raise ConfigError(f"{where}.engine: sglang has no CPU build; use device: cuda")
    if run["trainer"] == "none" and run["placement"] != "colocate":
        raise ConfigError(f"{where}.trainer: 'none' (memory ballast) only makes sense with placement: colocate")
    if run["engine"] in ("vllm", "vllm-inprocess") and run["vllm_sleep_level"] == 2:
        # seen on the H200 (results/reference/2026-11-22-h200, bench probe): reload_weights looks up
        # checkpoint names that LoRA wrapping moved under base_layer (vllm-project/vllm#39934)
        raise ConfigError(f"{where}.vllm_sleep_level: 2 does not work with LoRA in vLLM 0.26: waking from it "
                          "reloads the weights, which fails on LoRA-wrapped layers (vllm-project/vllm#39934); "
                          "use 1")
    if run["trainer"] == "megatron" and run["lora"]["rank"] % run["train_tp"]:
        raise ConfigError(f"{where}.lora.rank: {run['lora']['rank']} is not divisible by train_tp "
                          f"{run['train_tp']}")


def check_model_sources(models: dict[str, dict[str, Any]], source: str = "config") -> None:
    for name, spec in models.items():
        if "path" in spec and not Path(spec["path"]).expanduser().exists():
            raise ConfigError(f"{source}: models.{name}.path: {spec['path']} does not exist")


def _line_column(text: str | bytes, offset: int) -> tuple[int, int]:
    newline = "\n" if isinstance(text, str) else b"\n"
    return text.count(newline, 0, offset) + 1, offset - text.rfind(newline, 0, offset)


def yaml_error_line(path: str | Path, exc: yaml.YAMLError, text: str) -> str:
    """One line for a YAML syntax error, FILE:LINE:COLUMN: what, as a compiler prints it (PyYAML's own
    message spans four to six lines)."""
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML forbids, found before parsing
        line, column = _line_column(text, exc.position)
        char = exc.character if isinstance(exc.character, str) else chr(exc.character)
        return f"{path}:{line}:{column}: not valid YAML: character U+{ord(char):04X}: {exc.reason}"
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    what = getattr(exc, "problem", None) or getattr(exc, "context", None)
    if mark is None or what is None:
        return f"{path}: not valid YAML: {' '.join(str(exc).split())}"
    context, cmark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    # PyYAML's context names the construct the problem broke ("while parsing a flow sequence")
    where = f" ({context} that starts at line {cmark.line + 1}, column {cmark.column + 1})" \
        if context and cmark and context != what else ""
    return f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {what}{where}"


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file; a syntax error raises ConfigError with one line naming file, line and column."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = _line_column(data, exc.start)
        raise ConfigError(f"{path}:{line}:{column}: not UTF-8 text (byte {data[exc.start]:#04x})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error_line(path, exc, text)) from None


def load_study(path: str | Path, overrides: dict[str, Any] | None = None) -> Study:
    """Read, validate and resolve a study file; raises ConfigError with one clear message."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if overrides:
        raw = _merge(raw, overrides)
    return resolve(raw, str(path))


def resolve(raw: dict[str, Any], source: str = "config") -> Study:
    validate(raw, source)
    check_model_sources(raw["models"], source)
    runs: dict[str, dict[str, Any]] = {}
    for i, over in enumerate(raw["runs"]):
        run = _merge(_merge(BUILTIN_RUN, raw["defaults"]), over)
        _check_run(run, raw["models"], f"{source}: runs[{i}]")
        rid = run_id(run)
        if rid in runs:
            raise ConfigError(f"{source}: runs[{i}] resolves to the same run as an earlier entry ({rid})")
        runs[rid] = run
    return Study(name=raw["study"], data=raw["data"], models=raw["models"],
                 engine_envs=raw.get("engine_envs", {}), runs=runs)


def dataset_name(data: dict[str, Any]) -> str:
    if data["source"] == "gsm8k":
        return "gsm8k"
    return f"synthetic-s{data.get('seed', 0)}-n{data.get('n_train', 512)}-{data.get('n_test', 128)}"
