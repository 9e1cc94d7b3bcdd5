"""Which card a job ran on: the GPUs' uuids in the SLURM job record that `cluster record-job` writes beside each run
(runs/<run>/slurm.json) and each measurement (bench/<name>.slurm.json). Comparisons that the targets hold to "the
same card, the same lease" read it; a study run without SLURM has no card, and is compared as a whole."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

CARD_LABEL = 12  # "GPU-8e71b4ae": enough of a uuid to tell a study's cards apart in a label


def job_card(slurm_record: Path) -> str | None:
    """The GPUs a SLURM job ran on, by uuid, as one key. None where there is no such record or it names no GPU."""
    try:
        jobs = json.loads(Path(slurm_record).read_text()).get("jobs") or []
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    uuids = sorted({str(g["uuid"]) for j in jobs for g in j.get("gpus") or [] if g.get("uuid")})
    return "+".join(uuids) or None


def run_cards(df: pd.DataFrame, runs_dir: Path | None) -> dict[str, str | None]:
    """Each run of the table and its card (runs_dir/<run>/slurm.json); None for every run without runs_dir."""
    return {str(r): job_card(runs_dir / str(r) / "slurm.json") if runs_dir else None for r in df["run_id"].unique()}


def in_order(df: pd.DataFrame, cards: dict[str, str | None]) -> list[str]:
    """The cards the table's runs ran on, the earliest run's first (time_unix, else run id)."""
    key = "time_unix" if "time_unix" in df.columns else "run_id"
    first = df.groupby(df["run_id"].astype(str))[key].min().sort_values(kind="stable")
    return list(dict.fromkeys(c for r in first.index if (c := cards.get(r))))


def on_card(text: str, card: str | None) -> str:
    """A row's label with the card it holds ("sglang · awake · GPU-8e71b4ae"); the label alone for a pooled row."""
    return text if card is None else f"{text} · {card[:CARD_LABEL]}"
