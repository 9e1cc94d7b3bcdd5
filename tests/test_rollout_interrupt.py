"""A rollout interrupted by SIGTERM (the loop's handler raises SystemExit in it) ends within a bounded time even when
a request task will not take its cancellation; asyncio.run would wait for it forever (a SLURM-cancelled run did)."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import asyncio, sys, time
    from hybridrl.engines import server

    async def stubborn():  # a request task stuck where cancellation cannot reach it
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass

    async def rollout():
        asyncio.get_running_loop().create_task(stubborn())
        await asyncio.sleep(0.2)
        raise SystemExit(143)  # what the SIGTERM handler raises

    t0 = time.monotonic()
    try:
        server.run_bounded(rollout(), grace_s=float(sys.argv[1]))
    except SystemExit as exc:
        print(f"exit {exc.code} after {time.monotonic() - t0:.1f} s", flush=True)
    """)


def _interrupted(grace_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(grace_s)], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})


def test_an_interrupted_rollout_ends_after_its_grace_even_with_a_task_that_ignores_cancellation() -> None:
    t0 = time.monotonic()
    done = _interrupted(1.0)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("exit 143 after ")  # the interruption goes on to the loop's `finally`
    assert float(done.stdout.split()[3]) < 5 and time.monotonic() - t0 < 30
    assert "1 request task(s) did not stop within 1 s; left behind" in done.stderr


def test_a_rollout_that_ends_returns_its_value_and_leaves_no_loop_behind() -> None:
    import asyncio

    from hybridrl.engines import server

    async def answer() -> int:
        await asyncio.sleep(0)
        return 7

    assert server.run_bounded(answer()) == 7
    assert server.run_bounded(answer()) == 7  # a fresh loop each time: the last one was closed
