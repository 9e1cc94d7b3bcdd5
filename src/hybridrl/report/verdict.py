"""The report's opening verdict: one sentence for each pair the report compares, in plain words.

The pairs are the ones the sections below already choose: SGLang against each vLLM variant per placement
(headline.py), each placement of an engine against its colocated arm and an overlapped split against a plain one
(placements.py). A study that has neither, such as one whose arms are placements without a colocated one, gets the
pairs of its ratio table instead: each configuration against the first. Every sentence comes from
wording.conclusion, so it ranks only where the interval excludes no difference and says plainly where there is no
interval at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from hybridrl.report import headline, placements, stats, wording
from hybridrl.report.cells import has_data
from hybridrl.run.record import COMPARED_STEP

# what an engine pair is judged by (its rollout, the engine's own work) and what a placement pair is judged by
# (the whole step, which is what a placement changes): the first metric of each that both sides recorded
ENGINE_METRIC = "Rollout throughput"
STEP_METRICS = ((COMPARED_STEP, stats.STEP_COMPARED, False), ("perf/throughput", "Rollout throughput", True))


@dataclass(frozen=True)
class Line:
    pair: str  # which two arms, as the section below titles them
    sentence: str
    caveats: int = 0  # how many caveats the section below gives for the pair


def engine_lines(found: list[headline.Headline]) -> list[Line]:
    """Each engine pair's rollout throughput sentence (its first metric where throughput is missing)."""
    out = []
    for h in found:
        row = next((r for r in h.rows if r.metric.name == ENGINE_METRIC), h.rows[0])
        out.append(Line(h.title, headline.sentence(row, headline.VLLM_VARIANTS[h.vllm_engine]), len(h.caveats)))
    return out


def placement_lines(found: list[placements.Group]) -> list[Line]:
    """Each placement against its engine's colocated arm, then each overlapped split against a plain split, on
    step time (placements.METRICS' first)."""
    out = []
    for g in found:
        out += [Line(f"{g.engine}: {arm.label} vs {placements.BASE}", arm.conclusions[0], len(g.caveats))
                for arm in g.arms[1:]]
        out += [Line(f"{g.engine}: overlapped split vs split", said, len(g.caveats)) for _, said in g.against_split]
    return out


def configuration_lines(df: pd.DataFrame, labels: dict[str, str]) -> list[Line]:
    """Each configuration against the first, as the ratio table sets them, on step time (or rollout throughput
    where no step time was recorded)."""
    configs, steady = stats.configs(df), stats.steady_state(df)
    metric = next((m for m in STEP_METRICS if has_data(steady, m[0])), None)
    if len(configs) < 2 or metric is None:
        return []
    column, name, higher = metric
    base = configs[0]
    out = []
    for config in configs[1:]:
        sides = [stats.select(steady, c) for c in (config, base)]
        n = [(stats.n_runs(s), len(s)) for s in sides]
        a, b = labels[config[-1]], labels[base[-1]]
        est = stats.compare(df, column, config, base)
        out.append(Line(f"{a} vs {b}", wording.conclusion(name, a, b, est, n[0], n[1], higher)))
    return out


def lines(df: pd.DataFrame, labels: dict[str, str], heads: list[headline.Headline],
          groups: list[placements.Group]) -> list[Line]:
    """The verdict's sentences: engine pairs, then placement pairs; the ratio table's pairs where there are none."""
    return [*engine_lines(heads), *placement_lines(groups)] or configuration_lines(df, labels)


def nothing_compared(df: pd.DataFrame) -> str:
    """What the verdict says where it has no pair."""
    n = int(df["config_id"].nunique())
    if n < 2:
        return "One configuration, so nothing is compared: the tables below describe its runs."
    return (f"{n} configurations, but no step time or rollout throughput recorded in two of them to set side by "
            "side: the tables below describe each on its own.")
