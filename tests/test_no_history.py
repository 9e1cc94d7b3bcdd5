"""src/ keeps reasons, not history: no dates, issue numbers, commit hashes or committed studies in its comments and
docstrings. The history of a finding lives in its study's README under results/reference/."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
HISTORY = re.compile(
    r"\b\d{4}-\d{2}-\d{2}\b"  # a date, and with it every committed study's folder name
    r"|\bissues? #?\d+"  # this project's issues; another project's read owner/repo#N
    r"|\bcommit [0-9a-f]{7,40}\b"
    r"|results/reference/\w",  # one committed study (the folder itself may be named)
    re.IGNORECASE)
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _comments(source: str) -> list[tuple[int, str]]:
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT]


def _docstrings(source: str) -> list[tuple[int, str]]:
    return [(node.body[0].lineno, doc) for node in ast.walk(ast.parse(source))
            if isinstance(node, DOCUMENTED) and (doc := ast.get_docstring(node, clean=False)) is not None]


def history_in(source: str) -> list[tuple[int, str]]:
    """(line, text) of the history in `source`'s comments and docstrings, in line order."""
    hits = []
    for line, text in _comments(source) + _docstrings(source):
        for match in HISTORY.finditer(text):
            hits.append((line + text[:match.start()].count("\n"), match.group()))
    return sorted(hits)


SAMPLE = '''"""A module.

Seen on the H200, 2026-11-23."""
x = 1  # since issue 20


def f():
    """As results/reference/2026-11-22-h200 found, and commit 763d544 fixed."""


y = "vllm-project/vllm#39934 and 2020-12 are not history, nor is what code says: 2026-11-23"
'''


def test_the_check_finds_history_in_comments_and_docstrings() -> None:
    assert history_in(SAMPLE) == [(3, "2026-11-23"), (4, "issue 20"), (8, "commit 763d544"),
                                  (8, "results/reference/2")]


def test_src_holds_no_history() -> None:
    found = [f"{path.relative_to(SRC.parent)}:{line}: {text}"
             for path in sorted(SRC.rglob("*.py")) for line, text in history_in(path.read_text())]
    assert not found, "history in src/ (say the reason; the study README keeps the when):\n" + "\n".join(found)
