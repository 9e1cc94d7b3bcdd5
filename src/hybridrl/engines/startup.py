"""An engine's start split into its parts, from the engine's own log and the controller's instants.

The parts, in the order an engine goes through them:

    import         the process's start to the engine's first step of the load: interpreter, imports, worker
                   processes, distributed init
    weights        loading the model's weights
    kv             sizing and allocating the KV cache (vLLM: its profiling run, which sizes it, and its profiling of
                   the CUDA graphs' memory, which the KV cache's size leaves room for)
    sampler        vLLM's sampler warm-up after the profiling run, where FlashInfer builds its sampling kernels on a
                   machine's first start: about 2 minutes then, seconds once its workspace holds them
    graphs         CUDA graph capture, and vLLM's torch.compile, and SGLang's set-up of its graph runner before
                   the capture
    warmup         vLLM's kernel warm-up after the capture (its V2 model runner runs a prefill and a decode step to
                   JIT-compile its Triton kernels, LoRA's among them): about 2 minutes the first time on a machine,
                   seconds once Triton's cache holds them
    ready          the engine's "initialised" line to the controller finding it ready (the health check passing;
                   in process, the engine's constructor returning)
    first_request  the controller's warm-up request after that (in process, and the adapter's load before it)

and `unexplained`: the start's whole time less the parts found. Time between the parts that no line accounts for
lands there, and so does a part whose marker the log lacks: such a part is None, never a number made up.

Each part is one or more spans of the log: from a line that begins it to a line that ends it, or a line that
states the part's seconds itself (finer than the logs' one-second timestamps). Where several ranks (tensor
parallel) log the same line, a span runs from the first begin to the last end, and a stated time is the slowest
rank's; a span that hands over to the next part's at such a line ends at its first rank's, where the next begins,
so that the two share no second. Each engine's lines are in MARKERS: a new engine version that words a line
otherwise is one edit there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

PARTS = ("import", "weights", "kv", "sampler", "graphs", "warmup", "ready", "first_request")
UNEXPLAINED = "unexplained"
TOTAL = "total"  # the start's whole seconds, as the controller timed it

SPAWN = "<spawn>"  # a span's begin: the instant the controller started the engine's process
HEALTHY = "<healthy>"  # a span's end: the instant the controller found the engine ready

# The header the controller writes into an engine's log before each start (server.ServerProcess): the start's
# instant, to the second, in local time like the engines' own stamps
HEADER = re.compile(r"^==== (?P<t>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) .*$\n?", re.M)
HEADER_FORMAT = "%Y-%m-%d %H:%M:%S"


@dataclass(frozen=True)
class Span:
    begin: str | None  # the line that begins it (a regex), SPAWN, or None where the end line states the seconds
    end: str  # the line that ends it (a regex; a group `s` holds the seconds it states), or HEALTHY
    fallback: str | None = None  # for HEALTHY: the engine's own line for it, where the controller's is not known
    optional: bool = False  # a log without its lines (an older engine's) leaves the part to its other spans
    first_end: bool = False  # ends at the first rank's end line: the next part's span begins there


@dataclass(frozen=True)
class Markers:
    stamp: str  # a line's timestamp (a regex with a group `t`)
    stamp_format: str  # strptime's format of `t`; without %Y, the year is the start's
    parts: dict[str, tuple[Span, ...]]


_VLLM = Markers(
    stamp=r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<t>\d\d-\d\d \d\d:\d\d:\d\d) ",
    stamp_format="%m-%d %H:%M:%S",
    parts={
        "import": (Span(SPAWN, r"Loading model from scratch|Starting to load model"),),
        "weights": (Span(None, r"Model loading took .* and (?P<s>[\d.]+) seconds"),),
        # the profiling run measures the activations' peak, which sets what is left for the KV cache; so does the
        # graphs' memory, profiled next (a line older vLLM lacks: then the time to the size is left unexplained)
        "kv": (Span(None, r"Initial profiling/warmup run took (?P<s>[\d.]+) s"),
               Span(r"Profiling CUDA graph memory", r"GPU KV cache size", optional=True)),
        # between the two profilings the sampler is warmed up: FlashInfer's sampling kernels, built on a machine's
        # first start
        "sampler": (Span(r"Initial profiling/warmup run took", r"Profiling CUDA graph memory", first_end=True),),
        "graphs": (Span(None, r"torch\.compile took (?P<s>[\d.]+) s in total"),
                   Span(None, r"Graph capturing finished in (?P<s>[\d.]+) secs")),
        # vllm/v1/worker/gpu_worker.py (0.26): the memory line ends the capture; warmup_kernels, then the monitor
        "warmup": (Span(r"Free memory on device", r"Kernel JIT monitor activated"),),
        "ready": (Span(r"init engine \(.*\) took", HEALTHY),),
    },
)

MARKERS: dict[str, Markers] = {
    "sglang": Markers(
        stamp=r"\[(?P<t>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]]*\]",
        stamp_format="%Y-%m-%d %H:%M:%S",
        parts={
            "import": (Span(SPAWN, r"Load weight begin"),),
            "weights": (Span(None, r"Load weight end\. elapsed=(?P<s>[\d.]+) s"),),
            # no line opens the memory pool: it is set up, the LoRA buffers with it, after the weights
            "kv": (Span(r"Load weight end", r"Memory pool end"),),
            # before the capture, the graph runner is set up: at TP > 1 its FlashInfer all-reduce fusion workspace,
            # whose kernels FlashInfer builds on a machine's first start (204 s at TP 2 on an H200)
            "graphs": (Span(r"Memory pool end", r"Capture .*(?i:cuda) graph begin", optional=True),
                       Span(None, r"Capture .*(?i:cuda) graph end\. elapsed=(?P<s>[\d.]+) s")),
            # the server answers 503 to the health check until its own warm-up request is done
            "ready": (Span(r"Uvicorn running on", HEALTHY, fallback=r"The server is fired up"),),
        },
    ),
    "vllm": _VLLM,
    "vllm-inprocess": _VLLM,  # the same engine core, its log on the controller's own output
}


@dataclass(frozen=True)
class Line:
    at: datetime | None
    text: str


def split_start(log: str, engine: str, spawned: datetime | None = None, healthy: datetime | None = None,
                total_s: float | None = None, first_request_s: float | None = None) -> dict[str, float | None]:
    """The start's parts in seconds (PARTS, UNEXPLAINED, TOTAL) from the log of that one start (its text from the
    start on) and the controller's instants: the process's start, the engine found ready, the whole start's
    seconds and the warm-up request's. An unknown instant, or an engine without MARKERS, leaves the parts that
    need it None."""
    out: dict[str, float | None] = dict.fromkeys(PARTS[:-1])
    markers = MARKERS.get(engine)
    if markers is not None:
        out.update(log_parts(parse_lines(log, markers, spawned or healthy), markers,
                             {SPAWN: _second(spawned), HEALTHY: _second(healthy)}))
    out["first_request"] = first_request_s
    found = [v for v in out.values() if v is not None]
    out[UNEXPLAINED] = None if total_s is None else _unexplained(total_s - sum(found), len(found))
    out[TOTAL] = total_s
    return out


def _unexplained(rest: float, parts: int) -> float:
    """The start's time no part accounts for. Parts read from one-second stamps may each be up to a second long,
    so their sum can pass the whole by that much: such a rest is 0, and a larger shortfall (a marker matched in
    the wrong place) stays negative, to be seen."""
    return 0.0 if -float(parts) <= rest < 0 else rest


def log_parts(lines: list[Line], markers: Markers, instants: dict[str, datetime | None]) -> dict[str, float | None]:
    """Each part the log marks: the sum of its spans, None where any of them is missing."""
    init, after = _at_ready(lines, markers.parts["ready"][0].begin)
    out = {}
    for part, spans in markers.parts.items():
        seconds = [_span(span, after if part == "ready" else init, instants) for span in spans]
        seconds = [0.0 if s is None and span.optional else s for s, span in zip(seconds, spans, strict=True)]
        out[part] = None if None in seconds else sum(s for s in seconds if s is not None)
    return out


def combine(splits: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Several starts' parts summed, part by part; a part any of them lacks is None (an empty list: all None)."""
    keys = (*PARTS, UNEXPLAINED, TOTAL)
    if not splits:
        return dict.fromkeys(keys)
    return {k: None if any(s.get(k) is None for s in splits) else sum(s[k] for s in splits)  # type: ignore[misc]
            for k in keys}


def parse_lines(log: str, markers: Markers, reference: datetime | None) -> list[Line]:
    """Every line of the log with its timestamp (None where it has none)."""
    stamp = re.compile(markers.stamp)
    year = reference.year if reference else 2000  # any leap year reads 02-29; only differences are used
    out = []
    for text in log.splitlines():
        found = list(stamp.finditer(text))
        at = _parse(found[-1]["t"], markers.stamp_format, year, reference) if found else None
        out.append(Line(at, text))
    return out


def _parse(text: str, fmt: str, year: int, reference: datetime | None) -> datetime | None:
    try:
        if "%Y" in fmt:
            return datetime.strptime(text, fmt)
        at = datetime.strptime(f"{year} {text}", f"%Y {fmt}")
    except ValueError:
        return None
    # a start just before New Year whose lines come after it
    if reference is not None and at < reference - timedelta(days=180):
        at = at.replace(year=year + 1)
    return at


def _second(at: datetime | None) -> datetime | None:
    """An instant to the whole second, as the logs stamp their lines: a span between it and a line's stamp is then
    never negative from the rounding alone."""
    return at.replace(microsecond=0) if at else None


def _at_ready(lines: list[Line], ready: str | None) -> tuple[list[Line], list[Line]]:
    """The start's lines up to the engine's "initialised" line, and from it on: the load's markers are looked for
    before it only (a runtime line cannot pass for one), the ready span's after it. No such line: all of them,
    both ways."""
    if ready is None:
        return lines, lines
    pattern = re.compile(ready)
    for i, line in enumerate(lines):
        if pattern.search(line.text):
            return lines[:i + 1], lines[i:]
    return lines, lines


def _span(span: Span, lines: list[Line], instants: dict[str, datetime | None]) -> float | None:
    """One span's seconds, or None where a line or an instant it needs is missing."""
    if span.begin is None:  # the end line states the seconds
        regex = re.compile(span.end)
        stated = [float(m["s"]) for line in lines if (m := regex.search(line.text))]
        return max(stated) if stated else None
    begin_at = instants[span.begin] if span.begin in instants else _first(lines, span.begin)
    end_at = (instants[span.end] if span.end in instants
              else (_first if span.first_end else _last)(lines, span.end))
    if end_at is None and span.fallback:
        end_at = _first(lines, span.fallback)
    if begin_at is None or end_at is None or end_at < begin_at:
        return None
    return (end_at - begin_at).total_seconds()


def _first(lines: list[Line], pattern: str) -> datetime | None:
    """The stamp of the first stamped line that matches."""
    regex = re.compile(pattern)
    return next((line.at for line in lines if line.at and regex.search(line.text)), None)


def _last(lines: list[Line], pattern: str) -> datetime | None:
    """The stamp of the last stamped line that matches: the slowest rank's, where every rank logs it."""
    regex = re.compile(pattern)
    return next((line.at for line in reversed(lines) if line.at and regex.search(line.text)), None)


def starts(log: str) -> list[tuple[datetime, str]]:
    """A log that every start appends to (server engines'), cut at the controller's headers: each start's instant
    (to the second) and its text. Text before the first header (a log cut short at its head) belongs to no start."""
    heads = list(HEADER.finditer(log))
    return [(datetime.strptime(h["t"], HEADER_FORMAT), log[h.end():nxt.start() if nxt else len(log)])
            for h, nxt in zip(heads, [*heads[1:], None], strict=True)]


def header(command: str, at: datetime) -> str:
    """The line the controller writes into an engine's log before a start."""
    return f"\n==== {at.strftime(HEADER_FORMAT)} {command}\n"
