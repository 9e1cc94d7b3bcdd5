"""Gather every run's steps.jsonl into one tidy table (one row per run and step)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from hybridrl import jsonl
from hybridrl.atomic import atomic_path
from hybridrl.run import record
from hybridrl.study.run_config import split_replicate

# From each run's provenance.json: which code and which GPU recorded it (comparisons across them get a caveat),
# the share of each GPU the engine was given, which sets most of its memory, and what a colocated engine gives
# back while the trainer runs (SGLang: kv_cache keeps the weights resident; vLLM level 1 moves them to CPU)
PROVENANCE = ["git_commit", "gpu", "machine", "sglang_release", "device"]
# and who ran it: the executor (slurm or local), the SLURM job (<array job>_<task> for an array task), the node and
# the UUIDs of the GPUs it was given; none for runs recorded before provenance named them
SCHEDULER = ["executor", "slurm_job_id", "node", "gpu_uuids"]
# how many GPUs the run could see: a split run that saw fewer than it asks for put its engine on the trainer's GPU
SEEN = ["gpu_count"]
# the GPUs a run held (train_tp, train_ep, train_gpus), its rollouts per step, its warm-up and its rollout client (which
# requests are streamed, through which pool, in which process) and how far its rollouts may run ahead of training
# (overlap) come from its run config too
CONFIGURED = ["gpu_memory_utilization", "vllm_sleep_level", "sglang_retain_cpu_backup", "engine_sleep", "train_tp",
              "train_ep",
              "train_gpus",
              "prompts_per_step", "group_size", "warmup_steps", "stream_fraction", "shared_pool", "overlap",
              "rollout_process", "keep_connections", "gc_freeze", "vllm_detokenize", "sglang_detokenize", "ep_batch",
              "ep_dispatch", "keep_base_on_gpu", "onload_beside_release"]
# Made here from the columns above: which configuration a replicate belongs to, what a colocated engine
# releases on sleep (the arm), which rollout client it went through, how its trainer's update was laid out, cost
# per GPU, and the engine's own time on
# the rollout (tokens over throughput: in overlap the rollout runs beside training, and timing_s/gen is only the
# step's wait for its end)
DERIVED_STRINGS = ["config_id", "release", "client", "update_layout"]
COST = ["cost/gpus", "cost/tok_s_per_gpu", "cost/gpu_s_per_step", "cost/gpu_h_per_1k_rollouts"]
AWAKE = "stays awake"  # the release of a colocated engine that never sleeps (engine_sleep false)
DERIVED = [*DERIVED_STRINGS, "replicate", *COST, "perf/rollout_s"]
# The record's keys (hybridrl.run.record), then what each run's provenance adds, then what is derived from both
KNOWN = [*record.RECORD_KEYS, *PROVENANCE, *SCHEDULER, *SEEN, *CONFIGURED, *DERIVED]
# the configured choices that are words (keep_base_on_gpu: true, false or auto)
CONFIGURED_STRINGS = ["ep_batch", "ep_dispatch", "keep_base_on_gpu"]
STRINGS = [*record.STRINGS, *PROVENANCE, *SCHEDULER, *CONFIGURED_STRINGS, *DERIVED_STRINGS]
BOOLS = list(record.BOOLS)
NUMBERS = [c for c in KNOWN if c not in STRINGS and c not in BOOLS]
# Two rows compare as the same configuration when these match; config_id keeps seeds and parameters apart
# and joins a configuration's replicates (run ids <config_id>, <config_id>-r2, ...).
CONFIG_KEY = ["engine", "placement", "trainer", "model", "tp", "release", "client", "config_id"]


def read_steps(path: Path) -> list[dict[str, Any]]:
    """Records of one steps.jsonl; a torn last line (crash mid-append) is skipped with a warning."""
    return jsonl.objects(Path(path).read_text(), path, "step record", skip_bad=True)


def load_run(run_dir: Path) -> pd.DataFrame:
    """One run's steps as a frame; run_id falls back to the directory name."""
    run_dir = Path(run_dir)
    steps = run_dir / "steps.jsonl"
    if not steps.is_file():
        raise FileNotFoundError(f"{steps}: no per-step record for run {run_dir.name}")
    df = pd.DataFrame.from_records(read_steps(steps))
    if "run_id" not in df.columns or df["run_id"].isna().all():
        df["run_id"] = run_dir.name
    for col, value in provenance_fields(read_provenance(run_dir / "provenance.json")).items():
        df[col] = value
    return df


def read_provenance(path: Path) -> dict[str, Any] | None:
    """A run's provenance.json, or None where it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def commit_label(git: dict[str, Any]) -> str | None:
    """A recorded commit, short, with "-dirty" where the tree had uncommitted changes."""
    commit = git.get("commit")
    if not commit:
        return None
    dirty = commit.endswith("-dirty") or git.get("dirty") is True
    return commit.removesuffix("-dirty")[:7] + ("-dirty" if dirty else "")


def provenance_fields(prov: dict[str, Any] | None) -> dict[str, Any]:
    """The commit, the GPU name, the machine (its boot id's start) and the engine's memory settings a run
    recorded; None where unknown."""
    if prov is None:
        return dict.fromkeys(PROVENANCE + SCHEDULER + SEEN + CONFIGURED)
    devices = (prov.get("gpu") or {}).get("devices") or []
    names = sorted({d.get("name") for d in devices if d.get("name")})
    recorded = prov.get("run_config") or {}  # as that run wrote it: older runs may lack a key
    boot = (prov.get("host") or {}).get("boot_id")  # which machine (and boot) ran it; older runs lack it
    return {"git_commit": commit_label(prov.get("git") or {}), "gpu": " + ".join(names) or None,
            "machine": boot[:8] if isinstance(boot, str) and boot else None, "gpu_count": len(devices) or None,
            **scheduler_fields(prov.get("scheduler")),
            **{k: recorded.get(k) for k in ["sglang_release", "device"] + CONFIGURED}}


def scheduler_fields(sched: dict[str, Any] | None) -> dict[str, Any]:
    """The SCHEDULER columns from provenance's scheduler block; None where the run recorded none (or no GPU)."""
    if not sched:
        return dict.fromkeys(SCHEDULER)
    job, array, task = (sched.get(k) for k in ("slurm_job_id", "slurm_array_job_id", "slurm_array_task_id"))
    uuids = ",".join(g["uuid"] for g in sched.get("gpus") or [] if g.get("uuid"))
    return {"executor": sched.get("executor"), "slurm_job_id": f"{array}_{task}" if array and task else job,
            "node": sched.get("node"), "gpu_uuids": uuids or None}


def release_arm(engine: Any, placement: Any, sglang_release: Any, vllm_sleep_level: Any,
                retain_cpu_backup: Any = None, engine_sleep: Any = None, onload_beside: Any = None) -> str | None:
    """What a colocated engine gives back on sleep, which decides what its sleep and wake move: SGLang's
    KV-only release keeps the weights on the GPU, so it is an arm of its own. SGLang's full release that pins
    its CPU copy anew every sleep (its default, and every run recorded before sglang_retain_cpu_backup existed)
    is one too: vLLM's level 1 reuses pinned buffers. So is a full release whose weights leave beside the trainer's
    onload (onload_beside_release), whose sleep phase holds the KV cache's release alone. An engine that never
    sleeps (engine_sleep false; runs recorded before the key slept) gives back nothing. None outside colocate."""
    engine, placement = (None if _missing(v) else str(v) for v in (engine, placement))
    if placement != "colocate":
        return None
    if to_bool(engine_sleep) is False:
        return AWAKE
    if engine == "sglang":
        if str(sglang_release) == "kv_cache":
            return "kv-only"
        if str(sglang_release) == "all":
            arm = "full release" if to_bool(retain_cpu_backup) is True else "full release, re-pinned"
            return f"{arm}, onload beside" if to_bool(onload_beside) is True else arm
        return None
    if engine in ("vllm", "vllm-inprocess") and not _missing(vllm_sleep_level):
        return f"level {int(vllm_sleep_level)}"
    return None


def rollout_client(engine: Any, stream_fraction: Any, shared_pool: Any, rollout_process: Any = None,
                   keep_connections: Any = None) -> str | None:
    """Which rollout path a run took: the share of requests streamed token by token and, for an HTTP
    engine, whether they share one connection pool (the old client) or get a connection per concurrency slot,
    kept from one rollout to the next or not (keep_connections), and whether the client ran in a worker process
    (rollout_process; runs before it, and with it off, in a thread).
    None for runs recorded before the choice existed; those streamed every request through one shared pool."""
    if _missing(stream_fraction):
        return None
    share = float(stream_fraction)
    streamed = "every request streamed" if share >= 1 else "none streamed" if share <= 0 else f"{share:g} streamed"
    if str(engine) == "vllm-inprocess":  # no HTTP client: nothing to pool
        return streamed
    pool = "one shared pool" if to_bool(shared_pool) is True else "a connection per slot"
    kept = ", kept" if to_bool(keep_connections) is True and to_bool(shared_pool) is not True else ""
    worker = ", in a worker process" if to_bool(rollout_process) is True else ""
    return f"{streamed}, {pool}{kept}{worker}"


def update_layout(train_ep: Any, ep_batch: Any, ep_dispatch: Any, keep_base_on_gpu: Any) -> str | None:
    """How the trainer's update was laid out, where a study may vary it: Megatron's expert parallelism with its
    batch and dispatch (run_config.py), and a colocated trainer's frozen base kept on the GPU. None where nothing of
    it differs from the defaults, or the run recorded none of it (runs before the keys)."""
    parts = []
    if not _missing(train_ep) and int(train_ep) > 1:
        parts.append(f"EP {int(train_ep)}" + (", split batch" if str(ep_batch) == "split" else "")
                     + (", masked rows" if str(ep_dispatch) == "masked" else ""))
    keep = None if _missing(keep_base_on_gpu) else str(keep_base_on_gpu)
    if keep == "auto":
        parts.append("base kept where it fits")
    elif to_bool(keep_base_on_gpu) is True:
        parts.append("base kept")
    return ", ".join(parts) or None


def run_gpus(row: pd.Series) -> float:
    """GPUs a run held: colocate and restart share the engine's TP GPUs with the trainer (Megatron may span
    more); split adds the trainer's own GPUs (engines/gpus.py: split_engine_devices), as far as the run saw that
    many (with fewer, the engine shared the trainer's). NaN on CPU runs."""
    def text(key: str) -> str:
        return "" if _missing(row.get(key)) else str(row[key])

    if text("device") == "cpu" or _missing(row.get("tp")):
        return float("nan")
    tp = float(row["tp"])

    def megatron(key: str) -> float:  # its ranks: train_tp x train_ep (1 each where not recorded or not megatron)
        return 1.0 if _missing(row.get(key)) or text("trainer") != "megatron" else float(row[key])

    if text("placement") == "split":
        wanted = _split_gpus(row)
        return wanted if _missing(row.get("gpu_count")) else min(wanted, float(row["gpu_count"]))
    return max(tp, megatron("train_tp") * megatron("train_ep"))


def _split_gpus(row: pd.Series) -> float:
    """What a split run asks for: the engine's TP GPUs and the trainer's own."""
    return float(row["tp"]) + (1.0 if _missing(row.get("train_gpus")) else float(row["train_gpus"]))


def shared_split(row: pd.Series) -> bool:
    """A split run that saw fewer GPUs than its engine and trainer ask for: they shared one."""
    if str(row.get("placement")) != "split" or _missing(row.get("gpu_count")) or _missing(row.get("tp")):
        return False
    return float(row["gpu_count"]) < _split_gpus(row)


def overlap_steps(row: Any) -> int:
    """How many steps a split run's rollouts may run ahead of its training (0: none, or not a split)."""
    overlap = pd.to_numeric(row.get("overlap"), errors="coerce")
    return int(overlap) if str(row.get("placement")) == "split" and pd.notna(overlap) else 0


def placement_name(row: Any) -> str:
    """The placement as a reader names it: colocate, restart, split, or overlapped split (its own arm)."""
    return "overlapped split" if overlap_steps(row) > 0 else str(row.get("placement"))


def derive(df: pd.DataFrame) -> pd.DataFrame:
    """The DERIVED columns: configuration id and replicate (from the run id), release arm, cost per GPU.

    tokens/s per GPU is the step's generated tokens over its time (the compared step: the instrument's checks left
    out) and every GPU the run held, so that placements that hold more GPUs, or idle some during training, pay for
    them."""
    df = df.copy()
    split = df["run_id"].astype(str).map(split_replicate)
    df["config_id"] = split.map(lambda t: t[0])
    df["replicate"] = split.map(lambda t: t[1])
    arm = ["engine", "placement", "sglang_release", "vllm_sleep_level", "sglang_retain_cpu_backup", "engine_sleep",
           "onload_beside_release"]
    df["release"] = [release_arm(*r) for r in df[arm].itertuples(index=False)]
    df["client"] = [rollout_client(*r) for r in
                    df[["engine", "stream_fraction", "shared_pool", "rollout_process", "keep_connections"]]
                    .itertuples(index=False)]
    df["update_layout"] = [update_layout(*r) for r in
                           df[["train_ep", "ep_batch", "ep_dispatch", "keep_base_on_gpu"]].itertuples(index=False)]
    gpus = df.apply(run_gpus, axis=1) if len(df) else pd.Series(dtype=float)
    df[record.COMPARED_STEP] = compared_step(df)
    step = df[record.COMPARED_STEP]  # what a step costs leaves out the instrument's checks, as its time does
    rollouts = pd.to_numeric(df["prompts_per_step"], errors="coerce") * pd.to_numeric(df["group_size"], errors="coerce")
    df["cost/gpus"] = gpus
    df["cost/tok_s_per_gpu"] = pd.to_numeric(df["perf/gen_tokens"], errors="coerce") / step / gpus
    df["cost/gpu_s_per_step"] = step * gpus
    df["cost/gpu_h_per_1k_rollouts"] = df["cost/gpu_s_per_step"] / rollouts * 1000 / 3600
    df["perf/rollout_s"] = pd.to_numeric(df["perf/gen_tokens"], errors="coerce") / pd.to_numeric(
        df["perf/throughput"], errors="coerce")
    return mask_ahead_readings(df)


def compared_step(df: pd.DataFrame) -> pd.Series:
    """The step studies compare (record.COMPARED_STEP) as recorded; for records from before the key, the step less
    its instrument phases, which is the whole step where those were not timed (checks_untimed)."""
    step = pd.to_numeric(df["timing_s/step"], errors="coerce")
    instrument = sum(pd.to_numeric(df[f"timing_s/{p}"], errors="coerce").fillna(0.0) for p in record.INSTRUMENT_PHASES)
    return pd.to_numeric(df[record.COMPARED_STEP], errors="coerce").fillna(step - instrument)


def checks_untimed(df: pd.DataFrame) -> pd.Series:
    """Rows whose checks ran inside the step but untimed (records from before the check phase): their compared step
    is the whole step."""
    step = pd.to_numeric(df["timing_s/step"], errors="coerce")
    timed = pd.concat([pd.to_numeric(df[f"timing_s/{p}"], errors="coerce") for p in record.INSTRUMENT_PHASES],
                      axis=1).notna().any(axis=1)
    return (step.notna() & ~timed).astype(bool)


def ran_ahead(df: pd.DataFrame) -> pd.Series:
    """Rows whose rollout ran ahead, during the last step's training (overlap): a stale rollout of a run with a
    trainer. Runs without one (trainer: none) never ran ahead, though older ones recorded their steps since the base
    model as staleness."""
    stale = pd.to_numeric(df["rollout/staleness"], errors="coerce") > 0
    return (stale & (df["trainer"].astype(str) != "none")).astype(bool)


def mask_ahead_readings(df: pd.DataFrame) -> pd.DataFrame:
    """Null the gen phase's host and GPU readings (record.ROLLOUT_READINGS) of steps whose rollout ran ahead:
    their gen phase was the wait for it. Runs now record null there; older tables kept the wait's
    readings (over a few ms: a thread at 1,200% of a core) and are masked here."""
    ahead = ran_ahead(df)
    if ahead.any():
        df.loc[ahead, list(record.ROLLOUT_READINGS)] = None
    return df


def _missing(value: Any) -> bool:
    return not isinstance(value, list | dict | tuple) and bool(pd.isna(value))


def to_bool(value: Any) -> Any:
    """A recorded flag as True or False, whether it was read as a bool, a number or a string; pd.NA where missing."""
    if _missing(value):
        return pd.NA
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        return pd.NA
    return bool(value)


def _tidy_extra(col: pd.Series) -> pd.Series:
    """Unknown keys: nested values become JSON text, mixed types become text, so parquet accepts them."""
    if col.dtype != object:
        return col
    present = col.dropna()
    if present.map(lambda v: isinstance(v, dict | list)).any():
        return col.map(lambda v: json.dumps(v, sort_keys=True) if isinstance(v, dict | list) else v)
    kinds = {type(v) for v in present}
    if kinds and all(issubclass(k, int | float) and k is not bool for k in kinds):
        return pd.to_numeric(col, errors="coerce")
    if len(kinds) > 1:
        return col.map(lambda v: None if _missing(v) else str(v))
    return col


def normalise(df: pd.DataFrame) -> pd.DataFrame:
    """Every known column present with its dtype, known columns first, sorted by run and step."""
    # the missing known columns at once (NaN): one at a time fragments the frame
    df = df.reindex(columns=[*df.columns, *(c for c in KNOWN if c not in df.columns)])
    df = derive(df)
    for col in STRINGS:
        df[col] = df[col].map(lambda v: pd.NA if _missing(v) else str(v)).astype("string")
    for col in NUMBERS:
        df[col] = pd.to_numeric(df[col], errors="coerce")
    for col in BOOLS:
        df[col] = df[col].map(to_bool).astype("boolean")
    extras = sorted(c for c in df.columns if c not in KNOWN)
    for col in extras:
        df[col] = _tidy_extra(df[col])
    df = df[KNOWN + extras]
    # one block per dtype: columns added one by one leave a fragmented frame that pandas warns about downstream
    return df.sort_values(["run_id", "step"], kind="stable").reset_index(drop=True).copy()


def gather(run_dirs: Iterable[Path]) -> pd.DataFrame:
    """All runs in one table. A step recorded twice (resume) keeps its last record."""
    frames, run_dirs = [], list(run_dirs)
    for run_dir in run_dirs:
        frame = load_run(Path(run_dir))
        if frame.empty:
            warnings.warn(f"{run_dir}: steps.jsonl holds no steps; run left out", stacklevel=2)
            continue
        frames.append(frame)
    if not frames:
        given = f"{run_dirs[0]}, ..." if len(run_dirs) > 1 else str(run_dirs[0]) if run_dirs else "none"
        raise TableError(f"no steps in any of the {len(run_dirs)} run folders given ({given}): nothing to aggregate")
    df = pd.concat(frames, ignore_index=True, sort=False)
    before = len(df)
    df = df.drop_duplicates(subset=["run_id", "step"], keep="last")
    if len(df) < before:
        warnings.warn(f"{before - len(df)} duplicate (run_id, step) records dropped", stacklevel=2)
    return normalise(df)


def write_table(df: pd.DataFrame, out_csv: Path | None, out_parquet: Path | None) -> None:
    """Write the table as CSV and/or parquet, each atomically."""
    if out_csv is not None:
        with atomic_path(Path(out_csv)) as tmp:
            df.to_csv(tmp, index=False)
    if out_parquet is not None:
        with atomic_path(Path(out_parquet)) as tmp:
            df.to_parquet(tmp, index=False)


class TableError(RuntimeError):
    """A file given as the study's table that is not one `hybridrl aggregate` wrote."""


def read_table(path: Path) -> pd.DataFrame:
    """Read a table written by write_table (parquet or CSV) back with the same dtypes."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            df = pd.read_parquet(path)
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise TableError(f"{path}: not a readable parquet table ({exc})") from None
    elif path.suffix == ".csv":
        # text columns stay text: a commit such as 33439e1 would otherwise read as the number 334390.0
        try:
            header = pd.read_csv(path, nrows=0).columns
        except pd.errors.EmptyDataError:
            raise TableError(f"{path}: empty file, not a table of steps (write one with hybridrl aggregate)") from None
        df = pd.read_csv(path, dtype={c: str for c in STRINGS if c in header})
    else:
        raise TableError(f"{path}: expected a .parquet or .csv table of steps (hybridrl aggregate writes both)")
    missing = [c for c in record.IDENTITY if c not in df.columns]
    if missing:
        raise TableError(f"{path}: not a table of steps: no column {', '.join(missing)} (hybridrl aggregate writes "
                         "one from the runs' steps.jsonl)")
    if df.empty:
        raise TableError(f"{path}: holds no steps: no run recorded one")
    return normalise(df)
