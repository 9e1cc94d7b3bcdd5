"""hybridrl beside a peer framework in the same study: the records of TRL's GRPOTrainer (bench/trl-*.json, written
by `hybridrl peer-trl` on a run's work) set beside the study's configurations, phase by phase, with hybridrl's
compared step over each TRL configuration's step, judged against the peer targets (targets.yaml)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from hybridrl.report import cards as card_records
from hybridrl.report import stats, targets, wording
from hybridrl.report.cells import Cell, Table, fmt_est, fmt_n
from hybridrl.run.record import COMPARED_STEP

# (heading, hybridrl's column, TRL's step field); "rest" is the step less the three phases, on each side
PHASES = [("step, checks excluded", COMPARED_STEP, "step_s"),
          ("generation", "timing_s/gen", "generate_s"),
          ("training: forward, backward, optimizer", "timing_s/update_actor", "train_s"),
          ("weight sync", "timing_s/update_weights", "sync_weights_s")]
REST = "rest of the step"
PLOT_TITLE = "hybridrl's step beside TRL's, phase by phase"


class BenchRecordError(ValueError):
    """A study's measurement result (bench/) that cannot be read as the record its name says it is."""


@dataclass(frozen=True)
class PeerRecord:
    """One TRL configuration: its label, whether it is TRL's defaults, the steps after warm-up of each of its
    processes (one a result file; a configuration's replicates, trl-...-rK.json, pool into one record), and the
    card each process ran on (cards.job_card; None where its job record does not say)."""

    label: str
    defaults: bool
    processes: tuple[list[dict[str, Any]], ...]
    cards: tuple[str | None, ...] = ()

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [s for p in self.processes for s in p]

    def values(self, field: str) -> list[list[float]]:
        """One field's values, process by process (the two levels a hierarchical interval resamples)."""
        return [[float(s[field]) for s in p if s.get(field) is not None] for p in self.processes]

    def rest(self) -> list[list[float]]:
        return [[float(s["step_s"]) - sum(float(s.get(f) or 0.0) for _, _, f in PHASES[1:]) for s in p]
                for p in self.processes]

    @property
    def carded(self) -> bool:
        """Every process's job record names its card."""
        return len(self.cards) == len(self.processes) and None not in self.cards

    @property
    def n(self) -> tuple[int, int]:
        """(processes, steps), as a configuration's (runs, steps)."""
        return len(self.processes), len(self.steps)


def measurement_files(bench_dir: Path, prefix: str) -> list[Path]:
    """A study's measurement results named PREFIX*.json, without the SLURM job record beside each (.slurm.json)."""
    return sorted(p for p in Path(bench_dir).glob(f"{prefix}*.json") if not p.name.endswith(".slurm.json"))


def _label(settings: dict[str, Any]) -> tuple[str, bool]:
    """The record's label, and whether it is TRL's defaults (checkpointing on, vLLM asleep while it trains)."""
    gc, awake = settings.get("gradient_checkpointing"), settings.get("vllm_enable_sleep_mode") is False
    if gc is None and not awake:
        return "TRL GRPOTrainer · its defaults (gradient checkpointing on)", True
    gc_words = "on (its default)" if gc is None else "on" if gc else "off"
    return f"TRL GRPOTrainer · gradient checkpointing {gc_words}" + (", vLLM awake" if awake else ""), False


def timed_steps(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One TRL record and its steps after warm-up; a file that is not a record, or one without such a step, is an
    error naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchRecordError(f"{path}: not a readable TRL record ({exc})") from None
    if not isinstance(data, dict) or data.get("tool") != "peer-trl":
        raise BenchRecordError(f"{path}: not a record of `hybridrl peer-trl` (no tool: peer-trl)")
    steps = [s for s in data.get("steps") or [] if s.get("step", 0) > stats.WARMUP_STEPS]
    if not steps:
        raise BenchRecordError(f"{path}: no step after warm-up (steps 1-{stats.WARMUP_STEPS})")
    return data, steps


def records(bench_dir: Path) -> list[PeerRecord]:
    """The study's TRL configurations, in the order of their first file's name, each with every process that ran
    it (files whose settings give one label); a file that is not a record is an error naming it (timed_steps)."""
    found: dict[str, tuple[bool, list[list[dict[str, Any]]], list[str | None]]] = {}
    for path in measurement_files(bench_dir, "trl-"):
        data, steps = timed_steps(path)
        label, defaults = _label(data.get("settings") or {})
        _, processes, cards = found.setdefault(label, (defaults, [], []))
        processes.append(steps)
        cards.append(card_records.job_card(path.with_suffix(".slurm.json")))
    return [PeerRecord(label, defaults, tuple(processes), tuple(cards))
            for label, (defaults, processes, cards) in found.items()]


def _on_cards(peer: PeerRecord, keep: set[str]) -> PeerRecord:
    kept = [i for i, c in enumerate(peer.cards) if c in keep]
    return PeerRecord(peer.label, peer.defaults, tuple(peer.processes[i] for i in kept),
                      tuple(peer.cards[i] for i in kept))


def _runs_on(config: pd.DataFrame, cards: dict[str, str | None], keep: set[str]) -> pd.DataFrame:
    """The configuration's steps from the runs on the kept cards."""
    return config[config["run_id"].astype(str).map(cards).isin(keep).to_numpy()]


def _ours(steady: pd.DataFrame, column: str) -> list[pd.Series]:
    if column != REST:
        return stats.per_run(steady, column)
    if any(c not in steady.columns for _, c, _ in PHASES):
        return []
    parts = steady[[c for _, c, _ in PHASES]].apply(pd.to_numeric, errors="coerce").fillna(0.0)
    rest = steady.assign(rest=parts.iloc[:, 0] - parts.iloc[:, 1:].sum(axis=1))
    return stats.per_run(rest, "rest")


def _theirs(record: PeerRecord, field: str) -> list[list[float]]:
    return record.rest() if field == REST else record.values(field)


def _split(df: pd.DataFrame, peers: list[PeerRecord],
           runs_dir: Path | None) -> tuple[dict[str, str | None], list[str | None]]:
    """Each run's card, and the study's cards in order (the runs' first, then any only TRL ran on) where there are
    several and every run and TRL process names its card; else [None], one pooled group."""
    cards = card_records.run_cards(df, runs_dir)
    known = None not in cards.values() and all(p.carded for p in peers)
    if not known:
        return cards, [None]
    order: list[str | None] = list(card_records.in_order(df, cards))
    for card in (c for p in peers for c in p.cards):
        if card not in order:
            order.append(card)
    return cards, (order if len(order) > 1 else [None])


def phase_rows(df: pd.DataFrame, peers: list[PeerRecord], labels: dict[str, str],
               runs_dir: Path | None = None) -> list[tuple[str, list[stats.Estimate]]]:
    """Each configuration, then each TRL record: the median [95% CI] of the step, each phase and the rest, over
    steady-state steps (hybridrl: over runs and steps; TRL: over its processes and their steps). Where the study ran
    on several cards (leases), a row for each card a configuration or record ran on, its label naming the card:
    steps differ more between leases than between arms."""
    steady = stats.steady_state(df)
    cards, groups = _split(steady, peers, runs_dir)
    rows = []
    for config_id, config in steady.groupby("config_id", sort=True):
        name = labels.get(str(config_id), str(config_id))
        for card in groups:
            part = config if card is None else _runs_on(config, cards, {card})
            if not part.empty:
                rows.append((card_records.on_card(name, card),
                             [stats.hierarchical_median(_ours(part, c)) for c in [*(c for _, c, _ in PHASES), REST]]))
    for peer in peers:
        for card in groups:
            theirs = peer if card is None else _on_cards(peer, {card})
            if theirs.processes:
                rows.append((card_records.on_card(peer.label, card), [stats.hierarchical_median(_theirs(theirs, f))
                                                    for f in [*(f for _, _, f in PHASES), REST]]))
    return rows


def phase_table(df: pd.DataFrame, peers: list[PeerRecord], labels: dict[str, str],
                runs_dir: Path | None = None) -> Table | None:
    """One row for each configuration and each TRL record, on each card where there are several (phase_rows); None
    without records."""
    if not peers:
        return None
    table = Table(["configuration", *(h for h, _, _ in PHASES), REST, "runs × steps"])
    for label, ests in phase_rows(df, peers, labels, runs_dir):
        table.rows.append([Cell(label), *(Cell(fmt_est(e), "num") for e in ests), Cell(fmt_n(ests[0]))])
    return table


@dataclass(frozen=True)
class PeerPair:
    """hybridrl's configuration against one TRL record: its compared step over TRL's step, and that in words, on
    the cards both ran on (pairs); `peer_step` is TRL's step there (_typical_step), which picks TRL's best
    (ratio_table)."""

    name: str
    peer: PeerRecord
    est: stats.Estimate
    words: str
    peer_step: float = math.nan


def short(label: str) -> str:
    return label.replace("TRL GRPOTrainer · ", "TRL · ")


def _shared_cards(run_cards: dict[str, str | None], peer: PeerRecord) -> set[str] | None:
    """The cards both sides ran on, where every run and every process names its card; None where one does not
    (a study run without SLURM's job records: every run and process is compared, as before cards were read)."""
    if not run_cards or None in run_cards.values() or not peer.carded:
        return None
    return set(run_cards.values()) & set(peer.cards)  # type: ignore[arg-type]


def pairs(df: pd.DataFrame, peers: list[PeerRecord], labels: dict[str, str],
          runs_dir: Path | None = None) -> list[PeerPair]:
    """Every configuration against every TRL record, resampling hybridrl's runs and steps and TRL's processes and
    steps. The targets ask for the same card in the same lease: where the runs' job records (runs_dir/<run>/
    slurm.json) and TRL's name their cards, each side keeps the runs or processes on the cards both ran on, a pair
    with none in common is left out, and the ratio is taken card by card (stats.blocked_ratio), so that a card
    that ran both sides faster is no difference between them."""
    out = []
    for config_id, config in stats.steady_state(df).groupby("config_id", sort=True):
        cards = card_records.run_cards(config, runs_dir)
        name = labels.get(str(config_id), str(config_id))
        for peer in peers:
            shared = _shared_cards(cards, peer)
            if shared is not None and not shared:
                continue
            theirs = peer if shared is None else _on_cards(peer, shared)
            blocks = _blocks(config, cards, peer, shared)
            ours = [run for runs, _ in blocks for run in runs]
            n_ours = (len(ours), sum(int(run.notna().sum()) for run in ours))
            est = stats.blocked_ratio(blocks)
            words = wording.conclusion("Step time, checks excluded", name, short(peer.label), est, n_ours,
                                       theirs.n, higher_is_better=False)
            out.append(PeerPair(name, peer, est, words, _typical_step([b for _, b in blocks])))
    return out


def _blocks(config: pd.DataFrame, cards: dict[str, str | None], peer: PeerRecord,
            shared: set[str] | None) -> list[tuple[list[pd.Series], list[list[float]]]]:
    """(hybridrl's runs, TRL's processes) card by card, or all of each as one block where cards are not known."""
    if shared is None:
        return [(stats.per_run(config, COMPARED_STEP), peer.values("step_s"))]
    return [(stats.per_run(_runs_on(config, cards, {c}), COMPARED_STEP), _on_cards(peer, {c}).values("step_s"))
            for c in sorted(shared)]


def _typical_step(blocks: list[list[list[float]]]) -> float:
    """A TRL record's step over the cards of a pair: the geometric mean of its median step on each card (the
    scale blocked_ratio divides by), which picks TRL's best."""
    steps = [[v for process in b for v in process if math.isfinite(v)] for b in blocks]
    if not all(steps):
        return math.nan
    return math.exp(sum(math.log(statistics.median(s)) for s in steps) / len(steps))


def best_records(found: list[PeerPair]) -> dict[str, PeerRecord]:
    """TRL's best for each configuration: the record with the shortest step over the cards its pair kept."""
    return {name: min((p for p in found if p.name == name), key=lambda p: p.peer_step).peer
            for name in {p.name for p in found}}


def ratio_table(found: list[PeerPair], wanted: list[targets.Target] | None = None) -> Table | None:
    """hybridrl's compared step over each TRL record's step, one row a pair (pairs), in words from its interval,
    with each peer target (peer/step_ratio) that applies to the pair: met, missed or not settled. None without
    pairs."""
    if not found:
        return None
    table = Table(["configuration", "against", "hybridrl / TRL, step", "in words", "target", "bound", "verdict"])
    peer_targets = targets.of_metric(targets.PEER_RATIO, wanted)
    best = best_records(found)
    for pair in found:
        met = [t for t in peer_targets if (t.against == "trl-defaults" and pair.peer.defaults)
               or (t.against == "trl-best" and pair.peer is best[pair.name])]
        for target in met or [None]:
            table.rows.append([Cell(pair.name), Cell(pair.peer.label), Cell(wording.ratio_text(pair.est), "num"),
                               Cell(pair.words), *targets.cells(target, targets.judge(target, pair.est) if target
                                                                else "")])
    table.intervals = sum(1 for p in found if math.isfinite(p.est.lo))  # each pair once, where it has an interval
    return table


def verdict_lines(found: list[PeerPair]) -> list[tuple[str, str]]:
    """The report's opening verdict for each configuration against each TRL record: (pair, sentence)."""
    return [(f"{p.name} vs {short(p.peer.label)}", p.words) for p in found]


def plot(df: pd.DataFrame, peers: list[PeerRecord], labels: dict[str, str], out: Path,
         runs_dir: Path | None = None) -> Path | None:
    """Stacked bars of the phases' medians (phase_rows), one bar a configuration and a TRL record, the step's
    interval as a whisker; None (and no file) without records."""
    from hybridrl.report import plots

    if not peers:
        Path(out).unlink(missing_ok=True)
        return None
    rows = [(short(label), [e.value for e in ests[1:]], ests[0])
            for label, ests in phase_rows(df, peers, labels, runs_dir)]
    return plots.stacked_bars(rows, [h for h, _, _ in PHASES[1:]] + [REST], "seconds a step (median)", PLOT_TITLE,
                              out)
