"""One engine through two rollout clients: configurations alike in every field but the client.

The baseline of a pair is the path that streams more (the old client: every request streamed through one shared
pool); the ratio is the other path over it, so above 1 means the lighter client let more of the engine through.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import pandas as pd

from hybridrl.report import stats
from hybridrl.report.aggregate import CONFIG_KEY

# every configuration field but these must match: the client is what differs, config_id names each side
APART = ("client", "config_id")
METRICS = (("perf/throughput", "Rollout throughput"), ("timing_s/gen", "Generation time"))


@dataclass(frozen=True)
class ClientPair:
    baseline: tuple  # the configuration that streams more
    other: tuple
    ratios: tuple[stats.Estimate, ...]  # other / baseline, one per METRICS entry
    cpu: tuple[float, float]  # median controller CPU % in rollout: baseline, other


def _streaming(df: pd.DataFrame, config: tuple) -> tuple[float, float]:
    """How much a configuration streams: its share of streamed requests, then whether it shares one pool."""
    rows = stats.select(df, config)
    share = pd.to_numeric(rows["stream_fraction"], errors="coerce").max()
    pool = pd.to_numeric(rows["shared_pool"], errors="coerce").max()
    return (1.0 if pd.isna(share) else float(share), 1.0 if pd.isna(pool) else float(pool))


def _seed(df: pd.DataFrame, config: tuple) -> object:
    seeds = stats.select(df, config)["seed"].dropna().unique() if "seed" in df.columns else []
    return tuple(sorted(seeds))


def pairs(df: pd.DataFrame) -> list[ClientPair]:
    """Every two configurations that differ only in their rollout client (and share the seed, so the request
    sets match), with the other path over the baseline's steady-state medians and 95% intervals."""
    keep = [i for i, k in enumerate(CONFIG_KEY) if k not in APART]
    at = CONFIG_KEY.index("client")
    steady = stats.steady_state(df)
    out = []
    for a, b in combinations(stats.configs(df), 2):
        # as text, so that fields never recorded (NA, as in runs older than the client key) compare as equal
        if ([str(a[i]) for i in keep] != [str(b[i]) for i in keep] or str(a[at]) == str(b[at])
                or _seed(df, a) != _seed(df, b)):
            continue
        base, other = (a, b) if _streaming(df, a) >= _streaming(df, b) else (b, a)
        ratios = tuple(stats.compare(df, m, other, base) for m, _ in METRICS)
        cpu = tuple(float(pd.to_numeric(stats.select(steady, c)["host/controller_cpu_pct_gen"],
                                        errors="coerce").median()) for c in (base, other))
        out.append(ClientPair(base, other, ratios, (cpu[0], cpu[1])))
    return out
