"""Figures quoted in the READMEs, recomputed from the committed tables.

A README figure that comes from data is written between two comments, invisible once rendered:

    <!--fig ratio results/reference/<study>
    sglang-colocate-hf vllm-colocate-hf perf/throughput-->0.77x [0.72, 0.89]<!--/fig-->

The expression names a function of FIGURES, a study folder holding steps.csv (relative to the repository; folders
joined by "+" pool their runs, for a study repeated in several leases) and its arguments; a configuration is named
by the start of its id (it must match exactly one), and one of its runs by `run=` and the run's whole id. `check`
lists each figure whose text differs from what the data give, `fill` writes the data's text in
(`python -m hybridrl figures [--fix] FILE...`); tests/test_readme_figures.py fails on any difference.
"""

from __future__ import annotations

import inspect
import json
import re
import statistics
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd

from hybridrl.atomic import write_text
from hybridrl.report import stats, trend, wording
from hybridrl.report.aggregate import read_table
from hybridrl.report.cells import Table, markdown
from hybridrl.run import request_records
from hybridrl.run.record import COMPARED_STEP

REPO = Path(__file__).resolve().parents[3]
MARK = re.compile(r"<!--fig (?P<expr>[^>]*?)-->(?P<text>.*?)<!--/fig-->", re.S)
OPEN = "<!--fig "


class FigureError(ValueError):
    """A figure marker that cannot be read or computed, named by its file and line (`hybridrl figures` prints
    a ValueError's message as its one line)."""


@cache
def _table(study: str) -> pd.DataFrame:
    """One study's steps.csv, or several joined by "+" (replicate leases of one study): their runs pooled, each
    run id prefixed with its folder's name so that the leases' replicates stay apart."""
    folders = study.split("+")
    if len(folders) == 1:
        return read_table(REPO / study / "steps.csv")
    if len(set(folders)) != len(folders):
        raise ValueError(f"{study!r} names a study twice")
    return pd.concat([read_table(REPO / f / "steps.csv").pipe(
        lambda df, f=f: df.assign(run_id=Path(f).name + "/" + df["run_id"].astype(str))) for f in folders],
        ignore_index=True)


@cache
def _json(path: str) -> Any:
    """A committed JSON result, read once however many figures quote it."""
    return json.loads((REPO / path).read_text())


RUN = "run="  # a name that picks one run by its whole id (run=vllm-inprocess-writeup-67c3b8ec-r2)


def _config(df: pd.DataFrame, name: str) -> pd.DataFrame:
    if name.startswith(RUN):  # one replicate of a configuration, where a figure quotes a single run's step
        rows = df[df["run_id"].astype(str) == name[len(RUN):]]
        if rows.empty:
            raise ValueError(f"no run {name[len(RUN):]!r}")
        return rows
    ids = sorted({str(c) for c in df["config_id"].dropna() if str(c) == name or str(c).startswith(name + "-")})
    # the id's readable part must end where the name does: the rest is the model and the hash; a whole id names
    # its configuration even where it is the start of another's (sglang-overlap-<hash>, sglang-overlap-fault-...)
    ids = [name] if name in ids else ids
    if len(ids) != 1:
        raise ValueError(f"{name!r} matches {len(ids)} configurations ({', '.join(ids) or 'none'})")
    return df[df["config_id"] == ids[0]]


def _steady(study: str, name: str, column: str | None = None) -> pd.DataFrame:
    """The configuration's steady-state steps; with a column, one the table has (else a named error, not '–')."""
    df = _table(study)
    if column is not None:
        _column(df, study, column)
    return stats.steady_state(_config(df, name))


def _fmt(x: float) -> str:
    from hybridrl.report.cells import fmt

    return fmt(x)


def median(study: str, name: str, column: str) -> str:
    """The configuration's steady-state median, as the report writes numbers."""
    return _fmt(stats.estimate(_steady(study, name, column), column).value)


def total(study: str, name: str, columns: str) -> str:
    """The steady-state median of columns joined by '+' summed step by step (timing_s/sleep+timing_s/wake: a
    colocated step's transition), as the report writes numbers; a step that lacks any of them is left out."""
    df = _steady(study, name).copy()
    parts = [_column(df, study, c) for c in columns.split("+")]
    df["total"] = sum(parts[1:], parts[0])  # NaN wherever one part is
    if df["total"].notna().sum() == 0:
        raise ValueError(f"{study}: {name} has no steady-state step with all of {columns}")
    return _fmt(stats.estimate(df, "total").value)


def interval(study: str, name: str, column: str) -> str:
    """median [lo, hi] over runs and steps."""
    est = stats.estimate(_steady(study, name, column), column)
    return f"{_fmt(est.value)} [{_fmt(est.lo)}, {_fmt(est.hi)}]"


def _ratio(study: str, a: str, b: str, column: str) -> stats.Estimate:
    return stats.hierarchical_ratio(stats.per_run(_steady(study, a, column), column),
                                    stats.per_run(_steady(study, b), column))


def ratio(study: str, a: str, b: str, column: str) -> str:
    """a / b of the steady-state medians with the hierarchical 95% interval: 0.83x [0.74, 0.89]."""
    return wording.ratio_text(_ratio(study, a, b, column))


def change(study: str, a: str, b: str, column: str) -> str:
    """a vs b as a percent change with its interval: +10% [-31%, +61%]."""
    est = _ratio(study, a, b, column)
    return f"{100 * (est.value - 1):+.0f}% [{100 * (est.lo - 1):+.0f}%, {100 * (est.hi - 1):+.0f}%]"


# verdict MODE: (higher is better, word for the side ahead, for the other)
MODES = {"rate": (True, "faster", "slower"), "time": (False, "faster", "slower"),
         "cost": (False, "lower", "higher"), "size": (True, "higher", "lower")}


def verdict(study: str, a: str, b: str, column: str, mode: str = "rate") -> str:
    """The report's sentence on a / b by the fixed wording rules (report.wording.conclusion): 'Rollout throughput:
    sglang-full is faster than vllm-server, sglang-full / vllm-server 1.11x [1.04, 1.22] (3 runs, 24 steps vs ...).'
    MODE says which way is better: rate (higher, faster), time (lower, faster), cost (lower), size (higher)."""
    from hybridrl.report.comparisons import KEY_METRICS, TRANSITIONS

    if mode not in MODES:
        raise ValueError(f"unknown verdict mode {mode!r} (known: {', '.join(MODES)})")
    names = {c: h for c, h, _ in KEY_METRICS} | {c: f"{n.capitalize()} time" for c, n in TRANSITIONS}
    what = names.get(column, column)
    sa, sb = _steady(study, a, column), _steady(study, b)
    est = stats.hierarchical_ratio(stats.per_run(sa, column), stats.per_run(sb, column))
    higher, better, worse = MODES[mode]
    n = [(stats.n_runs(d), int(pd.to_numeric(d[column], errors="coerce").notna().sum())) for d in (sa, sb)]
    shown = [x.removeprefix(RUN) for x in (a, b)]  # one run picked by its id reads as that id
    return wording.conclusion(what, *shown, est, n[0], n[1], higher, better, worse)


def finding(study: str, a: str, b: str, column: str, mode: str, label_a: str, label_b: str, what: str) -> str:
    """verdict's rule in few plain words, for the README's answer: 'SGLang faster than the vLLM server in rollout,
    1.10x [1.01, 1.25]', or '... could not be told apart in step time, 0.97x [0.87, 1.05]'. Labels and `what` write
    '_' for a space (a marker's arguments are words)."""
    if mode not in MODES:
        raise ValueError(f"unknown finding mode {mode!r} (known: {', '.join(MODES)})")
    la, lb, w = (x.replace("_", " ") for x in (label_a, label_b, what))
    sa, sb = _steady(study, a, column), _steady(study, b)
    est = stats.hierarchical_ratio(stats.per_run(sa, column), stats.per_run(sb, column))
    if not (est.lo > 0 and est.hi > 0):
        return f"{la} / {lb}, {w}: {est.value:.2f}x with no interval"
    if not est.excludes(1.0):
        return f"{la} and {lb} could not be told apart in {w}, {wording.ratio_text(est)}"
    higher, better, worse = MODES[mode]
    word = better if (est.value > 1) == higher else worse
    few = " (one run a side: these runs only)" if min(stats.n_runs(sa), stats.n_runs(sb)) < 2 else ""
    return f"{la} {word} than {lb} in {w}, {wording.ratio_text(est)}{few}"


def bench_ratio(path_a: str, path_b: str, which: str, field: str = "perf/throughput") -> str:
    """a / b of two bench JSONs' medians over the repeats of one path, with a bootstrap 95% interval over those
    repeats (one engine start a side: repeat-to-repeat noise only): '1.05x [0.98, 1.21]'."""
    return wording.ratio_text(stats.ratio_of_medians(_repeat_values(path_a, which, field),
                                                     _repeat_values(path_b, which, field)))


def path_ratio(path: str, which_a: str, which_b: str, field: str = "perf/throughput") -> str:
    """a / b of two paths' medians in one bench JSON (one engine start, the paths interleaved repeat by repeat),
    with a bootstrap 95% interval over the repeats: 'stream_all against raw'."""
    return wording.ratio_text(stats.ratio_of_medians(_repeat_values(path, which_a, field),
                                                     _repeat_values(path, which_b, field)))


def _updates(path: str, trainer: str, field: str = "update_s_all") -> list[float]:
    """The timed updates (update_s_all, or another per-update list such as save_s_all) of one trainer in a
    trainer-bench JSON; lists joined by '+' are summed update by update (update_s_all+state_s_all)."""
    lists = []
    for name in field.split("+"):
        values = (_json(path).get(trainer) or {}).get(name)
        if not values:
            raise ValueError(f"{path} has no {name} of trainer {trainer!r}")
        lists.append([float(v) for v in values])
    return [sum(parts) for parts in zip(*lists, strict=True)]


def update_ratio(path_a: str, trainer_a: str, path_b: str, trainer_b: str) -> str:
    """a / b of two trainer-bench JSONs' median update times (update_s_all of that trainer), with a bootstrap 95%
    interval over the timed updates (one process a side: update-to-update noise only): '0.85x [0.80, 0.90]'."""
    return wording.ratio_text(stats.ratio_of_medians(_updates(path_a, trainer_a), _updates(path_b, trainer_b)))


def _processes(paths: str) -> list[str]:
    """trainer-bench JSONs, one process each: globs joined by '+', every glob matching at least one file."""
    found: list[str] = []
    for pattern in paths.split("+"):
        hits = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob(pattern))
        if not hits:
            raise ValueError(f"no trainer-bench result matches {pattern!r}")
        found += [h for h in hits if h not in found]
    return found


def process_ratio(paths_a: str, paths_b: str, trainer_a: str, trainer_b: str | None = None,
                  field_a: str = "update_s_all", field_b: str | None = None) -> str:
    """a / b of the median update time over several processes a side (each a trainer-bench JSON; globs joined by
    '+'), with a two-level bootstrap 95% interval: processes, then updates within each, so that start-to-start
    and host noise are in it: '0.98x [0.83, 1.12]'. trainer_b defaults to trainer_a; field_a (and field_b, which
    defaults to it) another per-update list or a sum of them (_updates)."""
    return wording.ratio_text(stats.hierarchical_ratio(
        [_updates(p, trainer_a, field_a) for p in _processes(paths_a)],
        [_updates(p, trainer_b or trainer_a, field_b or field_a) for p in _processes(paths_b)]))


def process_medians(paths: str, trainer: str, digits: str = "2", field: str = "update_s_all") -> str:
    """Each process's median update time (or median of another per-update list: save_s_all, the adapter export),
    in the order of the paths (globs sorted): '1.23, 1.21, 0.95'."""
    return ", ".join(f"{statistics.median(_updates(p, trainer, field)):.{int(digits)}f}" for p in _processes(paths))


# a torch.profiler table's time units, in seconds
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def profile_total(path: str, device: str) -> str:
    """The self time total, in seconds, that a trainer-profile table (bench/profile-*.txt) gives for the device
    ('cuda': GPU kernels; 'cpu': the host's operators)."""
    label = {"cuda": "Self CUDA time total", "cpu": "Self CPU time total"}.get(device)
    if label is None:
        raise ValueError(f"profile_total device {device!r}: cuda or cpu")
    match = re.search(rf"^{label}: ([0-9.]+)(ms|us|s)$", _text(path), re.M)
    if match is None:
        raise ValueError(f"{path} has no line '{label}: ...'")
    return f"{float(match[1]) * _SECONDS[match[2]]:.2f}"


def profile_wall(path: str) -> str:
    """The profiled update's wall time in seconds, from a trainer-profile table's first line (the profiler's own
    overhead included)."""
    match = re.search(r": profiled update ([0-9.]+) s$", _text(path).split("\n", 1)[0])
    if match is None:
        raise ValueError(f"{path} has no first line '...: profiled update N s'")
    return f"{float(match[1]):.2f}"


def profile_waits(path: str, site: str = "") -> str:
    """How often the profiled update's host waited for the GPU (a trainer-profile table's closing list, one
    'count  file:line' row each): all of them, or those at lines whose location contains `site` ('grpo.py:')."""
    text = _text(path)
    head = re.search(r"^host waits for the GPU in one update: (\d+) ", text, re.M)
    if head is None:
        raise ValueError(f"{path} has no list of the host's waits (a profile from before trainer-profile kept one)")
    if not site:
        return head[1]
    rows = re.findall(r"^ *(\d+)  (\S+)$", text[head.end():], re.M)
    return str(sum(int(n) for n, where in rows if site in where))


def profile_range(path: str, name: str, digits: str = "3") -> str:
    """A labelled range's host time in seconds from a trainer-profile --export table ('export.write', or
    'hybridrl.export' for the whole export)."""
    match = re.search(rf"^{re.escape(name)} +\d+ +([0-9.]+) ", _text(path), re.M)
    if match is None:
        raise ValueError(f"{path} has no labelled range {name!r} (a profile taken without --export?)")
    return f"{float(match[1]):.{int(digits)}f}"


def profile_op(path: str, op: str, digits: str = "3") -> str:
    """One operator's own GPU time in seconds from a trainer-profile table's first (by-name) table: 'aten::index_add_'
    0.156."""
    for line in _text(path).splitlines():
        cells = line.split()
        if cells[:1] == [op] and len(cells) >= 11:  # name, self CPU %, self CPU, ..., self CUDA (7th)
            match = re.fullmatch(r"([0-9.]+)(ms|us|s)", cells[6])
            if match:
                return f"{float(match[1]) * _SECONDS[match[2]]:.{int(digits)}f}"
    raise ValueError(f"{path} has no row for operator {op!r}")


def _repeat_values(path: str, which: str, field: str) -> list[float]:
    """One field over a bench JSON's repeats of one path (raw, client, stream_all, old_client)."""
    values = [float(r[field]) for r in _json(path).get("repeats") or []
              if r.get("path") == which and r.get(field) is not None]
    if not values:
        raise ValueError(f"{path} has no repeats of path {which!r} with {field!r}")
    return values


def steady_steps(study: str, name: str) -> str:
    """How many steady-state steps the configuration's medians rest on."""
    return str(len(_steady(study, name)))


def steady_runs(study: str, name: str) -> str:
    """How many runs the configuration's steady-state medians rest on."""
    return str(_steady(study, name)["run_id"].nunique())


def records(study: str) -> str:
    return str(len(_table(study)))


def _range_text(lo: float, hi: float, unit: str) -> str:
    """lo–hi in thousands ('12.3k–15.0k', unit k), whole numbers (unit 1) or with N decimals (unit dN); one
    number where both ends print alike."""
    if unit == "k":
        ends = f"{lo / 1000:.1f}k", f"{hi / 1000:.1f}k"
    else:
        digits = int(unit[1:]) if unit.startswith("d") and unit[1:].isdigit() else 0
        ends = f"{lo:.{digits}f}", f"{hi:.{digits}f}"
    return ends[0] if ends[0] == ends[1] else "–".join(ends)


def span(study: str, name: str, column: str, first: str = "1", last: str = "1000", unit: str = "k") -> str:
    """min–max of the column over steps first..last of the configuration (every step, warm-up too), in k (or
    unit 1, dN: see _range_text)."""
    df = _config(_table(study), name)
    values = _column(df, study, column)[(df["step"] >= int(first)) & (df["step"] <= int(last))].dropna()
    return _range_text(values.min(), values.max(), unit)


def between(study: str, name: str, column: str, lo: str, hi: str) -> str:
    """How many of the configuration's steps (every step) fall strictly between lo and hi: '15 of 45'."""
    df = _table(study) if name == "*" else _config(_table(study), name)
    values = _column(df, study, column).dropna()
    return f"{int(((values > float(lo)) & (values < float(hi))).sum())} of {len(values)}"


def tiers(study: str, name: str, family: str) -> str:
    """The configuration's steps judged by today's tiered logprob gate for `family` (dense or moe), whatever the
    gate was when they ran: '10 pass' or '8 pass, 1 warn'; for NAME@STEP that step's gap and tier."""
    from hybridrl.run.checks import GAP_LIMITS, logprob_gate

    name, _, step = name.partition("@")
    df = _config(_table(study), name)
    if step:
        df = df[df["step"] == int(step)]
    gaps = pd.to_numeric(df["check/rollout_logprob_abs_diff"], errors="coerce").dropna()
    judged = [logprob_gate(g, GAP_LIMITS[family])["check/logprob_gap_tier"] for g in gaps]
    counts = ", ".join(f"{judged.count(t)} {t}" for t in ("pass", "warn", "fail") if judged.count(t))
    return f"{gaps.iloc[0]:.4f}, a {judged[0]}" if step else counts


def value(path: str, field: str, scale: str = "1", digits: str = "2") -> str:
    """One field of a committed JSON result (benchmarks write JSON, not steps.csv), dotted for nesting
    (hf.update_s_median; a number indexes a list: settings.4.ceiling_tok_s), times scale, with `digits`
    decimals and thousands separators."""
    x: object = _json(path)
    for key in field.split("."):
        if isinstance(x, list) and key.isdigit() and int(key) < len(x):
            x = x[int(key)]
        elif isinstance(x, dict) and key in x:
            x = x[key]
        else:
            raise ValueError(f"{path} has no field {field!r}")
    return f"{float(x) * float(scale):,.{int(digits)}f}"


def repeats(path: str, which: str, field: str, unit: str = "k") -> str:
    """min–max of one field over a bench JSON's repeats of one path (raw, client, stream_all, old_client):
    in thousands ('12.3k–15.0k', unit k), whole numbers (unit 1) or with N decimals (unit dN: '0.12–0.34')."""
    values = _repeat_values(path, which, field)
    return _range_text(min(values), max(values), unit)


def _column(df: pd.DataFrame, study: str, column: str) -> pd.Series:
    """A column of a study's table as numbers; a column the table lacks is named in the error."""
    if column not in df.columns:
        raise ValueError(f"{study}/steps.csv has no column {column!r}")
    return pd.to_numeric(df[column], errors="coerce")


def series(study: str, name: str, column: str, scale: str = "1", digits: str = "1") -> str:
    """The column at every step that has it (eval columns exist every `eval_every` steps), times scale:
    'step 5: 44.5, step 10: 44.9'."""
    df = _config(_table(study), name)
    rows = df[["step"]].assign(v=_column(df, study, column)).dropna(subset=["v"])
    if rows.empty:
        raise ValueError(f"{study}: {name} has no {column!r} at any step")
    return ", ".join(f"step {int(r.step)}: {r.v * float(scale):.{int(digits)}f}" for r in rows.itertuples())


def run_medians(study: str, name: str, column: str, scale: str = "1", digits: str = "1") -> str:
    """Each replicate's steady-state median, times scale, in the order the runs were recorded: '10.7, 13.4, 14.6'
    (a drift from run to run that the pooled interval hides)."""
    df = _steady(study, name)
    medians = _column(df, study, column).groupby(df["run_id"]).median()
    order = df.groupby("run_id")["time_unix"].min().sort_values().index
    return ", ".join(f"{medians[rid] * float(scale):.{int(digits)}f}" for rid in order)


def at(study: str, name: str, column: str, step: str, digits: str = "2") -> str:
    """The column at one step of the configuration (its only run): 'at 3' of a memory reading."""
    if not step.isdigit():
        raise ValueError(f"step {step!r} is not a step number")
    df = _config(_table(study), name)
    values = _column(df, study, column)[df["step"] == int(step)].dropna()
    if len(values) != 1:
        raise ValueError(f"{study}: {name} has {len(values)} readings of {column!r} at step {step}")
    return f"{values.iloc[0]:.{int(digits)}f}"


def slope(study: str, name: str, column: str, unit: str = "") -> str:
    """The column's trend over the steps after warm-up, fitted and worded as the report's memory table does."""
    df = stats.after_warmup(_config(_table(study), name))
    return trend.trend_words(trend.bootstrap_slope(df["step"], _column(df, study, column)), unit)


def share(study: str, name: str, column: str) -> str:
    """The column's share of each steady-state step's time, median [95% CI] in percent: training's 4.1% [3.9, 4.4]."""
    df = _steady(study, name).copy()
    df["share"] = 100 * _column(df, study, column) / _column(df, study, "timing_s/step")
    if df["share"].notna().sum() == 0:
        raise ValueError(f"{study}: {name} has no steady-state step with both {column} and timing_s/step")
    est = stats.estimate(df, "share")
    return f"{est.value:.1f}% [{est.lo:.1f}, {est.hi:.1f}]"


def unattributed(study: str, name: str) -> str:
    """The most seconds of any step (warm-up too) that no named phase explains: step time less its phases."""
    rest = stats.unattributed_s(_config(_table(study), name)).dropna()
    if rest.empty:
        raise ValueError(f"{study}: {name} has no step with its timing_s/step")
    return f"{rest.max():.2f}"


def _only_run(study: str, name: str) -> pd.DataFrame:
    df = _config(_table(study), name)
    if df["run_id"].nunique() != 1:
        raise ValueError(f"{study}: {name} has {df['run_id'].nunique()} runs; a paired figure takes one run a side")
    return df


def _step_records(study: str, run: pd.DataFrame, step: int, why: str) -> list[dict[str, Any]]:
    """The run's committed request records of one step; WHY (what needs them) ends the error for missing ones."""
    rid = str(run["run_id"].iloc[0])
    folder, _, rid = rid.rpartition("/")  # a pooled study prefixes each run id with its folder's name
    root = next((f for f in study.split("+") if Path(f).name == folder), study) if folder else study
    try:
        return request_records.read(REPO / root / "runs" / rid, int(step))
    except FileNotFoundError as exc:
        raise ValueError(f"{Path(exc.filename).relative_to(REPO)} is missing: {why}") from None


def _drawn(records: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    """(sampling seed, prompt length) of each request: what two runs drawing the same requests share."""
    return [(r.get("seed"), r.get("prompt_tokens")) for r in records]


def _prompts(study: str, run: pd.DataFrame, step: int) -> list[tuple[Any, Any]]:
    """_drawn of the run's step, from its committed request records."""
    return _drawn(_step_records(study, run, step, "cannot check that both runs drew the same prompts"))


def replayed(study: str, name: str, step: str) -> str:
    """Of one step's requests, how many got answers of the same length in every run of the configuration:
    '128 of 128'. Its replicates send the same prompts with the same sampling seeds (checked), so an engine that
    honours the seeds batch for batch replays one workload, and the interval over its runs holds timing only."""
    records = _replicate_records(study, name, step, "replayed")
    if len({tuple(_drawn(r)) for r in records}) != 1:
        raise ValueError(f"{name}'s runs drew different requests at step {step}")
    return _same_length(records)


def alike(study: str, name: str, step: str) -> str:
    """replayed for replicates with sampling seeds of their own (run key replicate_seeds): the same prompts
    (checked), other seeds (checked), and how many requests still got answers of the same length in every run."""
    records = _replicate_records(study, name, step, "alike")
    if len({tuple(r.get("prompt_tokens") for r in recs) for recs in records}) != 1:
        raise ValueError(f"{name}'s runs sent different prompts at step {step}")
    if len({tuple(r.get("seed") for r in recs) for recs in records}) != len(records):
        raise ValueError(f"{name}'s runs share sampling seeds at step {step}; replayed compares those")
    return _same_length(records)


def _replicate_records(study: str, name: str, step: str, figure: str) -> list[list[dict[str, Any]]]:
    """Each run's request records of one step, for the configuration's replicates (at least two)."""
    if not step.isdigit():
        raise ValueError(f"step {step!r} is not a step number")
    runs = [g for _, g in _config(_table(study), name).groupby("run_id", sort=True)]
    if len(runs) < 2:
        raise ValueError(f"{study}: {name} has {len(runs)} run; {figure} compares a configuration's replicates")
    return [_step_records(study, g, int(step), "cannot compare the replicates' answers") for g in runs]


def _same_length(records: list[list[dict[str, Any]]]) -> str:
    """'K of N': the requests whose answer had the same number of tokens in every run."""
    lengths = [[r.get("tokens") for r in recs] for recs in records]
    return f"{sum(len(set(col)) == 1 for col in zip(*lengths, strict=True))} of {len(lengths[0])}"


def paired(study_a: str, name_a: str, study_b: str, name_b: str, column: str, first: str, last: str,
           digits: str = "3") -> str:
    """b − a step by step over steps first..last, its mean with a bootstrap 95% interval over those steps:
    '+0.082 [+0.031, +0.130] over 10 steps'. Two runs of one seed, data and batch shape draw the same prompts at
    each step (checked against their request records), so the difference of a step's reward takes out how hard
    that step's prompts were."""
    if not (first.isdigit() and last.isdigit()):
        raise ValueError(f"steps {first!r}..{last!r} are not step numbers")
    a, b = _only_run(study_a, name_a), _only_run(study_b, name_b)
    lo, hi = int(first), int(last)
    va = _column(a, study_a, column).set_axis(a["step"])
    vb = _column(b, study_b, column).set_axis(b["step"])
    diff = (vb - va).loc[lo:hi].dropna()
    for step in diff.index:
        if _prompts(study_a, a, step) != _prompts(study_b, b, step):
            raise ValueError(f"{name_a} and {name_b} drew different prompts at step {step}")
    est = stats.bootstrap_mean(diff)
    if est.n < 2:
        raise ValueError(f"{name_a} and {name_b} share {est.n} steps with {column!r} in {lo}..{hi}")
    n = int(digits)
    return f"{est.value:+.{n}f} [{est.lo:+.{n}f}, {est.hi:+.{n}f}] over {est.n} steps"


@cache
def _text(path: str) -> str:
    return (REPO / path).read_text(errors="replace")


def _peer_steps(path: str, field: str = "step_s") -> list[list[float]]:
    """TRL peer processes' timed steps after warm-up (their steps 1-2, as a run's), one field of each (peer_trl's
    JSON), process by process: PATH names one record, or several joined by '+' (a configuration's replicates)."""
    out = []
    for one in path.split("+"):
        steps = [s for s in _json(one).get("steps") or [] if s.get("step", 0) > stats.WARMUP_STEPS]
        values = [float(s[field]) for s in steps if s.get(field) is not None]
        if not values:
            raise ValueError(f"{one} has no {field!r} after step {stats.WARMUP_STEPS}")
        out.append(values)
    return out


def peer_median(path: str, field: str = "step_s") -> str:
    """A TRL peer's median step (or phase) after warm-up, with a bootstrap 95% interval over its processes and
    their steps (one process: step-to-step noise only): '6.21 [6.02, 6.40]'."""
    est = stats.hierarchical_median(_peer_steps(path, field))
    return f"{_fmt(est.value)} [{_fmt(est.lo)}, {_fmt(est.hi)}]"


def peer_ratio(study: str, name: str, path: str, column: str = COMPARED_STEP) -> str:
    """hybridrl's configuration against a TRL peer: its steady-state median of `column` (the compared step) over
    the peer's median step, with the interval resampling hybridrl's runs and steps and the peer's processes and
    steps: '0.41x [0.38, 0.44]', below 1 where hybridrl's step is shorter."""
    ours = stats.per_run(_steady(study, name, column), column)
    return wording.ratio_text(stats.hierarchical_ratio(ours, _peer_steps(path)))


def peer_pair(study: str, config: str, against: str, what: str = "ratio") -> str:
    """A configuration (the start of its id) against TRL's defaults or TRL's best, paired as the report's ratio table
    pairs them (the cards both ran on, card by card): `ratio`, '0.78x [0.66, 0.85]'; `label`, the TRL record's."""
    from hybridrl.report import peer
    from hybridrl.report.plots import config_labels

    if against not in ("defaults", "best") or what not in ("ratio", "label"):
        raise ValueError(f"peer_pair: against is defaults or best ({against!r}), what ratio or label ({what!r})")
    df = _table(study)
    labels = config_labels(df)
    name = labels[str(_config(df, config)["config_id"].iloc[0])]
    found = [p for p in peer.pairs(df, peer.records(REPO / study / "bench"), labels, REPO / study / "runs")
             if p.name == name]
    if not found:
        raise ValueError(f"{study}: no TRL record paired with {config!r}")
    if against == "best":
        best = peer.best_records(found)[name]
        pair = next(p for p in found if p.peer is best)
    else:
        pair = next((p for p in found if p.peer.defaults), None)
        if pair is None:
            raise ValueError(f"{study}: {config!r} has no pair with TRL's defaults")
    return peer.short(pair.peer.label).removeprefix("TRL · ") if what == "label" else wording.ratio_text(pair.est)


def setup_table(study: str) -> str:
    """The report's set-up against measured time, run by run (report.setup_time), as a markdown table."""
    from hybridrl.report import setup_time
    from hybridrl.report.plots import run_labels

    df = _table(study)
    table = setup_time.setup_table(df, run_labels(df))
    if table is None:
        raise ValueError(f"{study}: no run recorded its engine's start")
    return "\n" + markdown(table) + "\n"


def logged(path: str, pattern: str) -> str:
    """The first group of the first match of `pattern` (a regex without spaces: write \\s) in a committed log,
    for what a run printed but wrote to no table (the warm start's checks, for one)."""
    found = re.search(pattern, _text(path))
    if found is None:
        raise ValueError(f"{path}: nothing matches {pattern!r}")
    return found.group(1)


def floors(study: str) -> str:
    """The report's floor table (report.floors) of one study, as a Markdown table on lines of its own: every
    configuration's phases, their steady-state medians, floors and ratios."""
    from hybridrl.report.floors import floor_table
    from hybridrl.report.plots import config_labels

    if "+" in study:
        raise ValueError(f"{study}: floors reads one study's runs, not a pooled one")
    df = _table(study)
    table = floor_table(df, REPO / study / "runs", config_labels(df))
    if table is None:
        raise ValueError(f"{study}: no phase to set against a floor")
    return _markdown_block(table)


def peer_table(study: str, which: str = "phases") -> str:
    """The report's TRL section (report.peer) of one study: `phases`, each configuration's and TRL record's step
    and phases; `ratios`, hybridrl's compared step over each TRL record's, with the peer targets' verdicts."""
    from hybridrl.report import peer
    from hybridrl.report.plots import config_labels

    if which not in ("phases", "ratios"):
        raise ValueError(f"peer_table: {which!r} is neither phases nor ratios")
    df, peers = _table(study), peer.records(REPO / study / "bench")
    table = (peer.phase_table(df, peers, config_labels(df), REPO / study / "runs") if which == "phases"
             else peer.ratio_table(peer.pairs(df, peers, config_labels(df), REPO / study / "runs")))
    if table is None:
        raise ValueError(f"{study}: no TRL record (bench/trl-*.json)")
    return _markdown_block(table)


def start_table(study: str) -> str:
    """The report's engine start against its own command line (report.start_bench) of one study."""
    from hybridrl.report import start_bench

    table = start_bench.table(REPO / study / "bench")
    if table is None:
        raise ValueError(f"{study}: no start-bench record (bench/start-*.json)")
    return _markdown_block(table)


def trainer_table(study: str) -> str:
    """The report's trainer benchmarks (report.trainer_bench) of one study: a row a setting, its target's verdict."""
    from hybridrl.report import trainer_bench

    table = trainer_bench.table(REPO / study / "bench")
    if table is None:
        raise ValueError(f"{study}: no trainer-bench record (bench/trainer-*.json)")
    return _markdown_block(table)


def targets_status(reference: str = "results/reference") -> str:
    """Every committed study against the speed targets (report.target_status), as `hybridrl targets` prints it."""
    from hybridrl.report import target_status

    return _markdown_block(target_status.table(REPO / reference))


def _markdown_block(table: Table) -> str:
    """A table on lines of its own in a README: a blank line before and after."""
    return "\n\n" + markdown(table) + "\n\n"


def writeup_table(study: str) -> str:
    """The report's tables in the write-up's format (report.comparisons.headline_tables), one for each pair of
    SGLang and a vLLM arm: its title and what the pair shares, then each metric's claimed figure beside both
    medians and their ratio with its 95% interval, the engine start's parts below."""
    from hybridrl.report.comparisons import headline_tables

    tables = headline_tables(_table(study))
    if not tables:
        raise ValueError(f"{study}: no pair of SGLang and a vLLM arm to set in the write-up's format")
    return "".join(f"\n\n**{t['title']}** ({t['shared']})" + _markdown_block(t["table"]).rstrip("\n")
                   for t in tables) + "\n\n"


def writeup_summary(study: str) -> str:
    """The write-up's rows in one table (report.comparisons.headline_summary): each metric's claimed figure beside
    this study's measured ratio [95% CI] for each pair of SGLang and a vLLM arm."""
    from hybridrl.report.comparisons import headline_summary

    table = headline_summary(_table(study))
    if table is None:
        raise ValueError(f"{study}: no pair of SGLang and a vLLM arm to set in the write-up's format")
    return _markdown_block(table)


def phase_table(study: str) -> str:
    """The report's steady-state table: one column per configuration, median [95% CI] of the step and its phases
    over runs and steps."""
    from hybridrl.report.comparisons import comparison_table
    from hybridrl.report.plots import config_labels

    df = _table(study)
    return _markdown_block(comparison_table(df, config_labels(df)))


def memory_table(study: str) -> str:
    """The report's engine memory across sleep and wake, run by run: after each sleep, after each wake against
    the engine's start (the awake memory gate, where recorded) and the asleep memory gate."""
    from hybridrl.report.plots import run_labels
    from hybridrl.report.run_tables import memory_trend_table

    df = _table(study)
    table = memory_trend_table(df, run_labels(df))
    if table is None:
        raise ValueError(f"{study}: no engine slept")
    return _markdown_block(table)


FIGURES: dict[str, Callable[..., str]] = {
    "median": median, "total": total, "interval": interval, "ratio": ratio, "change": change, "steps": steady_steps,
    "runs": steady_runs,
    "records": records, "span": span, "between": between, "tiers": tiers, "value": value,
    "repeats": repeats, "verdict": verdict, "finding": finding, "bench_ratio": bench_ratio, "path_ratio": path_ratio,
    "update_ratio": update_ratio, "process_ratio": process_ratio, "process_medians": process_medians,
    "profile_total": profile_total, "profile_op": profile_op, "profile_wall": profile_wall,
    "profile_waits": profile_waits,
    "profile_range": profile_range,
    "series": series, "logged": logged, "paired": paired,
    "at": at, "setup_table": setup_table, "peer_median": peer_median, "peer_ratio": peer_ratio, "peer_pair": peer_pair,
    "run_medians": run_medians, "slope": slope, "share": share,
    "unattributed": unattributed, "replayed": replayed, "alike": alike, "floors": floors,
    "writeup_table": writeup_table, "writeup_summary": writeup_summary, "peer_table": peer_table,
    "start_table": start_table,
    "trainer_table": trainer_table, "targets_status": targets_status,
    "phase_table": phase_table, "memory_table": memory_table,
}


def evaluate(expr: str) -> str:
    if not expr.split():
        raise ValueError(f"empty figure (a figure is '<!--fig NAME ARGS...-->'; known: {', '.join(FIGURES)})")
    name, *args = expr.split()
    if name not in FIGURES:
        raise ValueError(f"unknown figure {name!r} (known: {', '.join(FIGURES)})")
    fn = FIGURES[name]
    try:  # the arguments checked against the signature, so a TypeError inside a figure still shows as a bug
        inspect.signature(fn).bind(*args)
    except TypeError:
        raise ValueError(f"{name} takes {_usage(fn)}, got {len(args)} argument{'s' * (len(args) != 1)}") from None
    return fn(*args)


def _usage(fn: Callable[..., str]) -> str:
    """A figure's arguments as its marker writes them: 'STUDY A B COLUMN [MODE]'."""
    params = inspect.signature(fn).parameters.values()
    return " ".join(p.name.upper() if p.default is p.empty else f"[{p.name.upper()}]" for p in params)


def _figures(text: str, source: str) -> list[re.Match[str]]:
    """The text's figure markers; one opened but never closed (its text would run into the next figure's, or to
    the end of the file) raises FigureError naming source and line, instead of being passed over."""
    marks = list(MARK.finditer(text))
    starts = {m.start() for m in marks}
    for m in marks:
        inner = m["text"].find(OPEN)
        if inner >= 0:  # the match ran on into the next figure: this one was never closed
            raise FigureError(f"{_where(text, source, m.start())}: figure '<!--fig {m['expr'].strip()}-->' has no "
                              "closing <!--/fig--> before the next figure")
    for found in re.finditer(re.escape(OPEN), text):
        if found.start() not in starts:
            line_end = text.find("\n", found.start())
            marker = text[found.start():line_end if line_end >= 0 else len(text)][:80]
            raise FigureError(f"{_where(text, source, found.start())}: figure marker {marker!r} has no closing "
                              "<!--/fig-->")
    return marks


def _where(text: str, source: str, pos: int) -> str:
    return f"{source}:{text.count(chr(10), 0, pos) + 1}"


def _evaluate_at(text: str, source: str, m: re.Match[str]) -> str:
    """evaluate, with an error naming the file, line and figure it came from."""
    expr = m["expr"].strip()
    try:
        return evaluate(expr)
    except (ValueError, KeyError, OSError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise FigureError(f"{_where(text, source, m.start())}: figure '{expr}': {msg}") from exc


def check(text: str, source: str = "<text>") -> list[tuple[str, str, str]]:
    """(expression, written, recomputed) for every figure whose text differs from the data's."""
    out = []
    for m in _figures(text, source):
        want = _evaluate_at(text, source, m)
        if m["text"] != want:
            out.append((m["expr"].strip(), m["text"], want))
    return out


def fill(text: str, source: str = "<text>") -> str:
    """The text with every figure written from the data."""
    _figures(text, source)
    return MARK.sub(lambda m: f"<!--fig {m['expr']}-->{_evaluate_at(text, source, m)}<!--/fig-->", text)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = exc.object.count(b"\n", 0, exc.start) + 1
        raise FigureError(f"{path}:{line}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x})") from None


def main(files: list[Path], fix: bool) -> int:
    """Check (or, with fix, rewrite) the figures of each file; 1 if any differed and was not fixed."""
    bad = 0
    for path in files:
        text = _read(path)
        if fix:
            filled = fill(text, str(path))
            if filled == text:
                continue
            try:  # atomic: a full disk or a crash leaves the file as it was, never half of it
                write_text(path, filled)
            except OSError as exc:
                raise OSError(exc.errno, f"{exc.strerror or exc}: {path} is left as it was") from exc
            continue
        for expr, written, want in check(text, str(path)):
            print(f"{path}: {expr}: written {written!r}, data give {want!r}")
            bad += 1
    return 1 if bad else 0
