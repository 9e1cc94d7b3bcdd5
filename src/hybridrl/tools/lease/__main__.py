"""python -m hybridrl.tools.lease COMMAND ...: the leased-GPU driver's plans, scheduler and items.

scripts/gpu/run_reference.sh calls this with the environment every process of a run inherits (its exports), so run
it through that script: `start PLAN...` (in the background), `all PLAN`, `plans PLAN...`, and the items by hand
(`train NAME [GPU]`, `bench NAME GPU STEP [ARGS]`, `fault NAME GPU KILL_STEP TERM_STEP`, `ceiling`,
`tbench|tprof SHAPE GPU TRAINER MICRO_BATCH [FLAG...]`, in the study HYBRIDRL_STUDY, default config/gpu-h200.yaml).
`list` prints the plans; `check PLAN...` refuses a plan before anything starts, as `start` does.
Studies live in HYBRIDRL_REF_DIR (default /tmp/ref); HYBRIDRL_DRY_RUN=1 prints what would run and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hybridrl.tools.lease.driver import Lease, Refused, check, run_plan, run_plans
from hybridrl.tools.lease.items import parse_item
from hybridrl.tools.lease.plan import DEFAULT_STUDY
from hybridrl.tools.lease.plans import known_plans
from hybridrl.tools.lease.runners import ItemFailed, run_item

ITEMS = ("train", "bench", "fault", "ceiling", "tbench", "tprof")


def _by_hand(lease: Lease, kind: str, args: list[str]) -> None:
    """One item outside a plan: the GPU is the second word (train: optional) instead of the lane's."""
    if kind == "train":
        text, gpus = " ".join(["train", *args[:1]]), (args[1] if len(args) > 1 else None)
    elif kind == "ceiling":
        text, gpus = "ceiling", None
    else:
        text, gpus = " ".join([kind, *args[:1], *args[2:]]), (args[1] if len(args) > 1 else None)
    try:
        item = parse_item(text)
    except ValueError as e:
        raise Refused(f"{kind} {' '.join(args)}: {e}", 2) from None
    site = lease.site(os.environ.get("HYBRIDRL_STUDY") or DEFAULT_STUDY)
    try:
        run_item(item, gpus, site, os.environ, sys.stdout)
    except ItemFailed:
        raise Refused(None, 1) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridrl.tools.lease", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[4],
                        help="the code's root (src/, scripts/, config/, .gpu/); default: this package's checkout")
    parser.add_argument("command", choices=("list", "check", "all", "plans", *ITEMS))
    parser.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args(argv)
    lease = Lease(a.repo.resolve(), Path(os.environ.get("HYBRIDRL_REF_DIR") or "/tmp/ref"),
                  dry_run=bool(os.environ.get("HYBRIDRL_DRY_RUN")))
    try:
        if a.command == "list":
            print(" ".join(known_plans()))
        elif a.command == "check":
            check(lease, a.args)
        elif a.command == "all":
            run_plan(lease, a.args[0] if a.args else "full")
        elif a.command == "plans":
            if not a.args:
                raise Refused(f"usage: plans PLAN [PLAN...] ({' '.join(known_plans())})", 2)
            run_plans(lease, a.args)
        else:
            _by_hand(lease, a.command, a.args)
    except Refused as e:
        if e.message:
            print(e.message, file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
