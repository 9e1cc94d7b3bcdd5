"""When each run was recorded, and what else ran beside it (fair comparisons need runs recorded close
in time, interleaved between arms, with nothing else on the host).

A run's window runs from its engine's start (step 1's `timing_s/engine_start`, before that step began) to its
last step's end, from each step's `time_unix` (its end) and `timing_s/step`: another run's start-up keeps the
host busy for minutes, so it counts as beside. Two runs whose windows overlap shared the host while measuring.
Two arms are interleaved where neither arm's runs all come before the other's; otherwise a drift of the host,
or a change of machine between two leases, falls on one arm only.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from hybridrl.engines.jit_cache import engine_family


@dataclass(frozen=True)
class Window:
    run_id: str
    config_id: str
    start: float  # unix seconds
    stop: float

    def overlaps(self, other: Window) -> bool:
        return self.start < other.stop and other.start < self.stop


def windows(df: pd.DataFrame) -> list[Window]:
    """Each run's wall-clock window, in the order the runs started; runs without times are left out."""
    if "time_unix" not in df.columns or "timing_s/step" not in df.columns:
        return []
    stop = pd.to_numeric(df["time_unix"], errors="coerce")
    step = pd.to_numeric(df["timing_s/step"], errors="coerce")
    engine = (pd.to_numeric(df["timing_s/engine_start"], errors="coerce").fillna(0.0)
              if "timing_s/engine_start" in df.columns else 0.0)
    frame = pd.DataFrame({"run_id": df["run_id"], "config_id": df["config_id"], "start": stop - step - engine,
                          "stop": stop}).dropna()
    by_run = frame.groupby("run_id").agg(config_id=("config_id", "first"), start=("start", "min"),
                                         stop=("stop", "max"))
    return [Window(str(r), str(row.config_id), float(row.start), float(row.stop))
            for r, row in by_run.sort_values("start").iterrows()]


def beside(wins: list[Window]) -> dict[str, list[str]]:
    """For each run, the other runs whose windows overlapped its own."""
    return {w.run_id: [o.run_id for o in wins if o is not w and w.overlaps(o)] for w in wins}


def utc(t: float) -> str:
    return pd.Timestamp(t, unit="s").strftime("%Y-%m-%d %H:%M")


def span(start: float, stop: float) -> str:
    """'YYYY-MM-DD hh:mm–hh:mm UTC', the date once where both ends share it."""
    a, b = utc(start), utc(stop)
    return f"{a}–{b[11:] if a[:10] == b[:10] else b} UTC"


def _arm(wins: list[Window], config: str) -> list[Window]:
    return [w for w in wins if w.config_id == config]


def _gap_min(first: list[Window], later: list[Window]) -> float:
    """Minutes from the end of the earlier arm's last run to the start of the later arm's first."""
    return max(min(w.start for w in later) - max(w.stop for w in first), 0.0) / 60


def _arm_after(wa: list[Window], wb: list[Window]) -> bool:
    """Every run of arm a started after every run of arm b."""
    return min(w.start for w in wa) > max(w.start for w in wb)


def relation(wins: list[Window], a: str, b: str) -> str:
    """How configuration a was recorded against b: 'interleaved', or all of it before or after the other."""
    wa, wb = _arm(wins, a), _arm(wins, b)
    if not wa or not wb:
        return "–"
    if _arm_after(wa, wb):
        return f"after it ({_gap_min(wb, wa):.0f} min between)"
    if _arm_after(wb, wa):
        return f"before it ({_gap_min(wa, wb):.0f} min between)"
    return "interleaved"


def order_caveat(wins: list[Window], a: str, b: str, name_a: str, name_b: str) -> str | None:
    """A caveat where configurations a and b, one of them replicated, were not interleaved: every run of one after
    every run of the other. (One run a side cannot interleave; the pair's time apart is its own caveat.)"""
    wa, wb = _arm(wins, a), _arm(wins, b)
    if not wa or not wb or max(len(wa), len(wb)) < 2:
        return None
    for first, later, n_first, n_later in ((wa, wb, name_a, name_b), (wb, wa, name_b, name_a)):
        if _arm_after(later, first):
            return (f"not interleaved: every {n_later} run was recorded after every {n_first} run "
                    f"({n_first} {span(min(w.start for w in first), max(w.stop for w in first))}, "
                    f"{n_later} {span(min(w.start for w in later), max(w.stop for w in later))}, "
                    f"{_gap_min(first, later):.0f} min between them), so a drift of the host or a change of "
                    "machine between them falls on one arm only")
    return None


# What recorded a run (its provenance): two runs compared across any of these differ in more than their arm
RECORDED_BY = (("git_commit", "code versions"), ("gpu", "GPU models"), ("machine", "machines (boot ids)"))


def recorded_apart(sides: list[pd.DataFrame]) -> list[tuple[str, list[list[str]]]]:
    """Each of code version, GPU model and machine that differs among these runs, every replicate of every side
    read: what it is, and each side's values."""
    out = []
    for col, what in RECORDED_BY:
        values = [sorted({str(v) for v in rows[col].dropna()}) if col in rows.columns else [] for rows in sides]
        if len(set().union(*values)) > 1:
            out.append((what, values))
    return out


def first_steps(rows: pd.DataFrame) -> list[float]:
    """When each run's first step ended (unix seconds), in order; runs without times are left out."""
    if "time_unix" not in rows.columns:
        return []
    return sorted(pd.to_numeric(rows["time_unix"], errors="coerce").groupby(rows["run_id"]).min().dropna())


def later_starts(df: pd.DataFrame, config: str) -> tuple[int, int]:
    """Of a configuration's runs, how many started their engine after another run of the same engine family had
    started on the same machine (boot id) in this study, and how many runs it has. A machine's first start of an
    engine compiles kernels (FlashInfer, Triton, torch.compile) that later starts there reuse, so a start's time
    depends on its place in the order as much as on the engine."""
    n = int(df.loc[df["config_id"] == config, "run_id"].nunique())
    if not {"machine", "time_unix", "engine"} <= set(df.columns):
        return 0, n
    runs = df.groupby("run_id").agg(config=("config_id", "first"), machine=("machine", "first"),
                                    family=("engine", lambda e: engine_family(e.iloc[0])), t=("time_unix", "min"))
    runs = runs.dropna(subset=["machine", "t"])
    later = sum(((runs["machine"] == r.machine) & (runs["family"] == r.family) & (runs["t"] < r.t)).any()
                for r in runs[runs["config"] == config].itertuples())
    return int(later), n


def start_order_caveat(df: pd.DataFrame, sides: dict[str, str]) -> str | None:
    """Where the two sides' engine starts differ in how many followed an earlier start of their engine on their
    machine: their start times compare compile caches as much as engines."""
    counts = {name: later_starts(df, config) for name, config in sides.items()}
    shares = {later / n for later, n in counts.values() if n}
    if len(shares) <= 1:
        return None
    said = "; ".join(f"{later} of {name}'s {n}" for name, (later, n) in counts.items())
    return (f"engine start: some starts followed an earlier start of the same engine on their machine, which had "
            f"compiled its kernels ({said}), so the start times compare those caches as much as the engines")
