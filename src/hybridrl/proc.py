"""Reading a process's /proc/<pid>/stat, for the few places that walk process trees or test liveness."""

from __future__ import annotations

import os
from pathlib import Path


def _stat(path: Path) -> tuple[str, list[str]] | None:
    """(command name, the fields after "pid (comm) ") of one stat file; None where it is gone. The command name
    may hold spaces and parentheses, so it ends at the last ")"."""
    try:
        stat = path.read_text()
    except OSError:
        return None
    head, _, rest = stat.rpartition(")")
    return head.partition("(")[2], rest.split()


def stat_fields(pid: int, proc: Path = Path("/proc")) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "pid (comm) ": state, ppid, pgrp, ...; None where the process is gone
    or not visible here."""
    read = _stat(proc / str(pid) / "stat")
    return read[1] if read else None


def descendants(root: int, proc: Path = Path("/proc")) -> list[int]:
    """Every process below `root`: its children, theirs, and so on, as /proc shows them now."""
    kids: dict[int, list[int]] = {}
    with os.scandir(proc) as entries:
        for entry in entries:
            if entry.name.isdigit() and (fields := stat_fields(int(entry.name), proc)) is not None:
                kids.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = [], [root]
    while frontier:
        children = kids.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def process_name(pid: int, comm: str, proc: Path = Path("/proc")) -> str:
    """A process's command name, or for a Python interpreter the module it runs (`python -m vllm.entrypoints...`):
    every Python process is called python3 otherwise."""
    if not comm.startswith("python"):
        return comm
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return comm
    module = argv[argv.index(b"-m") + 1] if b"-m" in argv[:-1] else b""
    return module.decode(errors="replace") or comm


def thread_cpu_ticks(pids: list[int], proc: Path = Path("/proc")) -> dict[tuple[int, int], tuple[int, str]]:
    """(pid, thread id) -> (user + system CPU time so far in clock ticks, "process/thread" names, the thread's
    name left out where it repeats the process's) for every thread of `pids`; one that ends meanwhile is left out."""
    out = {}
    for pid in pids:
        own = _stat(proc / str(pid) / "stat")
        if own is None:  # gone, or not visible here
            continue
        try:
            tids = os.listdir(proc / str(pid) / "task")
        except OSError:
            continue
        name = process_name(pid, own[0], proc)
        for tid in tids:
            read = _stat(proc / str(pid) / "task" / tid / "stat")
            if read and len(read[1]) > 12:  # utime and stime are fields 14 and 15 of stat
                label = name if read[0] == own[0] else f"{name}/{read[0]}"
                out[(pid, int(tid))] = (int(read[1][11]) + int(read[1][12]), label)
    return out
