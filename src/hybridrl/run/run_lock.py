"""One process at a time on a run's folder.

SLURM can requeue a preempted job while Snakemake, having read the job's passing state as a failure, submits a retry
of the same run: two processes would then append to one steps.jsonl. The second to start waits here for the first to
end, and then resumes from whatever it recorded (often: nothing left to do). The lock is the kernel's, so a process
that dies releases it.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO

from rich.console import Console

LOCK_FILE = ".lock"


def hold(root: Path, run_id: str, console: Console | None = None) -> IO[str]:
    """The run's lock, held for as long as the returned file stays open; waits, saying so, while another holds it."""
    f = open(root / LOCK_FILE, "a")  # noqa: SIM115 - held open for the run's lifetime
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        (console or Console(stderr=True)).print(f"{run_id}: another process is running it in {root}; waiting for "
                                                "it to end")
        fcntl.flock(f, fcntl.LOCK_EX)
    return f
