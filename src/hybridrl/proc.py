"""Reading a process's /proc/<pid>/stat, for the few places that walk process trees or test liveness."""

from __future__ import annotations

from pathlib import Path


def stat_fields(pid: int, proc: Path = Path("/proc")) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "pid (comm) ": state, ppid, pgrp, ...; None where the process is gone
    or not visible here. The command name may hold spaces and parentheses, so the split is at its last ")"."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()
