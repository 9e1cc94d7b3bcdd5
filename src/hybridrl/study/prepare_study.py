"""What a study's runs need before they start: run configs, data and models, built one way for both orchestrators.

The Snakefile's rules (workflow/rules/{common,data,model}.smk) and the leased-GPU driver
(`python -m hybridrl prepare-study`, which scripts/gpu/run_reference.sh calls) take their run configs and their
`python -m hybridrl data` / `model` arguments from the functions here, so the two cannot drift apart.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hybridrl.atomic import write_text
from hybridrl.study.config import DATA_DEFAULTS, ConfigError, Study
from hybridrl.study.models import MARKER
from hybridrl.study.run_config import RunConfig, RunSpec, split_replicate


def run_spec_json(study: Study, rid: str) -> str:
    """A run's config file as `python -m hybridrl train --run-config` reads it (the `run_config` rule's output)."""
    run = study.runs[rid]
    spec = RunSpec(run_id=rid, run=run, study=study.name, engine_env=study.engine_envs.get(run.engine, {}))
    return spec.model_dump_json()


def short_name(rid: str, run: RunConfig) -> str:
    """The name a driver plan calls a run by: its `name`, else engine-placement[-megatron]; replicate k > 1 gets
    -r<k>, as its run id does (NAME, NAME-r2, ...)."""
    short = run.name or "-".join([run.engine, run.placement] + (["megatron"] if run.trainer == "megatron" else []))
    k = split_replicate(rid)[1]
    return short + (f"-r{k}" if k > 1 else "")


def data_params(data: dict[str, Any]) -> dict[str, Any]:
    """The `data` rule's params: the study's data spec with the command's defaults filled in."""
    return {"source": data["source"], **{k: data.get(k, default) for k, default in DATA_DEFAULTS.items()}}


def model_spec(spec: dict[str, Any]) -> str:
    """A model's config entry as the `model` rule passes it to `--spec` (sorted: a reordered YAML reruns nothing)."""
    return json.dumps(spec, sort_keys=True)


def data_argv(data: dict[str, Any], out: Path) -> list[str]:
    p = data_params(data)
    return ["data", "--source", p["source"], "--n-train", str(p["n_train"]), "--n-test", str(p["n_test"]),
            "--seed", str(p["seed"]), "--steps", str(p["steps"]), "--out", str(out)]


def model_argv(spec: dict[str, Any], data_dir: Path, out: Path) -> list[str]:
    return ["model", "--spec", model_spec(spec), "--corpus", str(data_dir / "train.jsonl"),
            "--test", str(data_dir / "test.jsonl"), "--out", str(out)]


def short_names(study: Study) -> dict[str, str]:
    """{short name: run id} for every run, in the study's order; two runs of one short name are refused."""
    index: dict[str, str] = {}
    for rid, run in study.runs.items():
        short = short_name(rid, run)
        if short in index:  # two runs would share one file: a plan could not tell them apart
            raise ConfigError(f"runs {index[short]} and {rid} share the short name {short}: give one a `name`")
        index[short] = rid
    return index


def write_run_configs(study: Study, cfg_dir: Path) -> dict[str, str]:
    """<cfg_dir>/<short name>.json for every run, in the study's order; returns {short name: run id}."""
    index = short_names(study)
    for short, rid in index.items():
        write_text(cfg_dir / f"{short}.json", run_spec_json(study, rid))
    return index


def models_of(study: Study, shorts: Iterable[str]) -> list[str]:
    """The models the runs of these short names train and roll out, in the study's order of models."""
    index, shorts = short_names(study), set(shorts)  # a set: an iterator would be spent by the first pass
    unknown = sorted(shorts - set(index))
    if unknown:
        raise ConfigError(f"{study.name} has no run named {', '.join(unknown)}")
    used = {study.runs[index[s]].model for s in shorts}
    return [name for name in study.models if name in used]


def is_built(spec: dict[str, Any], out: Path) -> bool:
    """Whether `python -m hybridrl model` already built this spec at out: its marker holds every key of the spec
    with the same value. A changed spec, a build cut short (no marker) or a linked path builds again."""
    marker = out / MARKER
    if out.is_symlink() or not marker.is_file():
        return False
    try:
        built = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(built, dict) and all(built.get(k) == v for k, v in spec.items())


def _hybridrl(argv: list[str]) -> None:
    """One `python -m hybridrl` command in a process of its own, as a Snakemake job runs it."""
    print("$ python -m hybridrl " + shlex.join(argv), flush=True)
    done = subprocess.run([sys.executable, "-m", "hybridrl", *argv], check=False)
    if done.returncode:
        raise RuntimeError(f"`python -m hybridrl {argv[0]}` exited {done.returncode}")


def _model_summary(name: str, out: Path) -> str:
    config = json.loads((out / "config.json").read_text())
    shape = {k: config.get(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers")}
    warm = out / "warm_start.json"
    if not warm.exists():
        return f"{name} {shape} random init"
    w = json.loads(warm.read_text())
    return f"{name} {shape} {({k: w.get(k) for k in ('base_accuracy', 'eos_share', 'tokens', 'seconds')})}"


def prepare(study: Study, out: Path, inputs: bool = True, models: Sequence[str] | None = None) -> dict[str, str]:
    """Run configs under out/cfg/, then (inputs) the data under out/data/ and the models under out/models/: those
    named (a lease's plans name the ones their runs use, perhaps none: a model no run of theirs needs costs lease
    time), else every one the study defines. A model already built from the same spec is kept."""
    unknown = sorted(set(models or ()) - set(study.models))
    if unknown:
        raise ConfigError(f"{study.name} defines no model {', '.join(unknown)} (it has: {', '.join(study.models)})")
    index = write_run_configs(study, out / "cfg")
    for short, rid in index.items():
        print(short, rid, flush=True)
    if inputs:
        _hybridrl(data_argv(study.data, out / "data"))
        for name, spec in study.models.items():
            if models is not None and name not in models:
                continue
            if is_built(spec, out / "models" / name):
                print(f"{name}: built already, kept", flush=True)
                continue
            _hybridrl(model_argv(spec, out / "data", out / "models" / name))
            print(_model_summary(name, out / "models" / name), flush=True)
    return index
