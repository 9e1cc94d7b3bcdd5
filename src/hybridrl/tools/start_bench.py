"""An engine's start through hybridrl against the same engine started by its own command line (`python -m
hybridrl start-bench`): what hybridrl adds to an engine's start, measured on one machine in one job.

The two paths, alternated A B B A over the repeats so that neither always runs on the warmer caches:
- hybridrl: the run's engine class starts it as a run does (its port claims, log, health wait, warm-up request)
  and stops it; timed from the call to its return;
- the command line: the very command and environment that engine class builds (`vllm.entrypoints.openai.
  api_server ...`, `sglang.launch_server ...`), spawned bare and polled on /health every 0.1 s; timed from the
  spawn to the first answer. In-process vLLM has no command of its own: its command line is the vLLM server's
  with the same engine flags (engines/vllm.py engine_flags), which is what `vllm serve` would be given.

A machine's first start of an engine fills the compile caches every later start reuses (the engine-start split
of the committed studies shows it), so the job runs after its run, and each path's first start is kept apart from
the median.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from hybridrl.atomic import write_text
from hybridrl.engines import make_engine
from hybridrl.engines.server import ServerProcess, free_port
from hybridrl.study.run_config import RunConfig

POLL_S = 0.1
STOP_GRACE_S = 30.0


def order(repeats: int) -> list[str]:
    """The paths in the order they start: A B B A, then again (hybridrl, cli, cli, hybridrl, ...)."""
    return [("hybridrl", "cli", "cli", "hybridrl")[i % 4] for i in range(2 * repeats)]


def cli_engine(run: RunConfig, model_dir: Path, env_spec: dict[str, Any], log_dir: Path) -> Any:
    """The engine class whose command line the run's engine is held against: its own, or the vLLM server's for
    in-process vLLM (the same engine flags), in the Python path in-process vLLM was imported from (a server's
    environment otherwise drops the controller's PYTHONPATH for its own overlay)."""
    if run.engine != "vllm-inprocess":
        return make_engine(run, model_dir, env_spec, log_dir)
    env = dict(env_spec.get("env") or {})
    if os.environ.get("PYTHONPATH") and "PYTHONPATH" not in env:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return make_engine(run.model_copy(update={"engine": "vllm"}), model_dir, {**env_spec, "env": env}, log_dir)


def start_cli(cmd: list[str], env: dict[str, str], port: int, log_path: Path, timeout_s: float) -> float:
    """Spawn the command (as ServerProcess spawns an engine, no more), wait for its /health, stop its whole process
    group; the seconds from the spawn to the answer."""
    server = ServerProcess("the command line's engine", cmd, env, log_path, port)
    with httpx.Client(timeout=5.0) as client:
        t0 = time.perf_counter()
        server.start()
        try:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{server.base_url}/health").status_code == 200:
                        return time.perf_counter() - t0
                if not server.alive():
                    raise RuntimeError(f"{cmd[0]} ... exited with code {server.proc.returncode} before it answered; "
                                       f"see {log_path}")
                if time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError(f"the command line's engine did not answer within {timeout_s:.0f} s; see "
                                       f"{log_path}")
                time.sleep(POLL_S)
        finally:
            server.stop(STOP_GRACE_S)


def start_hybridrl(engine: Any) -> float:
    """The run's engine started as a run starts it, then stopped; the seconds the start took."""
    t0 = time.perf_counter()
    try:
        engine.start()
        return time.perf_counter() - t0
    finally:
        engine.stop()


def summary(starts: list[dict[str, Any]]) -> dict[str, Any]:
    """Each path's median start without its first (the cold one), and hybridrl's over the command line's."""
    out: dict[str, Any] = {}
    for path in ("hybridrl", "cli"):
        warm = [s["start_s"] for s in starts if s["path"] == path][1:]
        out[f"{path}_s_median"] = statistics.median(warm) if warm else None
    both = out["hybridrl_s_median"] is not None and out["cli_s_median"]
    out["over_cli"] = out["hybridrl_s_median"] / out["cli_s_median"] if both else None
    return out


def main(run_id: str, run: RunConfig, model_dir: Path, env_spec: dict[str, Any], out: Path, log_dir: Path,
         repeats: int, timeout_s: float) -> dict[str, Any]:
    """Both paths `repeats` times each, alternated; the result to `out` (JSON). A start that fails stops the
    rest: what was measured before it is kept in `<out stem>.partial.json`, with the error (the job's output would
    be removed as a failed job's)."""
    ours = make_engine(run, model_dir, env_spec, log_dir / "hybridrl")
    theirs = cli_engine(run, model_dir, env_spec, log_dir / "cli")
    starts: list[dict[str, Any]] = []
    report = {"run_id": run_id, "engine": run.engine, "cli_engine": theirs.name, "repeats": repeats,
              "starts": starts}
    try:
        for i, path in enumerate(order(repeats), 1):
            if path == "hybridrl":
                seconds = start_hybridrl(ours)
                cmd = None
            else:
                port = free_port()
                cmd = theirs.command(port, None)
                seconds = start_cli(cmd, theirs.environment(), port, log_dir / "cli" / "engine.log", timeout_s)
            starts.append({"i": i, "path": path, "start_s": seconds, **({"command": cmd} if cmd else {})})
            print(f"start-bench {run_id}: {path} start {i} of {2 * repeats}: {seconds:.1f} s", flush=True)
    except Exception as exc:  # the starts so far are kept, with what stopped the rest
        report["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        report.update(summary(starts))
        write_text(out.with_suffix(".partial.json") if "error" in report else out,
                   json.dumps(report, indent=1) + "\n")
    return report
