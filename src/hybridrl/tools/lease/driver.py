"""The scheduler: a plan's phases one after the other, their lanes side by side, a snapshot after every item; and
several plans one after the other, the studies not yet set up prepared meanwhile.

scripts/gpu/run_reference.sh starts this (`start`, in the background; `all`, `plans`); it keeps the transfer and
polling glue (pack, poll, status) and the environment every process of a run inherits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from hybridrl import nvml
from hybridrl.atomic import atomic_path
from hybridrl.tools.lease.items import Train, is_snapshot
from hybridrl.tools.lease.plan import Lane, Plan
from hybridrl.tools.lease.plans import BadPlanSetting, UnknownPlan, known_plans, load_plan
from hybridrl.tools.lease.runners import ItemFailed, Site, run_item, say


class Refused(Exception):
    """The driver stops with exit status `code`; `message`, if any, goes to stderr (one line)."""

    def __init__(self, message: str | None, code: int) -> None:
        super().__init__(message)
        self.message, self.code = message, code


@dataclass(frozen=True)
class Lease:
    """This machine's layout: the code (`repo`) and the studies' root (HYBRIDRL_REF_DIR)."""

    repo: Path
    root: Path
    dry_run: bool = False

    @property
    def script(self) -> Path:
        return self.repo / "scripts" / "gpu" / "run_reference.sh"

    def config(self, study: str) -> Path:
        """The study's config file; a relative one is under the repository."""
        path = Path(study) if study.startswith("/") else self.repo / study
        if not path.is_file():
            raise Refused(f"no study config {study} in {self.repo}", 2)
        return path

    def study_dir(self, study: str) -> Path:
        return self.root / Path(study).name.removesuffix(".yaml")

    def site(self, study: str) -> Site:
        self.config(study)
        return Site(self.repo, self.root, self.study_dir(study), self.dry_run)


def plan_named(name: str) -> Plan:
    try:
        return load_plan(name)
    except UnknownPlan:
        raise Refused(f"no plan named {name} ({' '.join(known_plans())})", 2) from None
    except BadPlanSetting as exc:
        raise Refused(f"plan {name}: {exc}", 2) from None


def runs_of(config: Path) -> list[str]:
    """The names a plan calls the study's runs by (cfg/<name>.json, as `prepare-study` writes them)."""
    from hybridrl.study.config import load_study
    from hybridrl.study.prepare_study import short_names

    return list(short_names(load_study(config)))  # which also refuses two runs of one name


def plan_models(lease: Lease, names: list[str]) -> dict[str, list[str]]:
    """{study: the models its runs in these plans use}: what `prepare` builds for them, in the study's order."""
    from hybridrl.study.config import load_study
    from hybridrl.study.prepare_study import models_of, short_names

    runs: dict[str, set[str]] = {}
    for name in names:
        plan = plan_named(name)
        runs.setdefault(plan.study, set()).update(
            it.text.split()[1] for it in plan.items() if it.text.split()[0] in ("train", "bench", "fault"))
    needed = {}
    for study, shorts in runs.items():
        config = load_study(lease.config(study))
        needed[study] = models_of(config, sorted(shorts & set(short_names(config))))  # check_names names the rest
    return needed


def missing_models(lease: Lease, study: str, models: list[str]) -> list[str]:
    """Those of the models not built in the study's folder (a dry run builds none and misses none)."""
    if lease.dry_run:
        return []
    return [m for m in models if not (lease.study_dir(study) / "models" / m / "config.json").is_file()]


def check_names(lease: Lease, plan: Plan) -> None:
    """Refuses, in one line, a plan whose train, bench or fault item names no run of its study, or that runs a
    source snapshot .gpu lacks: such an item would fail only when its turn came, after the runs before it."""
    config = lease.config(plan.study)
    try:
        names = runs_of(config)
    except Exception as e:  # any failure to list them is one line
        raise Refused(f"cannot list the runs of {plan.study} ({type(e).__name__}: {e}; run "
                      f"`{lease.script} controller` first?)", 2) from None
    bad = [it.text.split()[1] for it in plan.items()
           if it.text.split()[0] in ("train", "bench", "fault") and it.text.split()[1] not in names]
    if bad:
        raise Refused(f"plan {plan.name} names runs its study ({plan.study}) does not have: {' '.join(bad)} "
                      f"(it has: {' '.join(sorted(names))})", 2)
    missing = sorted({w for it in plan.items() for w in it.text.split() if is_snapshot(w)
                      and not (lease.repo / ".gpu" / w / "src" / "hybridrl" / "__init__.py").is_file()})
    if missing:
        raise Refused(f"plan {plan.name} runs source snapshots {lease.repo}/.gpu lacks: {' '.join(missing)} "
                      "(scripts/gpu/snapshot-src.sh REV, carried with the call)", 2)


class _PackFailed(Exception):
    """run_reference.sh pack failed (its stderr is in the lane's log): the last snapshot stays."""


def snapshot(lease: Lease, log: TextIO) -> None:
    """What finished, every study, as $root/latest.tar.gz (run_reference.sh pack), replaced atomically: lanes
    finish items at once, each packing to a file of its own first."""
    with contextlib.suppress(_PackFailed), atomic_path(lease.root / "latest.tar.gz") as tmp:
        done = subprocess.run(["bash", str(lease.script), "pack", str(tmp)], env={
            **os.environ, "HYBRIDRL_REF_DIR": str(lease.root)}, stdout=subprocess.DEVNULL, stderr=log, check=False)
        if done.returncode != 0:
            raise _PackFailed


def skipped(text: str, env: Mapping[str, str]) -> bool:
    """HYBRIDRL_SKIP="RUN RUN ...": items of these runs are left out, so that a lease can take the rest of a plan
    that an earlier lease began (for example `HYBRIDRL_SKIP=sglang-fault start faults soak`). Whole names only."""
    words = text.split()
    return len(words) >= 2 and words[1] in env.get("HYBRIDRL_SKIP", "").split()


def run_lane(lease: Lease, site: Site, lane: Lane, env: Mapping[str, str], log: TextIO) -> None:
    """The lane's items one after the other, a snapshot after each. Only the lane's first run meets the others at
    the start barrier; an item that cannot start stops the lane."""
    item_env = dict(env)
    for item in lane.items:
        if skipped(item.text, env):
            say(log, f"skipped: {item.text} (HYBRIDRL_SKIP)")
            continue
        try:
            run_item(item, lane.gpus, site, item_env, log)
        except ItemFailed:
            return
        except Exception:  # the lane's log says why it stopped; the other lanes go on
            traceback.print_exc(file=log)
            return
        if isinstance(item, Train):
            item_env.pop("HYBRIDRL_START_BARRIER", None)
        snapshot(lease, log)


def run_plan(lease: Lease, name: str, out: TextIO | None = None) -> None:
    """One plan: its phases one after the other, each phase's lanes side by side (a thread each), every lane's log
    in the study's folder as lane-PLAN-N.log; all.done at the end."""
    out = out or sys.stdout
    plan = plan_named(name)
    check_names(lease, plan)
    site = lease.site(plan.study)
    if not (site.ref / "setup.done").exists():
        raise Refused(f"run setup first ({site.ref}/setup.done is missing): `{lease.script} setup WHEELS_DIR "
                      f"{plan.study}` builds its data and models; a dry run checks only that the marker is there "
                      "(docs/gpu.md)", 1)
    missing = missing_models(lease, plan.study, plan_models(lease, [name]).get(plan.study, []))
    if missing:
        raise Refused(f"plan {name} needs models its study's folder lacks ({' '.join(missing)} under "
                      f"{site.ref}/models): `{lease.script} prepare {plan.study}` builds them", 1)
    if not lease.dry_run and (have := nvml.device_count()) < plan.gpus:
        raise Refused(f"plan {name} needs {plan.gpus} GPUs, this machine has {have}", 2)
    env = {**os.environ, **plan.env}
    say(out, f"study start (plan {name}, {plan.study})")
    n = 0
    for phase, lanes in zip(plan.phase_names(), plan.phases, strict=True):
        # the lanes' first runs start their steps together, once all are up: a run's start (weights, compile,
        # conversion) slows the steps of runs beside it (results/reference/2026-11-22-4xh200-moe)
        parties = sum(bool(lane.items) and isinstance(lane.items[0], Train) for lane in lanes)
        barrier = site.ref / "barrier" / f"{name}-{phase}"
        _fresh_dir(barrier)
        lane_env = dict(env)
        if parties > 1:
            say(out, f"{phase}: start barrier of {parties} runs ({barrier})")
            lane_env["HYBRIDRL_START_BARRIER"] = f"{barrier}:{parties}"
        threads = []
        for lane in lanes:
            n += 1
            say(out, f"lane {n}: {lane.gpus}")
            log = site.ref / f"lane-{name}-{n}.log"
            thread = threading.Thread(target=_lane_thread, args=(lease, site, lane, lane_env, log), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        say(out, f"{phase} done")
    say(out, "study done")
    (site.ref / "all.done").touch()


def _lane_thread(lease: Lease, site: Site, lane: Lane, env: Mapping[str, str], log_path: Path) -> None:
    with open(log_path, "w", buffering=1) as log:  # line by line: `status` tails it while the lane runs
        run_lane(lease, site, lane, env, log)


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def wait_for_envs(out: TextIO, env: Mapping[str, str] = os.environ) -> None:
    """With HYBRIDRL_ENVS_READY=FILE, `start` may come before the engine overlays are installed: the studies are
    prepared (the 48-layer model takes minutes) while the overlays travel, and the runs wait for FILE, which the
    lease's last transfer call touches after `gpu-env install`; HYBRIDRL_ENVS_WAIT_S at most. The default, 600 s, is
    four times what 16 transfers and the install took on 2026-11-23 (2.4 min): a lease whose transfers were refused
    then gives up after 10 minutes, not 20, and its polls return at once with the rest of the budget."""
    ready = env.get("HYBRIDRL_ENVS_READY")
    if not ready:
        return
    limit = int(env.get("HYBRIDRL_ENVS_WAIT_S") or 600)
    if not os.path.exists(ready):
        say(out, f"waiting for the engine overlays ({ready})")
    waited = 0
    while not os.path.exists(ready):
        if waited >= limit:
            say(out, f"no {ready} after {limit} s: the engine overlays were never installed")
            raise Refused(None, 1)
        time.sleep(1)
        waited += 1


def run_plans(lease: Lease, names: list[str], out: TextIO | None = None) -> None:
    """The plans one after the other; studies not yet set up are prepared meanwhile, in the background."""
    out = out or sys.stdout
    studies = [plan_named(name).study for name in names]
    needed = plan_models(lease, names)  # only these: a model no queued run uses would cost lease time
    preps: list[subprocess.Popen] = []
    started: set[str] = set()
    for study in studies:
        # once per study, even where several plans share it; again where a later plan needs a model not built
        ready = (lease.study_dir(study) / "setup.done").exists() and not missing_models(
            lease, study, needed.get(study, []))
        if ready or study in started:
            continue
        started.add(study)
        # few threads: runs being measured share this host's CPUs with the model build
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("HYBRIDRL_PREP_THREADS") or "8",
               "HYBRIDRL_REF_DIR": str(lease.root), "HYBRIDRL_PREP_MODELS": " ".join(needed.get(study, []))}
        log = lease.root / f"prepare-{lease.study_dir(study).name}.log"
        with open(log, "wb") as f:
            preps.append(subprocess.Popen(["bash", str(lease.script), "prepare", study], env=env, stdout=f,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    wait_for_envs(out)
    for name, study in zip(names, studies, strict=True):
        # a study being prepared is waited for (its log says why, if it fails)
        if study in started:
            for prep in preps:
                prep.wait()
        try:
            run_plan(lease, name, out)
        except Refused as e:
            if e.message:
                print(e.message, file=sys.stderr, flush=True)
            say(out, f"plan {name} stopped (exit {e.code})")
        except Exception:  # the next plan still runs, as it did when each plan was a subshell
            traceback.print_exc()
            say(out, f"plan {name} stopped (exit 1)")
    say(out, f"plans done: {' '.join(names)}")


def check(lease: Lease, names: list[str]) -> None:
    """What `start` checks before it starts anything: every plan exists and names only runs its study has."""
    for name in names:
        check_names(lease, plan_named(name))

