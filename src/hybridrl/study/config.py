"""Study config: schema validation, one typed RunConfig per run (hybridrl.study.run_config) and its run id."""

from __future__ import annotations

import contextlib
import copy
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import yaml

from hybridrl.study.measurements import MeasureJob, resolve_measurements
from hybridrl.study.run_config import RunConfig, RunSpec, run_id, split_replicate
from hybridrl.study.study_config import Measurement, Node, StudyConfig, study_schema

REPO = Path(__file__).resolve().parents[3]
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
SCHEMA_HEADER = ("# Generated from hybridrl.study.study_config.StudyConfig and run_config.RunConfig by "
                 "`python -m hybridrl schema`;\n# edit those, not this file.\n")
_KEY_ORDER = ("$schema", "title", "type", "const", "enum", "anyOf", "oneOf", "items", "minItems", "minProperties",
              "minimum", "exclusiveMinimum", "maximum", "pattern", "default", "description", "required",
              "additionalProperties", "properties", "$defs")


def _yaml_lines(key: str, node: Any, indent: int, width: int = 118) -> list[str]:
    """`key: node` in flow style where it fits on one line, else a block of such lines."""
    if isinstance(node, dict):
        node = dict(sorted(node.items(), key=lambda kv: _KEY_ORDER.index(kv[0]) if kv[0] in _KEY_ORDER else 99))
    line = " " * indent + yaml.safe_dump({key: node}, default_flow_style=True, sort_keys=False,
                                         width=10**9).strip()[1:-1]
    if len(line) <= width or not isinstance(node, (dict, list)) or key == "properties" and not node:
        return [line]
    if isinstance(node, list):  # a list too long for one line: one item a line
        return [" " * indent + f"{key}:"] + [
            " " * (indent + 2) + "- " + yaml.safe_dump(item, default_flow_style=True, width=10**9).strip()
            for item in node]
    out = [" " * indent + f"{key}:"]
    for k, v in node.items():
        out += _yaml_lines(k, v, indent + 2, width)
    return out


def schema_text() -> str:
    """SCHEMA's text as the typed study (StudyConfig, RunConfig) generates it."""
    schema = study_schema()
    schema = dict(sorted(schema.items(), key=lambda kv: _KEY_ORDER.index(kv[0]) if kv[0] in _KEY_ORDER else 99))
    lines = [line for key, value in schema.items() for line in _yaml_lines(key, value, 0)]
    return SCHEMA_HEADER + "\n".join(lines) + "\n"


class ConfigError(ValueError):
    """A study config that cannot be run; the message names the offending key."""


@dataclass(frozen=True)
class Study:
    """A study resolved: its runs by id in the order they run, its measurements as jobs, and the typed file."""

    name: str
    data: dict[str, Any]
    models: dict[str, dict[str, Any]]
    engine_envs: dict[str, dict[str, Any]]
    # run_id -> resolved run, in the order the study runs them (replicates interleaved: see `interleaved`)
    runs: dict[str, RunConfig] = field(default_factory=dict)
    measurements: dict[str, MeasureJob] = field(default_factory=dict)
    node: Node = field(default_factory=Node)
    run_minutes: int | None = None
    # run id or measurement name -> its place in the study's order (1 first): SLURM's --nice on one node
    ranks: dict[str, int] = field(default_factory=dict)


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


def _is_int(checker: Any, instance: Any) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


# JSON Schema counts 3.0 as an integer; a study must not (RunConfig refuses it too, and it would change the run id)
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_int))


def _non_finite(value: Any, where: str) -> str | None:
    """The dotted key of the first NaN or infinity in a parsed study (YAML's .nan and .inf), or None. JSON Schema's
    bounds cannot catch one: every comparison with NaN is false."""
    if isinstance(value, float) and not math.isfinite(value):
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if found := _non_finite(item, f"{where}.{key}" if where else str(key)):
            return found
    return None


def validate(raw: dict[str, Any], source: str = "config") -> None:
    """Raise ConfigError naming the first offending key, before anything runs."""
    if where := _non_finite(raw, ""):
        raise ConfigError(f"{source}: {where}: not a finite number")
    schema = yaml.safe_load(SCHEMA.read_text())
    validator = _Validator(schema)
    errors = sorted(validator.iter_errors(raw), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        # the deepest error names the key most precisely
        best = jsonschema.exceptions.best_match(errors)
        path = list(best.absolute_path)
        if path[:1] == ["measurements"] and len(path) >= 2:  # one of several kinds: the model names the key
            raise ConfigError(f"{source}: {_measurement_error(raw['measurements'][path[1]], path[1])}")
        raise ConfigError(f"{source}: {_describe(best)}")


def _measurement_error(entry: Any, i: int) -> str:
    try:
        pydantic.TypeAdapter(Measurement).validate_python(entry)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]][1:]  # the first is the kind's tag
        return f"measurements.{i}{''.join('.' + p for p in loc)}: {err['msg']}"
    return f"measurements.{i}: not a measurement"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def run_config(raw: dict[str, Any], models: dict[str, Any], where: str) -> RunConfig:
    """A merged `defaults` + run entry as a RunConfig; raises ConfigError naming the key."""
    if raw.get("model") not in models:
        raise ConfigError(f"{where}.model: {raw.get('model')!r} is not defined under models "
                          f"(defined: {', '.join(models)})")
    try:
        run = RunConfig.model_validate(raw)
    except pydantic.ValidationError as exc:  # the schema let it through: still one line, naming the key
        raise ConfigError(f"{where}.{_first_error(exc)}") from None
    _check_run(run, where)
    return run


def read_run_spec(path: Path) -> RunSpec:
    """A run_config rule's JSON file as a RunSpec; ConfigError naming the key if it does not hold one."""
    try:
        return RunSpec.model_validate_json(Path(path).read_text())
    except pydantic.ValidationError as exc:
        raise ConfigError(f"{path}: {_first_error(exc)}") from None


def with_overrides(run: RunConfig, overrides: dict[str, Any], where: str) -> RunConfig:
    """The run with some keys set anew, validated as a study's run is; ConfigError naming the key."""
    try:
        return RunConfig.model_validate({**run.model_dump(), **overrides})
    except pydantic.ValidationError as exc:
        raise ConfigError(f"{where}: {_first_error(exc)}") from None


def _first_error(exc: pydantic.ValidationError) -> str:
    err = exc.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc']) or '<top level>'}: {err['msg']}"


def _check_run(run: RunConfig, where: str) -> None:
    """What no single key can say: combinations that cannot run."""
    if run.placement == "colocate" and run.device != "cuda" and run.engine_sleep:
        raise ConfigError(f"{where}.placement: colocate needs device: cuda (sleep mode is GPU-only), or "
                          "engine_sleep: false")
    if not run.engine_sleep and run.placement != "colocate":
        raise ConfigError(f"{where}.engine_sleep: only a colocated engine sleeps (placement {run.placement}); drop "
                          "the key")
    if run.engine == "sglang" and run.device != "cuda":
        raise ConfigError(f"{where}.engine: sglang has no CPU build; use device: cuda")
    if run.trainer == "none" and run.placement != "colocate":
        raise ConfigError(f"{where}.trainer: 'none' (memory ballast) only makes sense with placement: colocate")
    if run.engine in ("vllm", "vllm-inprocess") and run.vllm_sleep_level == 2:
        # seen on the H200 (bench --probe): reload_weights looks up
        # checkpoint names that LoRA wrapping moved under base_layer (vllm-project/vllm#39934)
        raise ConfigError(f"{where}.vllm_sleep_level: 2 does not work with LoRA in vLLM 0.26: waking from it "
                          "reloads the weights, which fails on LoRA-wrapped layers (vllm-project/vllm#39934); "
                          "use 1")
    if run.overlap and run.placement != "split":
        raise ConfigError(f"{where}.overlap: rollout and training overlap only on separate GPUs (placement: split), "
                          f"not with {run.placement}")
    if not run.vllm_detokenize and run.engine != "vllm-inprocess":
        raise ConfigError(f"{where}.vllm_detokenize: only in-process vLLM detokenizes in the controller's process "
                          f"(engine {run.engine} does it in its own); drop the key")
    if not run.sglang_detokenize and run.engine != "sglang":
        raise ConfigError(f"{where}.sglang_detokenize: SGLang's flag (--skip-tokenizer-init), not engine "
                          f"{run.engine}'s; for in-process vLLM it is vllm_detokenize")
    client_keys = (("rollout_process", "no rollout client to move"), ("keep_connections", "no connections to keep"))
    for key, lacks in client_keys:  # the rollout client's keys: server engines only
        if getattr(run, key) and run.engine == "vllm-inprocess":
            raise ConfigError(f"{where}.{key}: vllm-inprocess has {lacks} (it generates in the controller's own "
                              "process); use engine vllm or sglang, or drop the key")
    if run.keep_connections and run.shared_pool:
        raise ConfigError(f"{where}.keep_connections: the old client's one shared pool (shared_pool) is made anew "
                          "for each rollout, so nothing would be kept; drop one of the two keys")
    if run.onload_beside_release:
        _check_onload_beside_release(run, where)
    if run.release_comms and (run.trainer != "megatron" or run.train_tp * run.train_ep < 2):
        raise ConfigError(f"{where}.release_comms: only the megatron trainer on 2 or more GPUs (train_tp x train_ep) "
                          f"has process groups to release (trainer {run.trainer}, train_tp {run.train_tp}, train_ep "
                          f"{run.train_ep}); drop the key")
    if run.train_ep > 1:
        _check_train_ep(run, where)
    else:
        for key in ("ep_dispatch", "ep_batch"):
            if getattr(run, key) != RunConfig.model_fields[key].default:
                raise ConfigError(f"{where}.{key}: {getattr(run, key)} changes the megatron trainer at train_ep > 1, "
                                  f"and this run has train_ep {run.train_ep}; drop the key")
    if run.trainer == "megatron" and run.lora.rank % run.train_tp:
        raise ConfigError(f"{where}.lora.rank: {run.lora.rank} is not divisible by train_tp {run.train_tp}")


def _check_onload_beside_release(run: RunConfig, where: str) -> None:
    """onload_beside_release: only where an engine releases its weights in a call of their own and a trainer comes
    back onto the GPU at every step."""
    key = f"{where}.onload_beside_release"
    if run.placement != "colocate" or not run.engine_sleep:
        raise ConfigError(f"{key}: only a colocated engine that sleeps releases anything (placement {run.placement}, "
                          f"engine_sleep {run.engine_sleep}); drop the key")
    if run.engine != "sglang" or run.sglang_release != "all":
        raise ConfigError(f"{key}: only SGLang releasing its weights (sglang_release: all) can release them in a "
                          f"call after its KV cache's (engine {run.engine}"
                          + (f", sglang_release {run.sglang_release}" if run.engine == "sglang" else "")
                          + "); drop the key")
    if run.trainer == "none":
        raise ConfigError(f"{key}: trainer none has no onload to run beside the release; drop the key")
    if run.keep_base_on_gpu is True:
        raise ConfigError(f"{key}: keep_base_on_gpu true keeps the frozen base on the GPU, so the onload moves the "
                          "LoRA state alone and nothing worth overlapping; use keep_base_on_gpu false or auto")


def _check_train_ep(run: RunConfig, where: str) -> None:
    """train_ep > 1: the megatron trainer's MoE experts split over train_ep GPUs, at train_tp 1, on as many GPUs as
    the placement gives the trainer (whether the model has experts, and how many, is checked when the trainer
    starts: spec.check_expert_parallel)."""
    if run.trainer != "megatron":
        raise ConfigError(f"{where}.train_ep: expert parallelism is the megatron trainer's (trainer {run.trainer}); "
                          "drop the key")
    if run.train_tp > 1:
        raise ConfigError(f"{where}.train_ep: {run.train_ep} with train_tp {run.train_tp}: mixture-of-experts models "
                          "train at train_tp 1; shard them by train_ep alone")
    if run.device == "cuda":
        have = run.train_gpus if run.placement == "split" else run.tp
        if run.train_ep > have:
            what = "train_gpus" if run.placement == "split" else "the engine's tp (colocate: the trainer shares them)"
            raise ConfigError(f"{where}.train_ep: {run.train_ep} needs {run.train_ep} GPUs, and {what} is {have}")


def check_model_sources(models: dict[str, dict[str, Any]], source: str = "config") -> None:
    for name, spec in models.items():
        if "path" in spec and not Path(spec["path"]).expanduser().exists():
            raise ConfigError(f"{source}: models.{name}.path: {spec['path']} does not exist")
        for key in ("vocab_size", "vocab_multiple"):  # Qwen's vocabulary has Qwen3's size, nothing to choose
            if spec.get("tokenizer") == "qwen" and key in spec:
                raise ConfigError(f"{source}: models.{name}.{key}: not used with tokenizer: qwen "
                                  "(the model takes Qwen3's 151,936 vocab rows)")


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


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error, not the later value silently winning (a merge
    `<<:` may still be overridden: that is what it is for)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            with contextlib.suppress(TypeError):  # an unhashable key: PyYAML's own error follows
                if key in seen:
                    first = seen[key]
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice in one mapping (first at line {first.line + 1})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file; a syntax error raises ConfigError with one line naming file, line and column."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = _line_column(data, exc.start)
        raise ConfigError(f"{path}:{line}:{column}: not UTF-8 text (byte {data[exc.start]:#04x})") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
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
    try:
        typed = StudyConfig.model_validate(raw)
    except pydantic.ValidationError as exc:  # the schema let it through: still one line, naming the key
        raise ConfigError(f"{source}: {_first_error(exc)}") from None
    check_model_sources(raw["models"], source)
    configs: list[tuple[str, RunConfig]] = []
    seen: set[str] = set()
    for i, over in enumerate(raw["runs"]):
        run = run_config(_merge(raw["defaults"], over), raw["models"], f"{source}: runs[{i}]")
        rid = run_id(run)
        if rid in seen:
            raise ConfigError(f"{source}: runs[{i}] resolves to the same run as an earlier entry ({rid})")
        seen.add(rid)
        configs.append((rid, run))
    order = interleaved(configs, balanced=typed.order == "balanced")
    runs = {rid: run for rid, run, _ in order}
    try:
        measurements = resolve_measurements(typed.measurements, runs, short_names(runs))
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    study = Study(name=raw["study"], data=raw["data"], models=raw["models"], engine_envs=raw.get("engine_envs", {}),
                  runs=runs, measurements=measurements, node=typed.node, run_minutes=typed.run_minutes,
                  ranks=job_ranks(order, measurements, balanced=typed.order == "balanced"))
    check_node(study, source)
    return study


def check_node(study: Study, source: str) -> None:
    """A run or measurement that needs more GPUs than the study's node has is refused before anything runs."""
    limit = study.node.gpus
    if limit is None:
        return
    needs = {f"run {rid}": run.tp + (run.train_gpus if run.placement == "split" else 0)
             for rid, run in study.runs.items() if run.device == "cuda"}
    needs.update({f"measurement {name}": job.gpus for name, job in study.measurements.items() if job.device == "cuda"})
    for what, n in needs.items():
        if n > limit:
            raise ConfigError(f"{source}: {what} needs {n} GPUs but node.gpus is {limit}: lower its tp or train_gpus, "
                              "or run the study on a larger node")


def interleaved(configs: list[tuple[str, RunConfig]], balanced: bool = False) -> list[tuple[str, RunConfig, int]]:
    """Every replicate of every configuration, round by round (A1 B1 C1 A2 B2 C2 ...), each with its round: the
    order in which the study runs them, so that a slow drift of the host (thermals, caches, neighbours) falls on
    every arm alike. balanced reverses every second round (A1 B1 B2 A2 ...), so that no configuration always runs
    first."""
    rounds = max((run.replicates for _, run in configs), default=0)
    out = []
    for k in range(1, rounds + 1):
        this = [(run_id(run, k), run, k) for _, run in configs if k <= run.replicates]
        out += this[::-1] if balanced and k % 2 == 0 else this
    return out


def job_ranks(order: list[tuple[str, RunConfig, int]], measurements: Mapping[str, MeasureJob],
              balanced: bool = False) -> dict[str, int]:
    """Each run's and measurement's place in the study's order (1 first): the runs as `interleaved` orders them,
    each measurement after the round its `after_round` names (else after every run), in the file's order. The
    processes of replicated trainer tools placed there together go round by round as runs do (A1 B1 A2 B2, or
    A1 B1 B2 A2 when balanced), so that no setting has all of its processes first; a TRL peer's process K goes
    one round later than its process K - 1, beside the runs it is set against."""
    last = max((k for *_, k in order), default=0)
    keyed = [((k, 0, 0, i), rid) for i, (rid, _, k) in enumerate(order)]
    for i, (name, job) in enumerate(measurements.items()):
        within = -i if balanced and job.replicate % 2 == 0 else i
        after = job.spec.after_round or last
        if job.kind == "peer_trl":  # TRL's process K after round K's runs: a drift of the host falls on both sides
            after += job.replicate - 1
        keyed.append(((min(after, last), 1, job.replicate, within), name))
    return {name: rank for rank, (_, name) in enumerate(sorted(keyed), 1)}


def short_name(rid: str, run: RunConfig) -> str:
    """The name measurements call a run by: its `name`, else engine-placement[-megatron]; replicate k > 1 gets
    -r<k>, as its run id does (NAME, NAME-r2, ...)."""
    short = run.name or "-".join([run.engine, run.placement] + (["megatron"] if run.trainer == "megatron" else []))
    k = split_replicate(rid)[1]
    return short + (f"-r{k}" if k > 1 else "")


def short_names(runs: dict[str, RunConfig]) -> dict[str, str]:
    """{short name: run id} for every run, in the study's order. Two runs of one short name share it with no
    measurement able to tell them apart: the later is left out (a measurement naming it is refused)."""
    index: dict[str, str] = {}
    for rid, run in runs.items():
        index.setdefault(short_name(rid, run), rid)
    return index


# `python -m hybridrl data`'s defaults, where a study's `data` leaves a key out
DATA_DEFAULTS: dict[str, Any] = {"n_train": 512, "n_test": 128, "seed": 0, "steps": 1}


def dataset_name(data: dict[str, Any]) -> str:
    if data["source"] == "gsm8k":
        return "gsm8k"
    d = {**DATA_DEFAULTS, **data}  # one-step data keeps the name it always had
    return f"synthetic-s{d['seed']}-n{d['n_train']}-{d['n_test']}" + (f"-k{d['steps']}" if d["steps"] != 1 else "")
