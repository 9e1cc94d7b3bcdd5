"""GSM8K: download once with a checksum, or synthesise GSM8K-format problems offline; the reward (its answer
parsing is hybridrl.task.answer)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

from hybridrl import jsonl
from hybridrl.atomic import atomic_path, write_text

# extract_answer is read from here by callers and tests; the rule lives in answer.py
from hybridrl.task.answer import answer_value, format_number
from hybridrl.task.answer import extract_answer as extract_answer

GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"
# sha256 of the upstream files; a mismatch means a corrupt or changed download.
GSM8K_SHA256 = {
    "train": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "test": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
}
GSM8K_ROWS = {"train": 7473, "test": 1319}
# Another location of the same files (a mirror), as a template with {split}; the checksums still hold.
GSM8K_URL_ENV = "HYBRIDRL_GSM8K_URL"
# Seconds the connect, and each read, may wait.
DOWNLOAD_TIMEOUT_S = 60.0


def write_jsonl_atomic(path: Path, rows: Iterable[dict]) -> None:
    write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


class DataError(RuntimeError):
    """A data split that cannot be used (a torn or non-JSON line, no problems at all) or a split that would be
    written empty; the message names the file (and line) or the argument."""


def read_jsonl(path: Path) -> list[dict]:
    """The problems of a split, one JSON object a line (blank lines skipped). A line that is not a JSON object
    (a crash cut it, or the file is not a split) and a split with no problems at all raise DataError naming the
    file and line: a run must not build its trainer and start an engine on data it cannot use."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); not a data split") from None
    rows = jsonl.objects(text, path, "problem record", DataError)
    if not rows:
        raise DataError(f"{path}: holds no problems (an empty split); write it again with python -m hybridrl data")
    # objects() keeps every non-blank line or raises, so the i-th row sits on the i-th non-blank line
    lines = [n for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    check_problems(rows, [f"{path}:{n}" for n in lines], path)
    return rows


def check_problems(rows: list[dict], places: list[str], path: Path) -> None:
    """A problem without a question or an answer text stops the run here, naming its FILE:LINE, not with a KeyError
    once the engine is up; answers that hold no number are let through with one warning: every completion of
    theirs scores 0, so a split full of them trains on the format reward alone."""
    for row, place in zip(rows, places, strict=True):
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str):
                got = "missing" if key not in row else f"{json.dumps(row[key])[:40]}, not text"
                raise DataError(f"{place}: problem record has no {key!r} text ({got}; keys: "
                                f"{', '.join(map(str, row)) or 'none'})")
    numberless = [place for row, place in zip(rows, places, strict=True) if answer_value(row["answer"]) is None]
    if numberless:
        warnings.warn(f"{path}: {len(numberless)} of {len(rows)} answers hold no number (first at "
                      f"{numberless[0]}): no completion can be right on those problems", stacklevel=2)


def step_problems(n_problems: int, seed: int, step: int, prompts_per_step: int) -> list[int]:
    """The indices of the problems step `step` of a run asks, the same for every engine: they depend only on
    (seed, step)."""
    rng = random.Random(seed * 1_000_003 + step)
    return rng.sample(range(n_problems), min(prompts_per_step, n_problems))


def reward(completion: str, reference_answer: str) -> float:
    """1.0 when the completion's final number equals the reference's exactly, else 0.0."""
    expected = answer_value(reference_answer)
    return float(expected is not None and answer_value(completion) == expected)


def shaped_reward(completion: str, reference_answer: str, format_bonus: float = 0.0) -> float:
    """1.0 for a correct answer; up to `format_bonus` for a parseable wrong one, more the closer it is.

    The bonus gives an untrained (e.g. random-init) policy a reward that varies within a group,
    so GRPO's advantages, and hence the LoRA update, are not all zero. A flat bonus is not enough:
    a random policy writes some number in nearly every long completion (on the GPU study's
    tokenizer 42% of tokens hold a digit), so every member of a group would get the same reward.
    """
    return _shaped(answer_value(completion), answer_value(reference_answer), format_bonus)


def scores(completion: str, reference_answer: str, format_bonus: float = 0.0) -> tuple[float, float]:
    """(reward, shaped_reward) from one scan of each text: the loop's two figures for a completion, where calling
    both scanned the completion twice (a step's 128 completions of 256 tokens: tens of ms on the rollout's path)."""
    got, expected = answer_value(completion), answer_value(reference_answer)
    return float(expected is not None and got == expected), _shaped(got, expected, format_bonus)


def _shaped(got: Fraction | None, expected: Fraction | None, format_bonus: float) -> float:
    if got is None:
        return 0.0
    if expected is None:
        return format_bonus
    if got == expected:
        return 1.0
    distance = abs(got - expected) / max(abs(expected), 1)
    return format_bonus / (1.0 + float(min(distance, Fraction(10**6))))


def completion_texts(tokenizer: Any, completions: list[list[int]]) -> list[str]:
    """Each completion's text for the reward, special tokens dropped: as tokenizer.decode gives it one by one, in
    one batch where the tokenizer is a fast one that cleans up no spaces (its Rust backend decodes a batch on all
    cores; one by one, a step's 128 x 256 tokens took 15 ms of a core)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode_batch(completions, skip_special_tokens=True)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in completions]


def prompt_text(question: str) -> str:
    return f"Question: {question}\nAnswer:"


# --- synthetic GSM8K-format problems -------------------------------------------------------------

_NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jude", "Kofi", "Lena"]
_ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells"]


def _problem(rng: random.Random) -> dict:
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    kind = rng.randrange(4)
    a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 9)
    if kind == 0:
        q = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?"
        ans = a + b
        work = f"{name} has {a} + {b} = <<{a}+{b}={ans}>>{ans} {item}."
    elif kind == 1:
        q = f"{name} buys {c} boxes of {item} with {b} {item} in each box. How many {item} is that?"
        ans = c * b
        work = f"{c} boxes hold {c} * {b} = <<{c}*{b}={ans}>>{ans} {item}."
    elif kind == 2:
        total = a + b
        q = f"{name} had {total} {item} and gave {b} to {other}. How many {item} are left?"
        ans = a
        work = f"{total} - {b} = <<{total}-{b}={ans}>>{ans} {item} are left."
    else:
        price = rng.randint(2, 40) * 25  # cents, so some answers are decimals
        q = f"One pack of {item} costs ${price / 100:.2f}. How much do {c} packs cost in dollars?"
        ans = Decimal(price * c) / 100
        work = f"{c} packs cost {c} * {price / 100:.2f} = <<{c}*{price / 100:.2f}={ans}>>{ans} dollars."
    return {"question": q, "answer": f"{work}\n#### {format_number(Fraction(ans))}"}


def _multi_step(rng: random.Random, steps: int) -> dict:
    """A problem of `steps` (2 or 3) operations on numbers up to about 1,000, worked out step by step."""
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b, c = rng.randint(20, 600), rng.randint(10, 300), rng.randint(2, 12)
    kind = rng.randrange(2)
    if steps == 2 and kind == 0:
        q = (f"{name} has {a} {item}. {name} buys {c} boxes of {item} with {b} {item} in each box. "
             f"How many {item} does {name} have now?")
        bought = c * b
        ans = a + bought
        work = f"The boxes hold {c} * {b} = <<{c}*{b}={bought}>>{bought} {item}.\n" \
               f"{name} has {a} + {bought} = <<{a}+{bought}={ans}>>{ans} {item}."
    elif steps == 2:
        each = rng.randint(5, 90)
        total = c * each + b
        q = (f"{name} had {total} {item} and gave {b} to {other}. {name} shares the rest equally among {c} "
             f"friends. How many {item} does each friend get?")
        rest = total - b
        ans = each
        work = f"{name} has {total} - {b} = <<{total}-{b}={rest}>>{rest} {item} left.\n" \
               f"Each friend gets {rest} / {c} = <<{rest}/{c}={ans}>>{ans} {item}."
    elif kind == 0:
        g = rng.randint(1, 2 * a + b - 1)
        q = (f"{name} has {a} {item} and {other} has {b} more {item} than {name}. Together they give away {g} "
             f"{item}. How many {item} do they have left?")
        theirs = a + b
        both = a + theirs
        ans = both - g
        work = f"{other} has {a} + {b} = <<{a}+{b}={theirs}>>{theirs} {item}.\n" \
               f"Together they have {a} + {theirs} = <<{a}+{theirs}={both}>>{both} {item}.\n" \
               f"They have {both} - {g} = <<{both}-{g}={ans}>>{ans} {item} left."
    else:
        price = rng.randint(4, 80) * 25  # cents, so some answers are decimals
        cost = Decimal(price * c) / 100
        extra = rng.randint(1, 9)
        spent = cost + extra
        bill = (int(spent) // 10 + 1 + rng.randint(0, 4)) * 10
        q = (f"One pack of {item} costs ${price / 100:.2f}. {name} buys {c} packs and a ${extra} bag, and pays with "
             f"${bill}. How much change does {name} get in dollars?")
        ans = bill - spent
        work = f"The packs cost {c} * {price / 100:.2f} = <<{c}*{price / 100:.2f}={cost}>>{cost} dollars.\n" \
               f"With the bag that is {cost} + {extra} = <<{cost}+{extra}={spent}>>{spent} dollars.\n" \
               f"The change is {bill} - {spent} = <<{bill}-{spent}={ans}>>{ans} dollars."
    return {"question": q, "answer": f"{work}\n#### {format_number(Fraction(ans))}"}


def synthesize(n: int, seed: int, steps: int = 1) -> list[dict]:
    """`steps` 1: one-operation problems on small numbers; 2 or 3: problems of two up to `steps` operations on
    larger numbers, which a small model learns more slowly, so RL has something left to improve."""
    rng = random.Random(seed)
    if steps == 1:
        return [_problem(rng) for _ in range(n)]
    return [_multi_step(rng, rng.randint(2, steps)) for _ in range(n)]


def write_synthetic(out_dir: Path, n_train: int, n_test: int, seed: int, steps: int = 1) -> None:
    # checked before either split is written: an empty split fails every run that reads it, much later
    for flag, n in (("--n-train", n_train), ("--n-test", n_test)):
        if n < 1:
            raise DataError(f"{flag} must be at least 1, got {n}: the {flag[4:]} split would be empty")
    write_jsonl_atomic(out_dir / "train.jsonl", synthesize(n_train, seed, steps))
    write_jsonl_atomic(out_dir / "test.jsonl", synthesize(n_test, seed + 1, steps))


# --- GSM8K download ------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch(url: str, target: str, timeout_s: float) -> None:
    """Copy url to target. The timeout bounds the connect and every read, so a network that drops
    packets fails the download instead of hanging it (urlretrieve has no timeout at all)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response, open(target, "wb") as out:
        shutil.copyfileobj(response, out, 1 << 20)


def download_gsm8k(out_dir: Path, url_template: str | None = None, timeout_s: float = DOWNLOAD_TIMEOUT_S) -> None:
    """Fetch both splits once; keep a file only when its checksum and row count match."""
    url_template = url_template or os.environ.get(GSM8K_URL_ENV) or GSM8K_URL
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, digest in GSM8K_SHA256.items():
        target = out_dir / f"{split}.jsonl"
        if target.exists() and _sha256(target) == digest:
            continue
        url = url_template.format(split=split)
        with atomic_path(target) as tmp:  # a file that fails a check below never takes the name
            try:
                _fetch(url, str(tmp), timeout_s)
            except (OSError, ValueError) as exc:  # URLError, a timeout, HTTP errors; ValueError: a malformed URL
                # URLError's own text is "<urlopen error ...>"; an HTTPError's says its status
                reason = exc.reason if type(exc) is urllib.error.URLError else exc
                raise RuntimeError(f"GSM8K {split}: download failed from {url}: {reason}; use data.source: "
                                   "synthetic on machines without network") from exc
            got = _sha256(tmp)
            if got != digest:
                raise RuntimeError(f"GSM8K {split}: checksum mismatch (got {got}, expected {digest})")
            rows = sum(1 for line in open(tmp) if line.strip())
            if rows != GSM8K_ROWS[split]:
                raise RuntimeError(f"GSM8K {split}: {rows} rows, expected {GSM8K_ROWS[split]}")
