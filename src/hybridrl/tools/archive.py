"""A study's reproducible archive: its results, configs, lock files and a sha256 manifest, with a verifier.

The archive holds one study: its report, plots and steps table, its runs (by run id), its measurements' results
under results/bench/ (by measurement name), its configs and the lock files. What else lies under results/ (the
committed studies in results/reference/, results/README.md, other studies' runs and measurements, earlier archives)
stays out, however much of it the tree holds.

Everything sits under one top directory named after the tarball, so unpacking never spills into
the current directory. MANIFEST.sha256 uses `sha256sum` format: `cd <top> && sha256sum -c MANIFEST.sha256`
checks an unpacked copy without hybridrl.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import tarfile
import zlib
from collections.abc import Collection, Iterable
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from hybridrl.atomic import atomic_path

MANIFEST = "MANIFEST.sha256"
# Fixed metadata so the same inputs give the same bytes (946684800 is the first second of the year 2000; GNU tar
# frowns on epoch 0).
MTIME = 946684800
# What one study writes under results/ (workflow/rules/report.smk and measure.smk); anything else there belongs to
# no one study: an allow-list, so that a folder someone adds beside them never rides along unasked.
STUDY_TOP = {"report.md", "report.html", "steps.csv", "steps.parquet", "plots", "runs", "bench"}
# Adapter weights are large (opt in with include_adapters); the others are tools' caches.
SKIP_DIRS = {"adapters", "__pycache__", ".snakemake"}
# A measurement's files in results/bench/: its result (.json, or .txt for a profile) and its job's SLURM grant
# (.slurm.json); an engine bench's engine logs lie in bench-logs-<run id>/.
RESULT_SUFFIXES = (".json", ".txt")
BENCH_SUFFIXES = (*RESULT_SUFFIXES, ".slurm.json")
BENCH_LOGS = "bench-logs-"
_LINE = re.compile(r"^([0-9a-f]{64})  (.+)$")


class ArchiveError(RuntimeError):
    """A file `verify` cannot open as an archive at all, or a run or measurement `pack` was asked for that is not
    there."""


def _archive_stem(out_tar: Path) -> str:
    name = out_tar.name
    for suffix in (".tar.gz", ".tgz", ".tar"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    raise ValueError(f"{out_tar}: archive name must end in .tar.gz, .tgz or .tar")


def _is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".tmp")


def _walk(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def _in_bench(name: str, is_dir: bool, bench: Collection[str] | None, run_ids: Collection[str] | None) -> bool:
    """Whether results/bench/<name> (a file, or the folder the path lies in) is one of the study's measurements'."""
    if is_dir:
        return name.startswith(BENCH_LOGS) and (run_ids is None or name[len(BENCH_LOGS):] in run_ids)
    return bench is None or any(name == f"{b}{suffix}" for b in bench for suffix in BENCH_SUFFIXES)


def _in_study(rel: PurePosixPath, run_ids: Collection[str] | None, bench: Collection[str] | None) -> bool:
    """Whether results/<rel> is the study's: a top-level output of STUDY_TOP, one of its runs, or one of its
    measurements' files (None: every run, every measurement)."""
    top = rel.parts[0]
    if top not in STUDY_TOP or (len(rel.parts) == 1 and top in ("runs", "bench")):
        return False
    if top == "runs":
        return run_ids is None or rel.parts[1] in run_ids
    if top == "bench":
        return _in_bench(rel.parts[1], len(rel.parts) > 2, bench, run_ids)
    return True


def results_members(results_dir: Path, out_tar: Path, include_adapters: bool = False,
                    run_ids: Collection[str] | None = None,
                    bench: Collection[str] | None = None) -> dict[str, Path]:
    """results/<relative path> -> file for the study's files only (`_in_study`), leaving out temp files and (by
    default) adapter weights. run_ids and bench name the study's runs and measurements; None takes every one."""
    members: dict[str, Path] = {}
    out = out_tar.resolve()
    skip_dirs = SKIP_DIRS - ({"adapters"} if include_adapters else set())
    for path in _walk(results_dir):
        rel = PurePosixPath(path.relative_to(results_dir).as_posix())
        if not _in_study(rel, run_ids, bench) or skip_dirs & set(rel.parts[:-1]) or _is_temp(path):
            continue
        if path.resolve() == out:
            continue
        members[f"results/{rel}"] = path
    return members


def extra_members(extra_files: Iterable[Path], root: Path) -> dict[str, Path]:
    """Configs and lock files, named by their path under root (outside root: extra/<name>)."""
    files: list[Path] = []
    for item in extra_files:
        item = Path(item)
        if not item.exists():
            raise FileNotFoundError(f"{item}: file to archive does not exist")
        files.extend(_walk(item) if item.is_dir() else [item])
    lock_dir = root / "requirements"
    if lock_dir.is_dir():
        files.extend(sorted(lock_dir.glob("*.txt")))
    members: dict[str, Path] = {}
    for path in files:
        try:
            arc = path.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            arc = f"extra/{path.name}"
        if arc in members and members[arc].resolve() != path.resolve():
            raise ValueError(f"two different files would be archived as {arc}: {members[arc]} and {path}")
        members[arc] = path
    return members


def _info(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = MTIME
    info.mode = mode
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


class _HashingReader:
    """Hashes exactly the bytes tarfile copies, so the manifest matches what is in the archive."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.fh.read(size)
        self.sha.update(data)
        return data


def _add_file(tar: tarfile.TarFile, name: str, path: Path) -> str:
    st = path.stat()
    mode = 0o755 if st.st_mode & 0o111 else 0o644
    with open(path, "rb") as fh:
        reader = _HashingReader(fh)
        tar.addfile(_info(name, st.st_size, mode), reader)
    return reader.sha.hexdigest()


def _open_out(tmp: Path, compress: bool) -> tuple[BinaryIO, BinaryIO]:
    raw = open(tmp, "wb")  # closed by pack, after the gzip stream that wraps it
    if not compress:
        return raw, raw
    # filename="" and mtime=0 keep the gzip header free of the temp name and the clock
    return raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6)


def pack(results_dir: Path, extra_files: Iterable[Path], out_tar: Path, root: Path | None = None,
         include_adapters: bool = False, run_ids: Collection[str] | None = None,
         bench: Collection[str] | None = None) -> Path:
    """Write out_tar (atomically): the study's results (`results_members`), extra files, requirements/*.txt under
    root, and MANIFEST.sha256.

    Members are sorted and carry fixed metadata, so the same inputs give the same bytes.
    """
    results_dir, out_tar = Path(results_dir), Path(out_tar)
    root = Path(root) if root is not None else Path.cwd()
    if not results_dir.is_dir():
        raise FileNotFoundError(f"{results_dir}: results directory does not exist")
    stem = _archive_stem(out_tar)
    _check_runs(results_dir, run_ids)
    _check_bench(results_dir, bench)
    members = {**extra_members(extra_files, root),
               **results_members(results_dir, out_tar, include_adapters, run_ids, bench)}
    with atomic_path(out_tar, fsync=True) as tmp:
        raw, stream = _open_out(tmp, compress=not out_tar.name.endswith(".tar"))
        try:
            with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
                sums = {arc: _add_file(tar, f"{stem}/{arc}", members[arc]) for arc in sorted(members)}
                manifest = "".join(f"{sums[arc]}  {arc}\n" for arc in sorted(sums)).encode()
                tar.addfile(_info(f"{stem}/{MANIFEST}", len(manifest), 0o644), io.BytesIO(manifest))
        finally:
            if stream is not raw:
                stream.close()
            raw.close()
    return out_tar


def _listed(names: list[str]) -> str:
    """At most ten names, then how many more; 'none' for none."""
    return ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "") or "none"


def _check_runs(results_dir: Path, run_ids: Collection[str] | None) -> None:
    """Every run asked for is a folder under results/runs/: a misspelt id would pack an archive without it."""
    missing = [rid for rid in run_ids or () if not (results_dir / "runs" / rid).is_dir()]
    if missing:
        there = sorted(p.name for p in (results_dir / "runs").glob("*") if p.is_dir())
        raise ArchiveError(f"--runs {' '.join(missing)}: no such run in {results_dir}/runs (runs there: "
                           f"{_listed(there)})")


def _check_bench(results_dir: Path, bench: Collection[str] | None) -> None:
    """Every measurement asked for has its result in results/bench/, for the same reason."""
    where = results_dir / "bench"
    missing = [b for b in bench or () if not any((where / f"{b}{s}").is_file() for s in RESULT_SUFFIXES)]
    if missing:
        there = sorted({p.name.removesuffix(".slurm.json").removesuffix(".json").removesuffix(".txt")
                        for p in where.glob("*") if p.is_file()})
        raise ArchiveError(f"--bench {' '.join(missing)}: no such measurement in {where} (results there: "
                           f"{_listed(there)})")


def _parse_manifest(text: str) -> tuple[dict[str, str], list[str]]:
    sums: dict[str, str] = {}
    problems = []
    for lineno, line in enumerate(text.splitlines(), 1):
        match = _LINE.match(line)
        if not match:
            problems.append(f"manifest line {lineno} is malformed: {line[:80]!r}")
            continue
        sums[match.group(2)] = match.group(1)
    return sums, problems


def _unsafe(name: str) -> bool:
    path = PurePosixPath(name)
    return path.is_absolute() or ".." in path.parts


def _read_members(tar: tarfile.TarFile) -> tuple[dict[str, str], bytes | None, list[str]]:
    """sha256 of each file member (name relative to the top directory), the manifest bytes, problems."""
    sums: dict[str, str] = {}
    manifest: bytes | None = None
    problems: list[str] = []
    tops: set[str] = set()
    with tar:
        for member in tar:
            if _unsafe(member.name):
                problems.append(f"unsafe member path: {member.name}")
                continue
            if member.isdir():
                continue
            top, _, rel = member.name.partition("/")
            tops.add(top)
            if not member.isfile():
                problems.append(f"not a regular file: {member.name}")
                continue
            if rel in sums or (rel == MANIFEST and manifest is not None):
                problems.append(f"duplicate member: {member.name}")
            data = tar.extractfile(member)
            if data is None:
                problems.append(f"unreadable member: {member.name}")
                continue
            if rel == MANIFEST:
                manifest = data.read()
            else:
                sha = hashlib.sha256()
                while block := data.read(1 << 20):
                    sha.update(block)
                sums[rel] = sha.hexdigest()
    if len(tops) > 1:
        problems.append(f"members lie under more than one top directory: {', '.join(sorted(tops))}")
    return sums, manifest, problems


def _open_archive(tar_path: Path) -> tarfile.TarFile:
    """The archive open for reading; a file that is none (tarfile lists every method it tried, over several lines)
    raises ArchiveError in one line naming it, and a missing one FileNotFoundError."""
    if not tar_path.exists():
        raise FileNotFoundError(f"{tar_path}: archive does not exist")
    try:
        return tarfile.open(tar_path, mode="r:*")
    except tarfile.ReadError as exc:
        detail = str(exc) if "\n" not in str(exc) else "neither gzip, bzip2, xz nor plain tar"
        raise ArchiveError(f"{tar_path}: not a tar archive ({detail})") from None
    except OSError as exc:
        raise ArchiveError(f"{tar_path}: cannot read it ({exc.strerror or exc})") from None


def verify(tar_path: Path) -> list[str]:
    """Problems found in the archive: modified, missing or extra members against the manifest. [] = ok.

    A file that is not an archive at all raises (ArchiveError, FileNotFoundError): there is nothing to verify."""
    tar_path = Path(tar_path)
    tar = _open_archive(tar_path)
    try:
        actual, manifest, problems = _read_members(tar)
    except (OSError, EOFError, tarfile.TarError, zlib.error, gzip.BadGzipFile) as exc:
        return [f"cannot read {tar_path}: {exc}"]
    if manifest is None:
        return [*problems, f"no {MANIFEST} in the archive"]
    try:
        expected, manifest_problems = _parse_manifest(manifest.decode())
    except UnicodeDecodeError:
        return [*problems, f"{MANIFEST} is not text"]
    problems += manifest_problems
    for name in sorted(expected.keys() | actual.keys()):
        if name not in actual:
            problems.append(f"missing: {name} is in the manifest but not in the archive")
        elif name not in expected:
            problems.append(f"extra: {name} is in the archive but not in the manifest")
        elif actual[name] != expected[name]:
            problems.append(f"modified: {name} does not match its sha256 in the manifest")
    return problems
