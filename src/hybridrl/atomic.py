"""Atomic writes: a temp file (or directory) beside the target, renamed over it only once it is complete.

A reader, or a run resumed after a crash, sees the old target or the whole new one, never half of one.
Temp names are `.<name>.<random>.tmp` (directories `.<name>.tmp`), which the archive leaves out.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path, fsync: bool = False) -> Iterator[Path]:
    """Yield a temp path beside `path`; it replaces `path` only if the block completes, else it is removed.

    fsync: flush the temp file to disk before the rename (for records a crash must not lose).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except OSError as exc:
        # a full disk's write names no file, a refused temp file its random name: name the target instead
        if exc.errno is not None and (exc.filename is None or _is_temp_of(exc.filename, path)):
            raise naming(exc, path) from exc
        raise
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def naming(exc: OSError, path: Path) -> OSError:
    """The same error with `path` as its file: the one the user gave, not a temp name or none at all."""
    return type(exc)(exc.errno, exc.strerror, str(path))


def _is_temp_of(name: str | bytes | int, path: Path) -> bool:
    """Whether an error's file name is one of the temp names atomic_path and atomic_dir give `path`."""
    name = Path(os.fsdecode(name)) if isinstance(name, (str, bytes)) else None
    return name is not None and name.parent == path.parent and name.name.startswith(f".{path.name}.") \
        and name.name.endswith(".tmp")


def check_writable(path: Path) -> None:
    """Make `path`'s folder and try a file in it, so that a command that measures for minutes fails at its start,
    not at its end (root may write where os.access says so and still be refused, as under /proc)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise naming(exc, path) from exc


def _mode_for(path: Path) -> int:
    """The target's own mode where it exists, else plain_mode()."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return plain_mode()


@functools.cache
def plain_mode() -> int:
    """The mode open() gives a new file under the umask this process had when first asked: mkstemp's 0600 would
    hide results, reports and records from the rest of a cluster group. Read from /proc (setting the umask to read
    it races other threads); 0644 where /proc does not say."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    return 0o644


def write_bytes(path: Path, data: bytes, fsync: bool = False) -> None:
    with atomic_path(path, fsync) as tmp:
        tmp.write_bytes(data)


def write_text(path: Path, text: str, fsync: bool = False) -> None:
    with atomic_path(path, fsync) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield an empty temp directory beside `path`; it takes the place of `path` (a directory or a link)
    only if the block completes. The old one is removed just before the rename: directories cannot be
    swapped in one step, but a half-written one never carries the final name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
    tmp.mkdir()
    try:
        yield tmp
        if path.is_symlink():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
