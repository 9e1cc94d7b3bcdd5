"""What a plan is: a study, the GPUs it needs, and phases of lanes; and the helpers plans are written with.

A plan's phases run one after the other. A phase's lanes run side by side, each on its own GPUs
(CUDA_VISIBLE_DEVICES; a run samples only those with NVML), its items one after the other. An item gets its lane's
GPUs unless it names its own. Order within a lane is priority: a lease that ends early keeps the runs that matter
most.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.tools.lease.items import Item, parse_item

DEFAULT_STUDY = "config/gpu-h200.yaml"


@dataclass(frozen=True)
class Lane:
    """Items one after the other on GPUS (a CUDA_VISIBLE_DEVICES value: "0", "0,1", "1,0")."""

    gpus: str
    items: tuple[Item, ...]


@dataclass(frozen=True)
class Plan:
    """A plan: `study` is a config under the repository; `env` is set for its items (and only for them)."""

    phases: tuple[tuple[Lane, ...], ...]
    study: str = DEFAULT_STUDY
    gpus: int = 2
    env: dict[str, str] = field(default_factory=dict)
    name: str = ""
    description: str = ""

    def phase_names(self) -> list[str]:
        """p1, p2, ...: the names the console and the start barriers' folders give the phases."""
        return [f"p{i}" for i in range(1, len(self.phases) + 1)]

    def items(self) -> list[Item]:
        return [it for phase in self.phases for lane in phase for it in lane.items]


def lane(gpus: str, *items: str | list[str]) -> Lane:
    """A lane on GPUS; each item is a plan's words ("train NAME", ...) or a list of them (interleave, tool_rounds)."""
    words = [w for it in items for w in ([it] if isinstance(it, str) else it)]
    return Lane(gpus, tuple(parse_item(w) for w in words))


def one_lane(*items: str | list[str], study: str = DEFAULT_STUDY, env: dict[str, str] | None = None) -> Plan:
    """A plan of one phase whose one lane holds GPU 0: one item at a time, nothing beside it, on a one-GPU lease."""
    return Plan(phases=((lane("0", *items),),), study=study, gpus=1, env=env or {})


def replica(arm: str, k: int) -> str:
    """The run name of replicate K of ARM (the first keeps the plain name, as the study's run ids do)."""
    return f"{arm}-r{k}" if k > 1 else arm


def interleave(rounds: int, *arms: str, balanced: bool = False) -> list[str]:
    """"train ARM" items round by round (A B C A B C ...), replicate k > 1 as ARM-rK, so that a slow drift of the
    host falls on every arm alike and a lease that ends early keeps whole rounds. balanced reverses every second
    round (A B, B A, A B ...), so that no arm is always the one run first (or right after the machine's start)."""
    return [f"train {replica(arm, k)}" for k in range(1, rounds + 1) for arm in in_round(k, arms, balanced)]


def tool_rounds(rounds: int, *items: str, balanced: bool = False) -> list[str]:
    """tbench/tprof items round by round (A B A B ...), each marked rK (replicate K), so that every configuration
    gets ROUNDS processes of its own and a drift of the host falls on all of them alike; balanced as interleave."""
    return [f"{item} r{k}" for k in range(1, rounds + 1) for item in in_round(k, items, balanced)]


def in_round(k: int, items: tuple[str, ...], balanced: bool) -> tuple[str, ...]:
    """The order of round k (from 1): as given, or with balanced reversed in every even round."""
    return items[::-1] if balanced and k % 2 == 0 else items
