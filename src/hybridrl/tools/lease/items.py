"""A plan's items: what one step of a lane runs, parsed from the words a plan writes ("train NAME [GPUS]", ...).

Plans keep the words (they read like the runbook and the dry run); parsing them when the plan loads refuses a
malformed item before anything runs, where bash found it only when its turn came.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """One item; `text` is its words as the plan wrote them (HYBRIDRL_SKIP and the skip line name it by them)."""

    text: str

    @property
    def run(self) -> str | None:
        """The word HYBRIDRL_SKIP matches: the item's second (its run, or a trainer tool's shape)."""
        words = self.text.split()
        return words[1] if len(words) >= 2 else None


@dataclass(frozen=True)
class Train(Item):
    """train NAME [GPUS]: one run of the study; GPUS, where given, instead of the lane's."""

    name: str
    gpus: str | None = None


@dataclass(frozen=True)
class Bench(Item):
    """bench NAME STEP [ARGS]: the engine alone on step STEP's request set of that run, plus raw HTTP probes;
    ARGS pass on to `python -m hybridrl bench`."""

    name: str
    step: int
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fault(Item):
    """fault NAME KILL_STEP TERM_STEP: one run through `hybridrl fault-run` (engine SIGKILL in KILL_STEP's rollout,
    SIGTERM in TERM_STEP's training, then started again); its judgement in bench/fault-NAME.json."""

    name: str
    kill_at: int
    term_at: int


@dataclass(frozen=True)
class Ceiling(Item):
    """ceiling: the rollout client's ceiling on this host (python -m hybridrl client-ceiling), nothing else running."""


@dataclass(frozen=True)
class TrainerTool(Item):
    """tbench|tprof SHAPE TRAINER MICRO_BATCH [FLAG...]: `python -m hybridrl trainer-bench` (tbench) or
    `trainer-profile` (tprof), one trainer in a process of its own. FLAGs (no-pack, varied, peft-lora, ...) pass on
    as --FLAG, KEY=VALUE ones (vocab=151936) as --KEY=VALUE; rK marks replicate K (its own process and file, not
    passed on); src-REV runs hybridrl's source as of commit REV (.gpu/src-REV, made by scripts/gpu/snapshot-src.sh)
    instead of the tree's. All name the result (KEY=VALUE as KEY-VALUE: no '=' in a file name a lease returns)."""

    command: str  # trainer-bench | trainer-profile
    shape: str
    trainer: str
    micro_batch: int
    flags: tuple[str, ...] = ()

    @property
    def prefix(self) -> str:
        return "trainer" if self.command == "trainer-bench" else "profile"

    @property
    def ext(self) -> str:
        return "json" if self.command == "trainer-bench" else "txt"

    @property
    def result_name(self) -> str:
        """bench/<this>.json|txt: trainer-SHAPE-TRAINER-mbN[-FLAG...] (profile-... for tprof)."""
        flags = (f.replace("=", "-") for f in self.flags)
        return "-".join([f"{self.prefix}-{self.shape}-{self.trainer}-mb{self.micro_batch}", *flags])

    @property
    def snapshots(self) -> tuple[str, ...]:
        """The src-REV flags: source snapshots this item runs."""
        return tuple(f for f in self.flags if is_snapshot(f))

    @property
    def passed_flags(self) -> tuple[str, ...]:
        """The flags passed on as --FLAG (replicate marks and source snapshots only name the result)."""
        return tuple(f"--{f}" for f in self.flags if not is_snapshot(f) and not is_replicate(f))


def is_snapshot(word: str) -> bool:
    return word.startswith("src-") and len(word) > 4


def is_replicate(word: str) -> bool:
    return len(word) > 1 and word[0] == "r" and word[1:].isdigit()


TOOLS = {"tbench": "trainer-bench", "tprof": "trainer-profile"}


def parse_item(text: str) -> Item:
    """The typed item of a plan's words; ValueError names what is wrong with them."""
    words = text.split()
    kind, rest = (words[0], words[1:]) if words else ("", [])
    try:
        if kind == "train" and len(rest) in (1, 2):
            return Train(text, rest[0], rest[1] if len(rest) == 2 else None)
        if kind == "bench" and len(rest) >= 2:
            return Bench(text, rest[0], int(rest[1]), tuple(rest[2:]))
        if kind == "fault" and len(rest) == 3:
            return Fault(text, rest[0], int(rest[1]), int(rest[2]))
        if kind == "ceiling" and not rest:
            return Ceiling(text)
        if kind in TOOLS and len(rest) >= 3:
            return TrainerTool(text, TOOLS[kind], rest[0], rest[1], int(rest[2]), tuple(rest[3:]))
    except ValueError:
        pass
    raise ValueError(f"not a plan item: {text!r} (train NAME [GPUS], bench NAME STEP [ARGS], fault NAME KILL_STEP "
                     "TERM_STEP, ceiling, tbench|tprof SHAPE TRAINER MICRO_BATCH [FLAG...])")
