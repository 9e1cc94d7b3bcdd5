"""Placements compared within one engine: each placement of an engine against its colocated arm.

The headline tables compare engines within a placement; this compares placements within an engine, which is the
other half of the study's question. A placement pays for every GPU it holds, so besides step time it is judged by
the step's tokens per GPU and the GPU-seconds a step costs (aggregate.derive), each a ratio of medians with
its two-level interval over runs and steps (stats.compare). Arms pair only where the engine, trainer, model, seed
and rollout client match, as the headline's pairs do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from hybridrl.report import conditions, stats, wording
from hybridrl.report.aggregate import AWAKE, overlap_steps, placement_name, shared_split
from hybridrl.report.headline import pairable
from hybridrl.run.record import COMPARED_STEP

BASE = "colocate"
PAIR_KEY = ("engine", "trainer", "model", "seed", "client")
ENGINES = {"sglang": "SGLang", "vllm": "vLLM server", "vllm-inprocess": "vLLM in-process"}


@dataclass(frozen=True)
class Metric:
    column: str
    name: str
    unit: str
    higher_is_better: bool
    better: str
    worse: str


METRICS = (
    Metric(COMPARED_STEP, stats.STEP_COMPARED, "s", False, "faster", "slower"),
    Metric("cost/tok_s_per_gpu", stats.TOK_S_PER_GPU, "tok/s", True, "higher", "lower"),
    Metric("cost/gpu_s_per_step", stats.GPU_S_PER_STEP, "GPU-s", False, "lower", "higher"),
)


@dataclass(frozen=True)
class Arm:
    config_id: str
    label: str  # the placement as a reader names it: "colocate", "split", "overlapped split (1 step stale)", ...
    values: tuple[stats.Estimate, ...]  # each metric's median over runs and steps
    ratios: tuple[stats.Estimate | None, ...]  # each metric against the colocated arm (None for that arm)
    n: tuple[int, int]  # runs, steady-state steps
    recorded: str  # against the colocated arm: interleaved, before, after
    conclusions: tuple[str, ...]


@dataclass(frozen=True)
class Group:
    engine: str
    key: dict[str, Any]
    arms: tuple[Arm, ...]  # the colocated arm first
    caveats: tuple[str, ...]
    # an overlapped split against the plain split of the same engine: its step time ratio and the sentence on it
    against_split: tuple[tuple[stats.Estimate, str], ...] = ()


def arm_label(run: pd.Series) -> str:
    """The placement in a table: its name, how stale an overlapped split's rollouts may be, whether a colocated
    engine stayed awake, and whether a split shared one GPU."""
    k = overlap_steps(run)
    stale = f" ({k} step{'s' if k != 1 else ''} stale)" if k > 0 else ""
    awake = ", engine awake" if str(run.get("release")) == AWAKE else ""
    return placement_name(run) + stale + awake + (", one shared GPU" if shared_split(run) else "")


def _configs(df: pd.DataFrame) -> pd.DataFrame:
    """Each configuration's first row, indexed by config_id, in the report's order."""
    order = [c[-1] for c in stats.configs(df)]
    return df.drop_duplicates("config_id").set_index("config_id").loc[order]


def pairings(df: pd.DataFrame) -> list[tuple[str, list[str]]]:
    """Each colocated configuration with the other placements that pair with it (those with none are left out):
    the groups' members, found without any statistics."""
    runs = _configs(df)
    out = []
    for base in runs.index[(runs["placement"] == BASE).fillna(False).to_numpy(dtype=bool)]:
        others = [c for c in runs.index if c != base and runs.at[c, "placement"] != BASE
                  and all(pairable(k, runs.at[base, k], runs.at[c, k]) for k in PAIR_KEY)]
        if others:
            out.append((base, others))
    return out


def groups(df: pd.DataFrame) -> list[Group]:
    """Per engine and pairable colocated configuration: that arm first, then every other placement that pairs
    with it; engines with no colocated arm, or nothing to set beside it, give no group."""
    runs = _configs(df)
    steady = stats.steady_state(df)
    wins = conditions.windows(df)
    out = []
    for base, others in pairings(df):
        arms = tuple(_arm(steady, wins, runs, c, base) for c in (base, *others))
        engine = ENGINES.get(str(runs.at[base, "engine"]), str(runs.at[base, "engine"]))
        out.append(Group(engine, {k: runs.at[base, k] for k in PAIR_KEY if k != "engine"}, arms,
                         _caveats(df, runs, base, others, wins), _against_split(steady, runs, others)))
    return out


def _ratio(a: pd.DataFrame, b: pd.DataFrame, column: str) -> stats.Estimate:
    """a / b of two configurations' steady-state medians, over runs and steps (stats.compare on frames already
    in the steady state)."""
    return stats.hierarchical_ratio(stats.per_run(a, column), stats.per_run(b, column))


def _against_split(steady: pd.DataFrame, runs: pd.DataFrame,
                   others: list[str]) -> tuple[tuple[stats.Estimate, str], ...]:
    """What running rollout and training at once bought over taking turns on the same GPUs: each overlapped
    split's step time against each plain split of the group."""
    plain = [c for c in others if runs.at[c, "placement"] == "split" and overlap_steps(runs.loc[c]) == 0]
    ahead = [c for c in others if overlap_steps(runs.loc[c]) > 0]
    out = []
    for a in ahead:
        for b in plain:
            sides = [steady[steady["config_id"] == c] for c in (a, b)]
            est = _ratio(*sides, COMPARED_STEP)
            n = [(stats.n_runs(x), len(x)) for x in sides]
            out.append((est, wording.conclusion(stats.STEP_COMPARED, "overlapped split", "split", est, n[0], n[1],
                                                False, "faster", "slower")))
    return tuple(out)


def _arm(steady: pd.DataFrame, wins: list[conditions.Window], runs: pd.DataFrame, config: str, base: str) -> Arm:
    mine, theirs = (steady[steady["config_id"] == c] for c in (config, base))
    n = (stats.n_runs(mine), len(mine))
    values = tuple(stats.estimate(mine, m.column) for m in METRICS)
    if config == base:
        return Arm(config, arm_label(runs.loc[config]), values, (None,) * len(METRICS), n, "–", ())
    ratios = tuple(_ratio(mine, theirs, m.column) for m in METRICS)
    name = placement_name(runs.loc[config])
    n_base = (stats.n_runs(theirs), len(theirs))
    base_name = arm_label(runs.loc[base])  # colocate, or colocate, engine awake
    said = tuple(wording.conclusion(m.name, name, base_name, r, n, n_base, m.higher_is_better, m.better, m.worse)
                 for m, r in zip(METRICS, ratios, strict=True))
    return Arm(config, arm_label(runs.loc[config]), values, ratios, n, conditions.relation(wins, config, base), said)


def _caveats(df: pd.DataFrame, runs: pd.DataFrame, base: str, others: list[str],
             wins: list[conditions.Window]) -> tuple[str, ...]:
    """What the group's comparisons could not control: a shared GPU, unequal engine shares, arms not
    interleaved, and different code, GPUs or machines."""
    out = []
    if any(shared_split(runs.loc[c]) for c in others):
        out.append("a split arm saw fewer GPUs than it asks for: its engine shared the trainer's GPU, so it "
                   "compares taking turns on one GPU with working side by side on it, not a split onto GPUs of its "
                   "own")
    shares = {s for s in (runs.at[c, "gpu_memory_utilization"] for c in (base, *others)) if pd.notna(s)}
    if len(shares) > 1:
        out.append(f"the engine was given different shares of its GPU ({', '.join(f'{s:g}' for s in sorted(shares))})"
                   ", so its KV cache, and what a rollout could batch, differed between arms")
    for c in others:
        note = conditions.order_caveat(wins, c, base, placement_name(runs.loc[c]), arm_label(runs.loc[base]))
        if note:
            out.append(note)
    rows = df[df["config_id"].isin([base, *others]).fillna(False).to_numpy(dtype=bool)]
    for what, [values] in conditions.recorded_apart([rows]):
        out.append(f"recorded by different {what}: {', '.join(values)}")
    return tuple(out)
