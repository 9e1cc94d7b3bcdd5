"""Answer parsing: exact values, refusals instead of misreadings, and a scan linear in the text.

Whitespace runs are never timed here (the benchmark is `python -m hybridrl bench-parse`): the tests
check instead that no regex reads a whole completion, and count the parser's Python steps.
"""

import re
import sys
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hybridrl.task import answer, data

# Unicode digit scripts, by their zero: Arabic-Indic, Devanagari, Bengali, Thai, fullwidth
ZEROS = [0x0660, 0x0966, 0x09E6, 0x0E50, 0xFF10]
MINUSES = ["-", "\u2212", "\u2012", "\u2013", "\ufe63", "\uff0d"]
CONTEXTS = ["{}", "#### {}", "#### {} apples", "The answer is {}.", "so x = {}\n", "first 12, then ({})",
            "答案是{}", "#### {}\nand 99 more"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### \u22127", "-7"),  # U+2212 MINUS SIGN kept its sign nowhere before
        ("#### \u20137", "-7"),  # en dash as a minus
        ("x = \uff0d7", "-7"),  # fullwidth hyphen-minus
        ("#### 1e3", "1000"),
        ("1e3", "1000"),
        ("#### 2.5E-4", "0.00025"),
        ("#### 3/4", "0.75"),
        ("it is 3/4", "0.75"),
        ("#### 1/3 of a cake", "1/3"),
        ("#### 1 000", "1000"),
        ("1\u00a0000\u00a0000 people", "1000000"),
        ("#### \u0664\u0662", "42"),  # Arabic-Indic digits
        ("#### \uff14\uff12", "42"),  # fullwidth digits
        ("答案是42", "42"),  # a CJK letter does not glue to a number
        ("COVID-19 cases", "19"),  # a dash after a letter is a hyphen
        ("#### $\u22123.50", "-3.5"),
        ("#### 5.", "5"),  # the full stop ends the sentence
    ],
)
def test_forms_read_exactly(text, expected):
    assert data.extract_answer(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "#### 10k", "#### 5kg", "#### 3rd", "#### 0x1F", "#### 1,23", "#### 1.2.3", "#### 2024-01-05", "#### 5-3",
        "#### 3:45", "#### ½", "#### 10²", "#### 1 3/4", "#### --5", "#### ±5", "#### 3/0", "#### 1e101",
        "#### 12 34", "#### 4\u0662", "#### 1_000", "#### 1'000", "#### 5.e3", "#### 1,000 000", "#### 0,5",
        "the answer is 10k", "it is 2024-01-05", "#### " + "9" * (answer.MAX_NUMBER_CHARS + 1),
    ],
)
def test_other_forms_are_refused_not_misread(text):
    assert data.extract_answer(text) is None


def test_a_refused_last_token_is_not_passed_over():
    # falling back to the 5 would read an answer the text does not give
    assert data.extract_answer("5 apples, so 10k") is None


def test_words_with_digits_are_not_numbers():
    assert data.extract_answer("#### Qwen3 says 7") == "7"
    assert data.extract_answer("use v1.2 of x2 then 8") == "8"


@pytest.mark.parametrize(
    ("completion", "reference", "reward"),
    [
        ("#### 0.30", "#### 3/10", 1.0),
        ("#### 1e3", "#### 1,000", 1.0),
        ("#### \u22127", "#### -7", 1.0),
        ("#### \u22127", "#### 7", 0.0),
        ("#### 10k", "#### 10", 0.0),
        ("#### 1/3", "#### 0.3333333333333333", 0.0),  # exact, not float-close
        ("#### 3/4", "#### 3", 0.0),
    ],
)
def test_reward_compares_exact_values(completion, reference, reward):
    assert data.reward(completion, reference) == reward


def test_shaped_reward():
    assert data.shaped_reward("#### 18", "#### 18", 0.1) == 1.0
    assert data.shaped_reward("nothing", "#### 18", 0.1) == 0.0
    assert data.shaped_reward("#### 7", "no answer", 0.1) == 0.1
    close, far = data.shaped_reward("#### 17", "#### 18", 0.1), data.shaped_reward("#### 1e9", "#### 18", 0.1)
    assert 0 < far < close < 0.1
    assert data.shaped_reward("#### 10k", "#### 10", 0.1) == 0.0  # refused, not 10


@pytest.mark.parametrize("completion", ["#### 18", "nothing", "#### 17", "#### 1e9", "#### 10k", "so 18 eggs",
                                        "#### -18", "", "3 then 18 then 4"])
@pytest.mark.parametrize("reference", ["#### 18", "no answer", "9 * 2 = 18\n#### 18"])
def test_scores_are_the_reward_and_the_shaped_reward_from_one_scan(completion, reference):
    assert data.scores(completion, reference, 0.1) == (data.reward(completion, reference),
                                                        data.shaped_reward(completion, reference, 0.1))


@pytest.mark.parametrize(
    ("value", "text"),
    [(Fraction(-7), "-7"), (Fraction(12345, 10), "1234.5"), (Fraction(1, 20), "0.05"), (Fraction(-2, 3), "-2/3"),
     (Fraction(0), "0"), (Fraction(10**40), "1" + "0" * 40)],
)
def test_format_number(value, text):
    assert answer.format_number(value) == text


# --- the scan is linear whatever the text --------------------------------------------------------

class _GuardedPattern:
    """A compiled regex that refuses to read more than LIMIT characters: backtracking over a whole
    completion is what made a whitespace run quadratic."""

    LIMIT = 200

    def __init__(self, pattern):
        self._pattern = pattern

    def __getattr__(self, name):
        method = getattr(self._pattern, name)

        def guarded(string, *args, **kwargs):
            if len(string) > self.LIMIT:
                raise AssertionError(f"regex {self._pattern.pattern!r}.{name} over {len(string)} characters")
            return method(string, *args, **kwargs)

        return guarded


class _GuardedRe:
    def __getattr__(self, name):
        if name == "compile":
            return lambda *a, **k: _GuardedPattern(re.compile(*a, **k))
        if name in ("search", "match", "fullmatch", "findall", "finditer", "sub", "subn", "split"):
            return lambda pattern, string, *a, **k: getattr(_GuardedPattern(re.compile(pattern)), name)(string, *a, **k)
        return getattr(re, name)


@pytest.mark.parametrize("text", [" " * 20_000, "\n" * 10_000, "#### " + " " * 20_000, "$ " * 10_000])
def test_no_regex_reads_a_whole_completion(monkeypatch, text):
    modules = {data, sys.modules[data.extract_answer.__module__]}
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, re.Pattern):
                monkeypatch.setattr(module, name, _GuardedPattern(value))
        if getattr(module, "re", None) is re:
            monkeypatch.setattr(module, "re", _GuardedRe())
    data.extract_answer(text)
    data.reward(text, "#### 1")


def _python_steps(text: str) -> int:
    """Lines of Python the parser runs on text: a measure of its work that no clock or load changes."""
    steps = 0

    def tracer(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
        return tracer

    sys.settrace(tracer)
    try:
        answer.extract_answer(text)
    finally:
        sys.settrace(None)
    return steps


@pytest.mark.parametrize("unit", [" ", "\n", "7", "1,", "1 ", "-.", "$ ", "1e3 ", "a", "x2 ", "#### ", "1 / ", "- ",
                                  "2 million "])
def test_work_grows_linearly(unit):
    n = 2000 // len(unit)
    small, large = _python_steps(unit * n), _python_steps(unit * (2 * n))
    assert large <= 2.2 * small + 50, (small, large)


# --- properties ----------------------------------------------------------------------------------

NUMBERISH = st.sampled_from(list("0123456789 ,./:-+eE$#\n½²\u2212\u00a0\u0663xk_'") + MINUSES)


@settings(deadline=None, max_examples=300)
@given(st.one_of(st.text(), st.text(NUMBERISH)))
def test_never_raises_and_the_answer_reads_back(text):
    got = data.extract_answer(text)
    if got is not None:
        assert data.extract_answer(got) == got
        assert answer.answer_value(got) == answer.answer_value(text)


def _digits(text: str, zero: int) -> str:
    return "".join(chr(zero + int(c)) if c.isdigit() else c for c in text)


def _grouped(n: int, sep: str) -> str:
    return f"{n:,}".replace(",", sep)


def _forms(value: Fraction) -> list[str]:
    """Texts that must read as exactly `value`, without sign where the caller adds one."""
    magnitude = abs(value)
    forms = [answer.format_number(magnitude)]
    num, den = magnitude.numerator, magnitude.denominator
    forms += [f"{num}/{den}", f"{num * 3}/{den * 3}"]
    if den == 1:
        forms += [_grouped(num, s) for s in (",", " ", "\u00a0", "\u2009", "\u202f")]
        forms += [f"{num}.000", f"{num}e0", f"{num * 1000}e-3", f"{_grouped(num, ',')}.0"]
        forms += [_digits(str(num), zero) for zero in ZEROS]
    text = answer.format_number(magnitude)
    if "/" not in text:
        whole, _, frac = text.partition(".")
        forms += [f"{text}00" if frac else f"{text}.00", f"{whole}{frac}e-{len(frac)}",
                  f"{_grouped(int(whole), ',')}.{frac}" if frac else _grouped(int(whole), ",")]
        if whole == "0" and frac:
            forms.append(f".{frac}")
    return forms


VALUES = st.one_of(
    st.integers(-10**30, 10**30).map(Fraction),
    st.decimals(allow_nan=False, allow_infinity=False, places=6, min_value=-10**12, max_value=10**12).map(Fraction),
    st.fractions(max_denominator=10**6, min_value=-10**9, max_value=10**9),
)


@settings(deadline=None, max_examples=300)
@given(VALUES, st.data())
def test_every_form_it_accepts_reads_back_exactly(value, draw):
    form = draw.draw(st.sampled_from(_forms(value)), label="form")
    if value < 0:
        sign = draw.draw(st.sampled_from(MINUSES), label="minus")
        form = draw.draw(st.sampled_from([f"{sign}{form}", f"{sign}${form}", f"${sign}{form}"]), label="signed")
    else:
        form = draw.draw(st.sampled_from([form, f"+{form}", f"${form}"]), label="unsigned")
    context = draw.draw(st.sampled_from(CONTEXTS), label="context")
    assert answer.answer_value(context.format(form)) == value


@settings(deadline=None)
@given(st.integers(0, 10**9), st.sampled_from(["k", "M", "kg", "x", "rd", "e", "px"]))
def test_a_number_glued_to_letters_is_refused(n, suffix):
    assert answer.answer_value(f"#### {n}{suffix}") is None
    assert answer.answer_value(f"it is {n}{suffix}") is None


# --- a number that is one part of a written-out operation, or scaled by a word, is refused --------

@pytest.mark.parametrize(
    "text",
    [
        "#### 3 / 4", "#### 3 /4", "#### 3/ 4", "#### 3 ÷ 4", "#### 3÷4", "#### - 7", "#### \u2212 7", "#### + 7",
        "#### - $7", "#### 2 x 10^3", "#### 2 \u00d7 10^3", "#### 2*10^3", "#### 2 ** 3", "#### 2 ^ 3",
        "#### 5 - 3", "#### 5 -3", "#### 5 + 3 = 8", "#### (3 + 4)", "#### 1 000 x 3",
        "#### 1.5 million", "#### 2 Thousand", "#### 3 hundred", "#### 3 hundredths", "#### 2 dozen eggs",
        "#### 4 lakh", "#### 10 k", "#### 5 M", "#### 1.2 bn", "#### 3\u00a0billion",
        "so it is 3 / 4", "Each gets 550 / 10", "12 + 12", "the answer is - 7", "it is 1.5 million",
    ],
)
def test_an_operand_or_a_scaled_number_is_refused_not_misread(text):
    assert data.extract_answer(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 5 dollars", "5"), ("#### 5 apples", "5"), ("#### 50%", "50"), ("#### 5 m", "5"), ("#### 5 km", "5"),
        ("#### 5 kg", "5"), ("#### 5 xylophones", "5"), ("#### **72**", "72"), ("#### 20 / hour", "20"),
        ("#### 72\n- 3 more", "72"), ("#### 72\n1.5 million", "72"), ("#### $ -7", "-7"), ("#### -$7", "-7"),
        ("#### 5 = 2 + 3", "5"), ("so 12 + 12 = 24", "24"), ("the maximum is 7", "7"), ("#### 5 - the rest", "5"),
    ],
)
def test_units_and_a_line_break_do_not_refuse(text, expected):
    assert data.extract_answer(text) == expected


SPACES = st.text(st.sampled_from([" ", "\t", "\u00a0", "\u2009"]), max_size=3)


@settings(deadline=None, max_examples=300)
@given(VALUES, st.sampled_from(["/", "\u00f7", "\u00d7", "*", "**", "^", "x", "+", *MINUSES]), SPACES, SPACES,
       st.sampled_from(["4", "10^3", "$2", ".5", "-3"]), st.data())
def test_an_operand_is_refused_whatever_its_form(value, op, before, after, other, draw):
    assume(before or after)  # unspaced, `3/4` is a fraction and `5-3` one refused token
    form = draw.draw(st.sampled_from(_forms(value)), label="form")
    assert answer.answer_value(f"#### {form}{before}{op}{after}{other} apples") is None
    assert answer.answer_value(f"so {other}{before}{op}{after}{form}") is None


@settings(deadline=None, max_examples=200)
@given(VALUES, st.sampled_from([*MINUSES, "+"]), SPACES.filter(bool),
       st.sampled_from(["million", "Thousand", "dozen", "k", "M", "bn"]), st.data())
def test_a_sign_set_apart_or_a_scale_word_is_refused(value, sign, spaces, scale, draw):
    form = draw.draw(st.sampled_from(_forms(value)), label="form")
    assert answer.answer_value(f"#### {sign}{spaces}{form}") is None
    assert answer.answer_value(f"#### {form}{spaces}{scale}") is None
