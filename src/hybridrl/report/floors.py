"""The report's floor table: each phase's steady-state median beside its physical floor (report.floor_model) and
their ratio, per configuration.

What a floor needs, per run: its GPU's entry in hybridrl.gpu_specs (an unknown GPU, or none, has no floor), the
model's shape (provenance's model_shape; runs recorded before it existed take the study's config/*.yaml model spec,
and have none where that cannot give the vocabulary), its request records for the rollout's lengths (else the step's
means, still a floor) and, for the copies, the host<->device bandwidth measured at its start (provenance's
copy_bandwidth; older runs have none, and their copy floors read "not measured").
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from hybridrl import gpu_specs
from hybridrl.report import floor_model, stats
from hybridrl.report.aggregate import read_provenance, to_bool
from hybridrl.report.cells import Cell, Table, fmt
from hybridrl.run import request_records
from hybridrl.run.onload_beside_release import DONE as ONLOAD_BESIDE

CONFIGS = Path(__file__).resolve().parents[3] / "config"
# (column, phase as the table names it)
PHASES = (
    ("timing_s/gen", "rollout: prefill + decode"),
    ("timing_s/update_actor", "update"),
    ("timing_s/trainer_onload", "trainer onload"),
    ("timing_s/trainer_offload", "trainer offload"),
    ("timing_s/sleep", "engine sleep"),
    ("timing_s/release_onload", "engine weights out beside trainer onload"),
    ("timing_s/wake", "engine wake"),
    ("timing_s/update_weights", "adapter sync"),
)
RECORDED = "the run's recorded model shape"
HEADERS = ["configuration", "phase", "median (s)", "floor (s)", "median / floor", "floor from"]


@dataclass(frozen=True)
class Floor:
    seconds: float | None  # None: no floor, for the reason in `basis`
    basis: str  # what it rests on, or why there is none


@dataclass(frozen=True)
class RunInputs:
    run_id: str
    config: dict[str, Any]  # the run's config ("run" block of config.json)
    gpu: str | None
    spec: gpu_specs.GpuSpec | None
    shape: floor_model.Shape | None
    shape_source: str
    bandwidth: dict[str, Any] | None
    run_dir: Path

    @property
    def shape_recorded(self) -> bool:
        return self.shape_source == RECORDED


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB"


@cache  # once a study and model, not once a run: a report reads every run of a study, `reports` every study
def _study_shape(study: str | None, model: str | None) -> dict[str, Any] | None:
    """A run's model shape from the study's config (runs that recorded none): the model spec's shape keys and
    Qwen's vocabulary where it names Qwen's tokenizer; None where no config declares that model with a shape."""
    from hybridrl.study.qwen_vocab import MODEL_VOCAB

    for path in sorted(CONFIGS.glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        spec = (data.get("models") or {}).get(model) if data.get("study") == study else None
        if not isinstance(spec, dict) or "arch" not in spec:
            continue
        if "vocab_size" not in spec and spec.get("tokenizer") != "qwen":
            return None  # a trained tokenizer's length is known only to the model it built
        vocab = MODEL_VOCAB if spec.get("tokenizer") == "qwen" else spec.get("vocab_size")
        return {**spec, "vocab_size": vocab, "_source": path.name}
    return None


def run_inputs(run_dir: Path) -> RunInputs:
    """What the floors of one run rest on, read from its folder."""
    prov = read_provenance(run_dir / "provenance.json") or {}
    config = read_provenance(run_dir / "config.json") or {}
    run = config.get("run") or prov.get("run_config") or {}
    names = sorted({d.get("name") for d in (prov.get("gpu") or {}).get("devices") or [] if d.get("name")})
    gpu = names[0] if len(names) == 1 else (" + ".join(names) or None)
    shape, source = None, "no model shape recorded"
    recorded = prov.get("model_shape")
    if recorded:
        shape, source = floor_model.shape_of(recorded), RECORDED
    else:
        found = _study_shape(config.get("study"), run.get("model"))
        if found is not None:
            shape = floor_model.shape_of(found)
            source = f"config/{found['_source']} (the run recorded none)"
    return RunInputs(run_dir.name, run, gpu, gpu_specs.spec(gpu) if len(names) == 1 else None, shape, source,
                     prov.get("copy_bandwidth"), run_dir)


def _lengths(inputs: RunInputs, row: pd.Series) -> tuple[list[int], list[int], str]:
    """(prompt tokens, completion tokens) of each request of the step: its request records, else the step's mean
    completion over every request and no prompt (both a floor: decode runs at least the mean length)."""
    try:
        recs = request_records.read(inputs.run_dir, int(row["step"]))
        return [int(r["prompt_tokens"]) for r in recs], [int(r["tokens"]) for r in recs], "request records"
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        n = int(inputs.config.get("prompts_per_step", 0)) * int(inputs.config.get("group_size", 1))
        mean = float(row.get("response_length/mean") or 0)
        return [0] * n, [round(mean)] * n, "step means (no request records)"


def _copy(inputs: RunInputs, nbytes: float | None, way: str, what: str) -> Floor:
    if nbytes is None:
        return Floor(None, f"not modelled: {what}")
    if nbytes == 0:
        return Floor(0.0, f"nothing to copy: {what}")
    if not inputs.bandwidth:
        return Floor(None, f"{_gb(nbytes)} {what}; copy bandwidth not measured (run predates the measurement)")
    rate = float(inputs.bandwidth[f"{way}_gb_s"]) * 1e9
    arrow = "host→device" if way == "h2d" else "device→host"
    return Floor(nbytes / rate, f"{_gb(nbytes)} {what} at {rate / 1e9:.1f} GB/s {arrow} (measured)")


def _lora_bytes(inputs: RunInputs, per: int, tp: int) -> float | None:
    lora = inputs.config.get("lora") or {}
    n = inputs.shape.lora_params(lora.get("target_modules") or [], int(lora.get("rank", 0))) if inputs.shape else None
    return None if n is None else n * per / tp


def _engine_moves_weights(run: dict[str, Any]) -> bool | None:
    """Whether the colocated engine's sleep copies its weights to the host (and its wake back): SGLang's KV-only
    release keeps them, its full release and vLLM's level 1 copy them; vLLM's level 2 drops them (None: its wake
    reloads them by a path not modelled here)."""
    if run.get("engine") == "sglang":
        return run.get("sglang_release") != "kv_cache"
    return True if int(run.get("vllm_sleep_level") or 1) == 1 else None


def _base_kept(inputs: RunInputs, row: pd.Series) -> bool:
    """Whether the trainer's base stayed on the GPU in this step: the step's record where it has one (auto decides
    at the run's start), else the config's setting."""
    recorded = row.get("train/keep_base_on_gpu")
    if recorded is None or pd.isna(recorded):
        return inputs.config.get("keep_base_on_gpu") is True
    return str(recorded).lower() in ("true", "1", "1.0")


def _trainer_gpus(run: dict[str, Any]) -> int:
    """The GPUs the trainer's update runs on: Megatron's ranks (train_tp x train_ep), else train_gpus."""
    if run.get("trainer") == "megatron":
        return max(int(run.get("train_tp") or 1) * int(run.get("train_ep") or 1), 1)
    return max(int(run.get("train_gpus") or 1), 1)


def phase_floor(inputs: RunInputs, column: str, row: pd.Series) -> Floor:
    """One step's floor of one phase."""
    if inputs.gpu is None:
        return Floor(None, "no GPU")
    if inputs.spec is None:
        return Floor(None, f"no floor: {inputs.gpu} is not in the GPU table")
    if column == "timing_s/update_actor":
        flops, gpus = row.get("perf/update_flops"), _trainer_gpus(inputs.config)
        if pd.isna(flops):
            return Floor(None, "no perf/update_flops recorded")
        peak = inputs.spec.peak_bf16_flops
        return Floor(float(flops) / (peak * gpus), f"{float(flops) / 1e12:.3g} TFLOP at {peak / 1e12:.0f} TFLOP/s "
                     f"× {gpus} GPU")
    if inputs.shape is None:
        return Floor(None, inputs.shape_source)
    tp, train_tp = int(inputs.config.get("tp") or 1), int(inputs.config.get("train_tp") or 1)
    if column == "timing_s/gen":
        if inputs.spec.hbm_bytes_per_s is None:
            return Floor(None, f"no floor: {inputs.gpu}'s HBM bandwidth is not in the GPU table")
        prompts, completions, source = _lengths(inputs, row)
        gen = floor_model.gen_floor(inputs.shape, prompts, completions, int(inputs.config.get("group_size") or 1),
                                    tp, inputs.spec.hbm_bytes_per_s, inputs.spec.peak_bf16_flops)
        moe = "; MoE: experts read per step under uniform routing" if inputs.shape.experts else ""
        shape = "" if inputs.shape_recorded else f"; shape from {inputs.shape_source}"
        return Floor(gen.seconds, f"{gen.decode_steps} decode steps × {_gb(gen.bytes_per_step)} (weights + KV) a GPU "
                     f"at {inputs.spec.hbm_bytes_per_s / 1e12:.3g} TB/s, TP {tp}, from {source}{moe}{shape}")
    weights = inputs.shape.weight_params * floor_model.BF16
    lora_state = _lora_bytes(inputs, 3 * floor_model.FP32, train_tp)  # fp32 weights and AdamW's two moments
    if column == "timing_s/trainer_onload":
        return _onload_floor(inputs, row, weights, lora_state)
    if column == "timing_s/trainer_offload":  # the frozen base's pinned copy is reused: only LoRA state moves
        return _copy(inputs, lora_state, "d2h", "LoRA state")
    if column == "timing_s/sleep" and to_bool(row.get(ONLOAD_BESIDE)) is True:  # the weights left in release_onload
        return _copy(inputs, 0, "d2h", "the KV cache's release (the weights leave beside the onload)")
    if column in ("timing_s/sleep", "timing_s/wake"):
        return _engine_floor(inputs, weights, tp, "d2h" if column == "timing_s/sleep" else "h2d")
    if column == "timing_s/release_onload":  # opposite ways over the link at once: the longer of the two
        floors = [_engine_floor(inputs, weights, tp, "d2h"), _onload_floor(inputs, row, weights, lora_state)]
        seconds = [f.seconds for f in floors]
        if None in seconds:
            return floors[seconds.index(None)]
        return Floor(max(seconds), f"the longer of {floors[0].basis} and {floors[1].basis}")
    if column == "timing_s/update_weights":
        return _copy(inputs, _lora_bytes(inputs, floor_model.BF16, tp), "h2d", "adapter (bf16) a GPU")
    raise ValueError(f"no floor for {column!r}")


def _onload_floor(inputs: RunInputs, row: pd.Series, weights: float, lora_state: float | None) -> Floor:
    """The trainer's onload: each of its GPUs loads its own share over its own link, the base where it was offloaded."""
    ranks = _trainer_gpus(inputs.config)
    base = 0 if _base_kept(inputs, row) else weights / ranks
    what = "LoRA state" if not base else "base weights + LoRA state" + (f" a GPU (of {ranks})" if ranks > 1 else "")
    return _copy(inputs, None if lora_state is None else base + lora_state, "h2d", what)


def _engine_floor(inputs: RunInputs, weights: float, tp: int, way: str) -> Floor:
    """The engine's sleep (d2h) or wake (h2d): its weights a GPU where its release moves them."""
    moves = _engine_moves_weights(inputs.config)
    nbytes = None if moves is None else (weights / tp if moves else 0)
    what = "engine weights a GPU" if moves else ("the KV-only release" if moves is False
                                                  else "vLLM level 2 drops its weights")
    return _copy(inputs, nbytes, way, what)


def floor_table(df: pd.DataFrame, runs_dir: Path, labels: dict[str, str]) -> Table | None:
    """Per configuration and phase: the steady-state median, the median of its steps' floors, their ratio and what
    the floor rests on; None for a table without steps."""
    if df.empty or "config_id" not in df.columns:
        return None
    steady = stats.steady_state(df)
    inputs = {rid: run_inputs(Path(runs_dir) / str(rid)) for rid in steady["run_id"].unique()}
    table = Table(list(HEADERS))
    for config in sorted(steady["config_id"].dropna().unique(), key=lambda c: labels.get(c, c)):
        sub = steady[steady["config_id"] == config]
        name = labels.get(config, config)
        for column, phase in PHASES:
            if column not in sub.columns or pd.to_numeric(sub[column], errors="coerce").notna().sum() == 0:
                continue
            median = stats.estimate(sub, column).value
            floors = [(phase_floor(inputs[r["run_id"]], column, r)) for _, r in sub.iterrows()
                      if pd.notna(pd.to_numeric(r[column], errors="coerce"))]
            table.rows.append([Cell(name, "key"), Cell(phase), Cell(fmt(median), "num"),
                               *_floor_cells(median, floors)])
    return table if table.rows else None


def _floor_cells(median: float, floors: list[Floor]) -> list[Cell]:
    seconds = [f.seconds for f in floors if f.seconds is not None]
    if not seconds:
        return [Cell("–", "na"), Cell("–", "na"), Cell(floors[0].basis if floors else "–")]
    floor = statistics.median(seconds)
    basis = next(f.basis for f in floors if f.seconds is not None)
    ratio = f"{median / floor:.1f}x" if floor > 0 else "–"
    return [Cell(f"{floor:.3g}", "num"), Cell(ratio, "num"), Cell(basis)]
