"""A study's trainer benchmarks (bench/trainer-*.json, written by `hybridrl trainer-bench`): one row a setting, its
processes (-rK) pooled, the median update with a two-level 95% interval (processes, then updates), and the
targets on the update (targets.yaml, trainer/update_s) judged from that interval."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from hybridrl.report import stats, targets
from hybridrl.report.cells import Cell, Table, fmt_est
from hybridrl.report.peer import BenchRecordError, measurement_files

_REPLICATE = re.compile(r"-r\d+$")


# one process of a setting: its record, its trainer's figures and its timed updates (s)
Process = tuple[dict[str, Any], dict[str, Any], list[float]]


def _record(path: Path) -> tuple[dict[str, Any], dict[str, tuple[dict[str, Any], list[float]]]]:
    """(the record, {trainer: (its figures, its timed updates)}), one file holding one trainer or both; one line
    naming the file where it is not a record."""
    try:
        data = json.loads(path.read_text())
        trainers = {t: (data[t], [float(u) for u in data[t]["update_s_all"]])
                    for t in ("hf", "megatron") if isinstance(data.get(t), dict)}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise BenchRecordError(f"{path}: not a readable trainer-bench record ({exc!r})") from None
    if not trainers:
        raise BenchRecordError(f"{path}: not a readable trainer-bench record (no hf or megatron figures)")
    return data, trainers


def _order(path: Path) -> tuple[list[str | int], int]:
    """Numbers in a name compared as numbers (mb32 before mb128), then NAME.json before NAME-r2.json."""
    k = _REPLICATE.search(path.stem)
    natural = [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", _REPLICATE.sub("", path.stem))]
    return natural, int(k.group()[2:]) if k else 1


def settings(bench_dir: Path) -> dict[str, list[Process]]:
    """{setting: its processes}: trainer-NAME.json and trainer-NAME-rK.json are one setting, a file holding both
    trainers two."""
    out: dict[str, list[Process]] = {}
    for path in sorted(measurement_files(bench_dir, "trainer-"), key=_order):
        stem = _REPLICATE.sub("", path.stem).removeprefix("trainer-")
        data, trainers = _record(path)
        for trainer, (figures, updates) in trainers.items():
            name = stem if f"-{trainer}-" in f"{stem}-" else f"{stem} · {trainer}"
            out.setdefault(name, []).append((data, figures, updates))
    return out


def applies(where: targets.Where, record: dict[str, Any]) -> bool:
    """Whether a trainer-bench record is what the target is about: its shape, GPU, vocabulary and tokens a batch;
    a target on an engine or a placement never applies to a trainer alone."""
    if where.engine is not None or where.placement is not None:
        return False
    parts = {"model": (where.model, record.get("shape")), "gpu": (where.gpu, record.get("device"))}
    if any(want is not None and want.lower() not in str(got or "").lower() for want, got in parts.values()):
        return False
    exact = {"gpu_count": (where.gpu_count, record.get("train_ep", 1)), "vocab": (where.vocab, record.get("vocab")),
             "gen_tokens": (where.gen_tokens, record.get("completion_tokens"))}
    return all(want is None or got == want for want, got in exact.values())


def _count(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    return f"{value:,}" if isinstance(value, int) else "–"


def _median(figures: list[dict[str, Any]], key: str, form: str) -> str:
    """The processes' median of one figure, where they recorded it (MFU is not counted on a CPU)."""
    values = [float(f[key]) for f in figures if isinstance(f.get(key), (int, float))]
    return form.format(statistics.median(values)) if values else "–"


def table(bench_dir: Path, wanted: list[targets.Target] | None = None) -> Table | None:
    """One row a setting and target on it (one a setting where none applies); None without a trainer bench."""
    found = settings(bench_dir)
    if not found:
        return None
    bound = targets.of_metric(targets.TRAINER_UPDATE, wanted)
    out = Table(["setting", "GPU", "vocabulary", "micro-batch", "processes", "each process's median update (s)",
                 "update, median [95% CI] (s)", "MFU (median)", "peak, median (GB)", "target", "bound", "verdict"])
    for name, processes in found.items():
        updates = [u for _, _, u in processes]
        est = stats.hierarchical_median(updates)
        data, figures = processes[0][0], [f for _, f, _ in processes]
        row = [Cell(name), Cell(str(data.get("device", "–"))),
               Cell(_count(data, "vocab"), "num"), Cell(_count(data, "micro_batch"), "num"),
               Cell(str(len(processes)), "num"), Cell(", ".join(f"{statistics.median(u):.2f}" for u in updates), "num"),
               Cell(fmt_est(est), "num"), Cell(_median(figures, "mfu_median", "{:.1%}"), "num"),
               Cell(_median(figures, "peak_gb", "{:.1f}"), "num")]
        applying = [t for t in bound if applies(t.where, data)]
        for target in applying or [None]:
            out.rows.append([*row, *targets.cells(target, targets.judge(target, est) if target else "")])
    return out
