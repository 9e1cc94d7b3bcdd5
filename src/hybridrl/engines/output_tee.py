"""This process's stdout and stderr copied into a log file while an in-process engine starts.

An in-process engine's core runs in a child process that writes its log to the stdout and stderr it inherits: the
controller's, which a workflow pipes on (tee), so the controller cannot read it back. While `capture()` is open,
fds 1 and 2 are pipes that a thread each copies on to where they went before and into the file. The child started
meanwhile keeps its ends of the pipes after the controller takes its own fds back, so the file gets the engine's
whole log and nothing the controller prints later.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path
from typing import BinaryIO

STD_FDS = (1, 2)


class OutputTee:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.start = 0  # where the capture's text begins in the file (earlier starts' come before it)
        self._file: BinaryIO | None = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pumping = 0  # pumps still copying

    @contextlib.contextmanager
    def capture(self, head: str) -> Iterator[None]:
        """Everything written to fds 1 and 2 inside goes to the file too (after `head`), and so does what the
        children started inside write to theirs until they exit."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        self._file.write(head.encode())
        self._file.flush()
        self.start = self._file.tell()
        _flush_std()
        # multiprocessing's resource tracker, started by the first child it spawns, lives as long as this process:
        # started inside, it would hold the pipes open, and the file, for good
        resource_tracker.ensure_running()
        saved = [os.dup(fd) for fd in STD_FDS]
        try:
            for fd, out in zip(STD_FDS, saved, strict=True):
                read, write = os.pipe()
                thread = threading.Thread(target=self._pump, args=(read, out), name=f"engine-log-fd{fd}",
                                          daemon=True)
                with self._lock:
                    self._pumping += 1
                thread.start()
                self._threads.append(thread)
                os.dup2(write, fd)
                os.close(write)  # the fd and the children's copies hold the pipe open now
            yield
        finally:
            _flush_std()
            for fd, out in zip(STD_FDS, saved, strict=True):
                os.dup2(out, fd)

    def text(self) -> str:
        """The capture's text so far."""
        with self._lock, open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace")

    def wait(self, timeout_s: float) -> bool:
        """Wait, `timeout_s` at most in all, until every child has closed the pipes (the file is closed then);
        whether they all did."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _pump(self, read: int, out: int) -> None:
        """Copy the pipe to `out` and to the file until every writer has closed it. A destination that fails (the
        workflow's tee gone) is left, the other kept: a writer must never block on a pipe nobody drains."""
        alive = True
        while chunk := _read(read):
            if alive:
                alive = _write_all(out, chunk)
            with self._lock:
                if self._file is not None:
                    self._file.write(chunk)
                    self._file.flush()
        os.close(read)
        os.close(out)
        with self._lock:  # the last pump to end closes the file
            self._pumping -= 1
            if self._pumping == 0 and self._file is not None:
                self._file.close()
                self._file = None


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""


def _write_all(fd: int, data: bytes) -> bool:
    """Write all of `data`; False where the fd fails."""
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        return False
    return True


def _flush_std() -> None:
    """Python's buffered text goes out through the fds it was written for."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
