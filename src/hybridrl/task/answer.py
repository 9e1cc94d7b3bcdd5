"""The final answer of a GSM8K completion, read exactly in one pass over the text (no regex).

The rule, also in the README beside the reward:

- The answer is the first number after the last `####`, else the last number in the text.
- A number token starts at a digit (or `.` then a digit) that is not glued to a preceding letter or `_`
  (`x2`, `Qwen3`, `v1.2` are words, not numbers), and runs on over digits, letters, and single
  joiners (`,` `.` `/` `:` `'` `_` `^`, dashes and signs, one space) that stand before a digit. So
  `3,4`, `1.2.3`, `1-2-3`, `3:45`, `10k` and `0x1F` are each one token, read whole or not at all.
- A token counts when it is, in digits of one script (ASCII, Arabic-Indic, Devanagari, fullwidth, ...):
  an integer (`1234`, or thousands in groups of three all split by commas or all by one kind of space:
  `1,234`, `1 234`), a decimal (`0.5`, `.5`, `1,234.50`), a fraction of two integers (`3/4`), or
  scientific notation (`1e3`, `2.5E-4`, exponent at most 100). It may follow one sign (`-`, `+`, the
  minus sign U+2212, the figure and en dashes, small and fullwidth hyphen-minus) and one currency
  symbol (`$`, `€`, ...) in either order; a dash right after a letter is a hyphen (`COVID-19` is 19).
- Anything else is refused, and the answer is then None rather than a different number: `1,23`,
  `1.2.3`, `5-3`, `10k`, `0x1F`, `3rd`, `½`, `10²`, `1 3/4`, `--5`, `±5`, `3/0`, a token longer than
  1,000 characters. A refused last token is not passed over for an earlier number.
- A number that is part of a sum written out is refused too, since it is not the sum's value. Looking
  along its line only (spaces, tabs, no newline): a number followed by an arithmetic operator (`/ ÷ × ·
  * ** ^ x X` or a sign) and then another number (`3 / 4`, `3/ 4`, `2 x 10^3`, `2*10^3`, `5 - 3`); a
  number preceded by such an operator that has a number (or `)`) before it (`12 + 12`, `550 / 10`); a
  number after a sign set apart from it by spaces (`- 7`, `− 7`); and a number followed by a scale word
  (`hundred`, `thousand`, `million`, `billion`, `trillion`, `dozen`, `lakh`, `crore` and words that begin
  with one, in any case; the abbreviations `k`, `K`, `M`, `bn`, `Bn`, `BN`). Units and words that are not
  scales (`5 dollars`, `5 m`, `5 km`, `50%`, `5.`, `**72**`) do not refuse.

Values are Fractions, so `0.1 + 0.2` style rounding never decides a reward; `format_number` writes the
canonical text (`1234.5`, `-7`, `1/3`).
"""

from __future__ import annotations

import random
import time
import unicodedata
from collections import deque
from collections.abc import Iterator
from fractions import Fraction

# Longer tokens are refused: no answer is that long, and it bounds the exact conversion (int() of a
# digit string is quadratic in its length and refused past 4,300 digits).
MAX_NUMBER_CHARS = 1000
# 1e999999999 would be a billion-digit integer.
MAX_EXPONENT = 100

MINUS = frozenset("-\u2212\u2012\u2013\ufe63\uff0d")
PLUS = frozenset("+\uff0b")
# A plus-minus sign names two numbers: a token after one is refused.
AMBIGUOUS_SIGNS = frozenset("\u00b1\u2213")
SIGNS = MINUS | PLUS | AMBIGUOUS_SIGNS
# Spaces that may split thousands: space, no-break space, thin space, narrow no-break space.
GROUP_SPACES = frozenset(" \u00a0\u2009\u202f")
# Between two digits these keep one token, so that its parts are never read as numbers of their own.
JOINERS = frozenset(",./:'_^\u2019\u2014\u066b\u066c\uff0c\uff0e") | SIGNS | GROUP_SPACES
CLOSING = frozenset(")]}")
# Operators that make a number one operand of a written-out operation (signs are operators too).
OPERATORS = frozenset("/\u00f7\u00d7\u00b7\u22c5\u2217*^xX") | SIGNS
# Words after a number that scale it: `1.5 million` is 1,500,000, not 1.5. Full words match as a prefix
# in any case (`Thousand`, `hundredths`); abbreviations only whole and as written (`5 m` is 5 metres).
SCALE_WORDS = ("hundred", "thousand", "million", "billion", "trillion", "dozen", "lakh", "crore")
SCALE_ABBREVIATIONS = frozenset({"k", "K", "M", "bn", "Bn", "BN"})


def _is_letter(c: str) -> bool:
    """A letter of a cased alphabet (Latin, Greek, Cyrillic, ...). Scripts without case (CJK, Arabic)
    often write no space between a word and a number, so their letters do not glue."""
    return c.isalpha() and (c.isascii() or unicodedata.category(c) in ("Lu", "Ll", "Lt"))


def _exponent_follows(text: str, i: int) -> bool:
    return text[i:i + 1].isnumeric() or (text[i:i + 1] in SIGNS and text[i + 1:i + 2].isnumeric())


def _token_end(text: str, i: int) -> int:
    """End of the token that starts at i: digits, letters, and joiners that stand before a digit."""
    n = len(text)
    while i < n:
        c = text[i]
        if c.isnumeric() or _is_letter(c):
            i += 1
        elif c in JOINERS and i + 1 < n and text[i + 1].isnumeric():
            i += 2
        elif c == "." and text[i + 1:i + 2] in ("e", "E") and _exponent_follows(text, i + 2):
            i += 2  # '5.e3' is one token (and refused), not 5 and a word
        else:
            break
    return i


def tokens(text: str, pos: int = 0) -> Iterator[tuple[int, int]]:
    """(start, end) of each number token from pos on, in order. Every character is looked at a
    bounded number of times, so a scan is linear in the text's length whatever the text."""
    n = len(text)
    i = pos
    while i < n:
        c = text[i]
        starts = c.isnumeric() or (c == "." and i + 1 < n and text[i + 1].isdecimal()
                                   and (i == 0 or text[i - 1] != "."))
        if not starts:
            i += 1
            continue
        end = _token_end(text, i)
        glued = i > pos and (_is_letter(text[i - 1]) or text[i - 1] == "_")
        if not glued:
            yield i, end
        i = end


def _ascii(token: str) -> str | None:
    """The token with ASCII digits, '-', '+' and ' '; None for digits of two scripts, non-decimal
    numerals (½, ², Ⅻ) and any character no accepted form uses."""
    if len(token) > MAX_NUMBER_CHARS:
        return None
    out = []
    zero = None
    for c in token:
        if c.isdecimal():
            digit = unicodedata.decimal(c)
            if zero is None:
                zero = ord(c) - digit
            elif ord(c) - digit != zero:
                return None
            out.append(chr(48 + digit))
        elif c in MINUS:
            out.append("-")
        elif c in PLUS:
            out.append("+")
        elif c in GROUP_SPACES:
            out.append(" ")
        elif c in ",./eE":
            out.append(c.lower())
        else:
            return None
    return "".join(out)


def _integer(s: str, grouped: bool) -> int | None:
    if s.isdigit():
        return int(s)
    if not grouped or not s:
        return None
    groups = s.split("," if "," in s else " ")
    if not all(g.isdigit() for g in groups):  # also refuses commas and spaces mixed
        return None
    if not 1 <= len(groups[0]) <= 3 or groups[0].startswith("0") or any(len(g) != 3 for g in groups[1:]):
        return None
    return int("".join(groups))


def _decimal(s: str, grouped: bool) -> Fraction | None:
    whole, dot, frac = s.partition(".")
    if dot and not frac.isdigit():
        return None
    if not whole and not dot:
        return None
    value = _integer(whole, grouped) if whole else 0
    if value is None:
        return None
    return value + (Fraction(int(frac), 10 ** len(frac)) if dot else 0)


def _unsigned(s: str) -> Fraction | None:
    """Value of an ASCII token without its leading sign: integer, decimal, fraction or scientific."""
    if "/" in s:
        num, _, den = s.partition("/")
        n, d = _integer(num, True), _integer(den, True)
        return Fraction(n, d) if n is not None and d else None
    mantissa, e, exponent = s.partition("e")
    if not e:
        return _decimal(s, True)
    digits = exponent[1:] if exponent[:1] in ("-", "+") else exponent
    if not digits.isdigit() or int(digits) > MAX_EXPONENT:
        return None
    value = _decimal(mantissa, False)
    return None if value is None else value * Fraction(10) ** int(exponent)


def _sign(text: str, start: int, floor: int) -> int | None:
    """+1 or -1 from the sign before the token (past one currency symbol); None for a doubled or
    plus-minus sign. A dash right after a letter, a digit or a bracket is a hyphen or an operator."""
    k = start
    sign = None
    currency = False
    for _ in range(2):
        p = text[k - 1] if k > floor else ""
        if p and p in SIGNS and sign is None:
            sign = p
        elif p and unicodedata.category(p) == "Sc" and not currency:
            currency = True
        else:
            break
        k -= 1
    if sign is None:
        return 1
    before = text[k - 1] if k > floor else ""
    if before and (_is_letter(before) or before.isnumeric() or before in CLOSING):
        return 1
    if sign in AMBIGUOUS_SIGNS or before in SIGNS:
        return None
    return -1 if sign in MINUS else 1


def _is_space(c: str) -> bool:
    """A space within a line (no newline)."""
    return c == "\t" or unicodedata.category(c) == "Zs"


def _number_at(text: str, j: int) -> bool:
    """Whether a number starts at j, past spaces and up to two signs or currency symbols."""
    n = len(text)
    while j < n and _is_space(text[j]):
        j += 1
    for _ in range(2):
        if j < n and (text[j] in SIGNS or unicodedata.category(text[j]) == "Sc"):
            j += 1
    return text[j:j + 1].isnumeric() or (text[j:j + 1] == "." and text[j + 1:j + 2].isdecimal())


def _followed_by_operation_or_scale(text: str, end: int) -> bool:
    """Whether the token ending at end is followed, on its line, by an operator and a number or by a
    scale word. Each look is bounded by the line's space run, so a call is linear in the text."""
    n = len(text)
    i = end
    while i < n and _is_space(text[i]):
        i += 1
    c = text[i:i + 1]
    if c and c in OPERATORS:
        j = i + 1
        if c == "*" and text[j:j + 1] == "*":
            j += 1  # '**', a power
        if _number_at(text, j):
            return True
    k = i
    while k < n and k - i < 16 and text[k].isalpha():
        k += 1
    word = text[i:k]
    return bool(word) and (word in SCALE_ABBREVIATIONS or word.lower().startswith(SCALE_WORDS))


def _preceded_by_operation(text: str, start: int, floor: int) -> bool:
    """Whether the token starting at start follows, on its line, an operator that has a number before
    it (`12 + 12`, `550 / 10`), or a sign set apart from it by spaces (`- 7`, `5 - 7`, `- $7`)."""
    k = start
    gap = currency = False
    while k > floor:
        p = text[k - 1]
        if _is_space(p):
            gap = True
        elif unicodedata.category(p) == "Sc" and not currency:
            currency = True
        else:
            break
        k -= 1
    if k == floor:
        return False
    c = text[k - 1]
    if c in SIGNS and gap:
        return True
    if c not in OPERATORS:
        return False  # a sign right before the digits is read by _sign
    j = k - 1
    if c == "*" and j > floor and text[j - 1] == "*":
        j -= 1
    while j > floor and _is_space(text[j - 1]):
        j -= 1
    return j > floor and (text[j - 1].isnumeric() or text[j - 1] in CLOSING)


def value_of(text: str, start: int, end: int, floor: int = 0) -> Fraction | None:
    """The exact value of the token text[start:end], or None where it is refused."""
    token = _ascii(text[start:end])
    value = _unsigned(token) if token is not None else None
    if value is None:
        return None
    if _followed_by_operation_or_scale(text, end) or _preceded_by_operation(text, start, floor):
        return None
    sign = _sign(text, start, floor)
    return None if sign is None else sign * value


def answer_value(text: str) -> Fraction | None:
    """The final answer's value: the first number after the last '####', else the last number."""
    marker = text.rfind("####")
    if marker >= 0:
        floor = marker + 4
        first = next(tokens(text, floor), None)
        return value_of(text, *first, floor) if first else None
    last = deque(tokens(text), maxlen=1)
    return value_of(text, *last[0]) if last else None


def format_number(value: Fraction) -> str:
    """Canonical text of a value: '-7', '1234.5', '0.05', or 'n/d' where no decimal ends."""
    sign = "-" if value < 0 else ""
    num, den = abs(value.numerator), value.denominator
    twos = (den & -den).bit_length() - 1
    rest, fives = den >> twos, 0
    while rest % 5 == 0:
        rest //= 5
        fives += 1
    if rest != 1:
        return f"{sign}{num}/{den}"
    places = max(twos, fives)
    digits = str(num * 10**places // den).rjust(places + 1, "0")
    return sign + (f"{digits[:-places]}.{digits[-places:]}" if places else digits)


def extract_answer(text: str) -> str | None:
    """The final answer in canonical text (see the module's rule), or None."""
    value = answer_value(text)
    return None if value is None else format_number(value)


# --- worst cases, measured (python -m hybridrl bench-parse) -------------------------------------

BENCH_CASES = {
    "20,000 spaces": " " * 20_000,
    "10,000 newlines": "\n" * 10_000,
    "20,000 spaces after ####": "####" + " " * 20_000,
    "100,000 digits": "7" * 100_000,
    "100,000 digits after ####": "#### " + "7" * 100_000,
    "50,000 x '1,'": "1," * 50_000,
    "50,000 x '1 '": "1 " * 50_000,
    "50,000 x '$ '": "$ " * 50_000,
    "50,000 x '-.'": "-." * 50_000,
    "25,000 x '1e3 '": "1e3 " * 25_000,
    "100,000 letters": "a" * 100_000,
    "100,000 mixed number characters": "".join(random.Random(0).choices("0123456789 ,.-$e/x\n", k=100_000)),
    "longest number read (1,000 digits)": "#### " + "9" * MAX_NUMBER_CHARS,
    "a worked answer (~600 characters)": "Ava has 12 apples. Ben gives her 3 * 4 = <<3*4=12>>12 more, " * 10
    + "so 12 + 12 = 24.\n#### 24",
}


def bench(repeats: int = 3) -> list[tuple[str, int, float]]:
    """(case, characters, best seconds of `repeats`) for each worst case above."""
    rows = []
    for name, text in BENCH_CASES.items():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            extract_answer(text)
            best = min(best, time.perf_counter() - t0)
        rows.append((name, len(text), best))
    return rows
