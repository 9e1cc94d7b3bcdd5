"""Speed targets (workflow/report/targets.yaml) against a study's configurations: met where the whole 95% interval
of the configuration's steady-state median is on the target's side, missed where it is wholly on the other, not
settled where it straddles the bound. Targets live there and in the report, never in a timed test."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pandas as pd
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hybridrl.report import stats
from hybridrl.report.cells import Cell, Table, fmt
from hybridrl.study.config import ConfigError

PEER_RATIO = "peer/step_ratio"
START_OVER_CLI = "start/over_cli"
TRAINER_UPDATE = "trainer/update_s"
BENCH_METRICS = (PEER_RATIO, START_OVER_CLI, TRAINER_UPDATE)
TARGETS = Path(__file__).resolve().parents[3] / "workflow" / "report" / "targets.yaml"


class Where(BaseModel):
    """What a configuration must be for a target to apply to it; an unset field matches anything."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    engine: str | None = Field(None, description="the engine, exactly (sglang, vllm, vllm-inprocess)")
    placement: str | None = Field(None, description="the placement, exactly (colocate, split, restart)")
    gpu: str | None = Field(None, description="a part of the GPU's name (H100, H200)")
    gpu_count: int | None = Field(None, ge=1, description="how many GPUs each run held")
    model: str | None = Field(None, description="a part of the model's name in the study (0.6b, 30b-a3b)")
    gen_tokens: int | None = Field(None, ge=1, description="tokens generated a step (median): fixes the batch and, "
                                                           "with ignore_eos, the length; a trainer benchmark's "
                                                           "completion tokens an update")
    vocab: int | None = Field(None, ge=1, description="the vocabulary's rows (trainer benchmarks alone, whose record "
                                                      "names it; a run's steps do not)")


class Target(BaseModel):
    """One bound on one metric of the configurations it applies to."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="what is targeted, in words")
    issue: int | None = Field(None, description="the issue that set it")
    metric: str = Field(description="a column of steps.csv (timing_s/step_compared, timing_s/update_actor, ...), or "
                                    "a benchmark's figure: peer/step_ratio (hybridrl's compared step over a TRL "
                                    "peer's step, report/peer.py), start/over_cli (an engine's start through "
                                    "hybridrl over its own command line's, report/start_bench.py), trainer/update_s "
                                    "(a trainer benchmark's update, its processes pooled, report/trainer_bench.py)")
    against: Literal["trl-defaults", "trl-best"] | None = Field(
        None, description="peer/step_ratio only: the TRL configuration it is taken over, TRL's defaults or the "
                          "faster of the study's TRL configurations")
    at_most: float | None = Field(None, gt=0, description="the metric's median must be this or less")
    at_least: float | None = Field(None, gt=0, description="the metric's median must be this or more")
    where: Where = Field(Where(), description="the configurations it applies to")

    @model_validator(mode="after")
    def _one_bound(self) -> Target:
        if (self.at_most is None) == (self.at_least is None):
            raise ValueError("a target needs exactly one of at_most and at_least")
        if (self.metric == PEER_RATIO) != (self.against is not None):
            raise ValueError(f"`against` goes with metric {PEER_RATIO} and with it alone")
        return self

    @property
    def bound(self) -> float:
        return self.at_most if self.at_most is not None else self.at_least  # type: ignore[return-value]

    @property
    def on_steps(self) -> bool:
        """Whether the metric is a column of the steps (else a benchmark record's figure)."""
        return self.metric not in BENCH_METRICS


def load(path: Path = TARGETS) -> list[Target]:
    """The targets file, checked: one line naming the file and the first problem."""
    try:
        raw = yaml.safe_load(path.read_text()) or []
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(raw, list):
        raise ConfigError(f"{path}: a list of targets, not {type(raw).__name__}")
    out = []
    for i, entry in enumerate(raw, 1):
        try:
            out.append(Target.model_validate(entry))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(map(str, err["loc"])) or "the entry"
            raise ConfigError(f"{path}: target {i}: {where}: {err['msg']}") from None
    return out


def _median(config: pd.DataFrame, column: str) -> float:
    values = pd.to_numeric(config[column], errors="coerce") if column in config.columns else pd.Series(dtype=float)
    return float(values.median()) if values.notna().any() else float("nan")


def _gpus_held(config: pd.DataFrame) -> float:
    """The GPUs each run held (cost/gpus: a colocated run on two GPUs of a four-GPU machine held two), else the
    machine's count for steps aggregated before that column."""
    held = _median(config, "cost/gpus")
    return held if pd.notna(held) else _median(config, "gpu_count")


def applies(where: Where, config: pd.DataFrame) -> bool:
    """Whether the configuration's steps (one config_id) are what the target is about."""
    if where.vocab is not None:  # a trainer benchmark's target: the steps do not name their vocabulary
        return False
    first = config.iloc[0]
    exact = {"engine": where.engine, "placement": where.placement}
    if any(v is not None and str(first.get(k)) != v for k, v in exact.items()):
        return False
    parts = {"gpu": where.gpu, "model": where.model}
    if any(v is not None and v.lower() not in str(first.get(k, "")).lower() for k, v in parts.items()):
        return False
    if where.gpu_count is not None and _gpus_held(config) != where.gpu_count:
        return False
    return where.gen_tokens is None or _median(config, "perf/gen_tokens") == where.gen_tokens


ONE_RUN = ", one run a side: step-to-step noise only"  # an interval that holds no run-to-run spread


def judge(target: Target, est: stats.Estimate, over_runs: bool = True) -> str:
    """met, missed or not settled, from the interval: a median on the right side is not enough on its own, and
    a configuration without an interval (one step) settles nothing. Where the interval resamples runs (or
    processes) and their steps (over_runs), a verdict from one run on a side says so: its interval holds
    step-to-step noise only. An engine's starts are each a replicate of their own (over_runs False)."""
    if not (pd.notna(est.lo) and pd.notna(est.hi)):
        return "not settled: no interval"
    bound = target.bound
    inside = (lambda x: x <= bound) if target.at_most is not None else (lambda x: x >= bound)
    if inside(est.lo) == inside(est.hi):
        return ("met" if inside(est.lo) else "missed") + (ONE_RUN if over_runs and est.n_runs < 2 else "")
    return "not settled: its interval reaches past the bound"


def of_metric(metric: str, wanted: list[Target] | None = None) -> list[Target]:
    """The targets on one metric, from `wanted` or else the targets file."""
    return [t for t in (load() if wanted is None else wanted) if t.metric == metric]


def bound_text(target: Target) -> str:
    """'timing_s/step_compared ≤ 3.5': the metric and its bound."""
    return f"{target.metric} {'≤' if target.at_most is not None else '≥'} {target.bound:g}"


def cells(target: Target | None, verdict: str) -> list[Cell]:
    """A target's name, bound and verdict as a table's last three cells; dashes where no target applies."""
    if target is None:
        return [Cell("–", "na")] * 3
    return [Cell(target.name), Cell(bound_text(target)),
            Cell(verdict, {"met": "ok", "missed": "fail"}.get(verdict, "na"))]


def table(df: pd.DataFrame, labels: dict[str, str], targets: list[Target] | None = None) -> Table | None:
    """One row for each target and each configuration it applies to; None where none applies."""
    out = Table(["target", "configuration", "median [95% CI]", "bound", "verdict"])
    steady = stats.steady_state(df)
    for target in [t for t in (load() if targets is None else targets) if t.on_steps]:
        for config_id, config in df.groupby("config_id", sort=True):
            if not applies(target.where, config):
                continue
            est = stats.estimate(steady[steady["config_id"] == config_id], target.metric)
            if not pd.notna(est.value):
                continue
            name, bound, verdict = cells(target, judge(target, est))
            out.rows.append([name, Cell(labels.get(str(config_id), str(config_id))),
                             Cell(f"{fmt(est.value)} [{fmt(est.lo)}, {fmt(est.hi)}]", "num"), bound, verdict])
    return out if out.rows else None
