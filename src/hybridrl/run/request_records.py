"""A run's per-request records: where the loop writes a step's (`requests/step-NNNN.jsonl`), and the form the
repository keeps a finished run's in: gzipped.

The records are kept for audit: which adapter, seed and prompt each request had, what it returned. They compress
about ten times, and every GPU lease carries the whole working tree under a 64 MiB limit, so plain records in
`results/reference/` would soon leave no room for the engines' overlays. `compact` gzips them in place;
`read` takes a step's records in either form.
"""

from __future__ import annotations

import errno
import gzip
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl import atomic, jsonl


@dataclass(frozen=True)
class Compacted:
    files: int  # records gzipped by this call (0: already compact)
    before: int  # their bytes, plain
    after: int  # and gzipped


def path(run_dir: Path, step: int) -> Path:
    """Where a run writes the records of one step, plain."""
    return Path(run_dir) / "requests" / f"step-{step:04d}.jsonl"


def compact(run_dir: Path) -> Compacted:
    """Gzip every plain record file of the run, each beside itself (`.jsonl.gz`), then drop the plain one. Safe to
    repeat and to interrupt: a gzipped file is complete before its plain one goes."""
    files = before = after = 0
    for plain in sorted((Path(run_dir) / "requests").glob("step-*.jsonl")):
        data = plain.read_bytes()
        packed = gzip.compress(data, compresslevel=9, mtime=0)  # mtime 0: the same bytes on every machine
        atomic.write_bytes(plain.with_name(plain.name + ".gz"), packed)
        plain.unlink()
        files, before, after = files + 1, before + len(data), after + len(packed)
    return Compacted(files, before, after)


def read(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """The step's records, plain or gzipped; FileNotFoundError (its filename the plain path) when neither exists.
    Where both exist the plain one wins: the run wrote it after a compaction (resumed), or compaction stopped before
    its unlink and the two hold the same records."""
    plain = path(run_dir, step)
    packed = plain.with_name(plain.name + ".gz")
    if plain.exists():
        source, text = plain, plain.read_text()
    elif packed.exists():
        source, text = packed, gzip.decompress(packed.read_bytes()).decode()
    else:
        raise FileNotFoundError(errno.ENOENT, "no request records (plain or .gz)", str(plain))
    return jsonl.objects(text, source, "request record")
