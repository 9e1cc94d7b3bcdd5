"""Conclusions written from intervals by fixed rules, and a check of hand-written text against the same rules.

The rules (README "Reading the intervals"):
- a difference is claimed only where the 95% interval excludes "no difference" (ratio 1, change 0%);
- an interval that includes it is reported as "could not be told apart", with the ratio these data had 80% power
  to detect (the minimum detectable effect: the interval's standard error on the log scale times 1.96 + 0.84);
- with one run on a side, a claim is limited to "in these runs": the interval holds step-to-step noise only;
- text never calls two arms alike ("equally fast", "same speed", "within noise") beside an interval that
  excludes no difference, and never ranks them ("faster", "slower", ...) from intervals that all include it;
- nor does it apportion a difference ("most of the gap", "mostly", "the gap is in ...") from an interval that
  includes none: such an interval says how much, if any, only up to its width.
"""

from __future__ import annotations

import math
import re

from hybridrl.report.stats import Estimate

SAME = re.compile(r"equally fast|same speed|within noise|no (?:throughput )?difference|could not be told apart|"
                  r"neither engine is faster|not differ", re.I)
RANK = re.compile(r"\b(?:faster|slower|favou?rs?|beats?|outperforms?|wins?|ahead)\b", re.I)
APPORTION = re.compile(r"\bmost(?:ly)?\b(?! \w+ than)|\bthe (?:gap|difference) (?:is|lies) (?:in|outside|within)\b",
                       re.I)
NEGATION = re.compile(r"\b(?:neither|nor|not|no|nothing|without)\b", re.I)
# "0.83x [0.74, 0.89]" and "+10% [-31%, +61%]" as the report and the READMEs write them
RATIO = re.compile(r"(\d+(?:\.\d+)?)x \[(\d+(?:\.\d+)?), (\d+(?:\.\d+)?)\]")
CHANGE = re.compile(r"([+-]?\d+(?:\.\d+)?)% \[([+-]?\d+(?:\.\d+)?)%, ([+-]?\d+(?:\.\d+)?)%\]")


Z_95 = 1.959964  # two-sided 95% interval
Z_POWER = 0.841621  # 80% power


def detectable(est: Estimate) -> float:
    """The ratio (> 1) a 95% interval of this width would tell from 1 four times in five (80% power), by the normal
    approximation on the log scale. The half-width alone, sqrt(hi / lo), is an effect found only half the time."""
    if not (est.lo > 0 and est.hi > 0 and math.isfinite(est.lo) and math.isfinite(est.hi)):
        return float("nan")
    se = math.log(est.hi / est.lo) / (2 * Z_95)
    return math.exp((Z_95 + Z_POWER) * se)


def basis(est: Estimate, n_a: tuple[int, int], n_b: tuple[int, int]) -> str:
    """'3 runs × 24 steps vs 3 runs × 24 steps': what each side rests on."""
    def side(n: tuple[int, int]) -> str:
        return f"{n[0]} run{'s' if n[0] != 1 else ''}, {n[1]} step{'s' if n[1] != 1 else ''}"
    return f"{side(n_a)} vs {side(n_b)}"


def ratio_text(est: Estimate) -> str:
    """'0.83x [0.74, 0.89]'; more digits where two would hide whether the interval excludes 1: both ends
    printed alike ([1.00, 1.00]), or an end that excludes 1 printed as 1.00."""
    def hidden(d: int) -> bool:
        lo, hi, one = f"{est.lo:.{d}f}", f"{est.hi:.{d}f}", f"{1:.{d}f}"
        return lo == hi or (est.excludes(1.0) and one in (lo, hi))

    digits = 2
    while digits < 4 and hidden(digits):
        digits += 1
    return f"{est.value:.{digits}f}x [{est.lo:.{digits}f}, {est.hi:.{digits}f}]"


def conclusion(what: str, a: str, b: str, est: Estimate, n_a: tuple[int, int], n_b: tuple[int, int],
               higher_is_better: bool = True, better: str = "faster", worse: str = "slower") -> str:
    """One sentence on `what` (a ratio a / b with its interval) by the rules above. n_a, n_b: (runs, steps)."""
    where = f"({basis(est, n_a, n_b)})"
    if not (math.isfinite(est.lo) and math.isfinite(est.hi)):
        return f"{what}: {no_interval(est, a, b)} {where}, so this ranks neither."
    if not est.excludes(1.0):
        return (f"{what}: {a} and {b} could not be told apart, {a} / {b} {ratio_text(est)} {where}; these data "
                f"had 80% power for a ratio of about {detectable(est):.2f}x either way, less for a smaller one.")
    ahead = (est.value > 1) == higher_is_better
    word = better if ahead else worse
    if min(n_a[0], n_b[0]) < 2:
        return (f"{what}: {a} was {word} than {b} in these runs, {a} / {b} {ratio_text(est)} {where}; one run "
                "on a side, so the interval holds step-to-step noise only, not run-to-run.")
    return f"{what}: {a} is {word} than {b}, {a} / {b} {ratio_text(est)} {where}."


def no_interval(est: Estimate, a: str, b: str) -> str:
    """A ratio without an interval, and why, in plain words: a bootstrap needs two values on each side."""
    if est.n == 0:
        return f"{a} / {b} has no value: a side has nothing to compare"
    if not math.isfinite(est.value):
        return f"{a} / {b} has no value: {b}'s median is zero"
    if est.n < 2:
        return f"{a} / {b} {est.value:.3g}x, with no interval: a single value on a side is too few for one"
    return f"{a} / {b} {est.value:.3g}x, with no interval"


def comparisons_note(n: int, level: float = 0.95) -> str:
    """How many intervals a reader is shown, and how many of them chance alone would put away from 1."""
    if n == 0:
        return "No comparisons with intervals were made."
    return (f"{n} comparison{'s' if n != 1 else ''} with {level:.0%} intervals: if no difference were real, about "
            f"{n * (1 - level):.1f} of them would still exclude it by chance; read a single excluding interval "
            "among many with that in mind (no correction applied).")


def _sentences(text: str) -> list[str]:
    """Sentences, never across a paragraph, a list item, a heading or a table row."""
    out = []
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[-*+] |#|\|))", text):
        flat = re.sub(r"\s+", " ", block).strip()
        out += [s for s in re.split(r"(?<=[.;!?])\s+(?=[A-Z*(])", flat) if s]
    return out


def _intervals(sentence: str) -> list[bool]:
    """For each interval in the sentence: does it exclude no difference?"""
    out = []
    for m in RATIO.finditer(sentence):
        lo, hi = float(m[2]), float(m[3])
        out.append(not lo <= 1.0 <= hi)
    for m in CHANGE.finditer(sentence):
        lo, hi = float(m[2]), float(m[3])
        out.append(not lo <= 0.0 <= hi)
    return out


def violations(text: str) -> list[str]:
    """Sentences of `text` that break the wording rules, each with the rule it breaks."""
    found = []
    for sentence in _sentences(text):
        excludes = _intervals(sentence)
        if not excludes:
            continue
        if any(excludes) and SAME.search(sentence):
            found.append(f"calls arms alike beside an interval that excludes no difference: {sentence}")
        # a ranking beside any interval that includes no difference, unless the sentence says which were not told
        # apart: "A and B were faster: 1.36x [1.14, 1.49] and 1.37x [0.96, 1.67]" ranks the second from nothing
        if not all(excludes) and RANK.search(sentence) and not NEGATION.search(sentence):
            found.append(f"ranks arms beside an interval that includes no difference: {sentence}")
        if not any(excludes) and APPORTION.search(sentence) and not NEGATION.search(sentence):
            found.append(f"apportions a difference from an interval that includes none: {sentence}")
    return found
