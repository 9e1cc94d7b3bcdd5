"""Reading JSON-lines files: one JSON object a line, blank lines skipped.

Every file hybridrl keeps this way (data splits, steps.jsonl, request records) is read through `objects`, so a
bad line is reported the same way everywhere: the file, the line, what the line should have been and why it is not.
The callers differ only in the error they raise (or, for reports over damaged runs, in skipping the line).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any


class BadLine(ValueError):
    """A line that is not a JSON object; the message starts with `file:line:`."""


def objects(text: str, source: Path | str, what: str, error: type[Exception] = BadLine, hint: str = "",
            skip_bad: bool = False) -> list[dict[str, Any]]:
    """The JSON objects of `text`, one a line. A line that is not one raises `error` (`what` names what it should
    be, `hint` says what to do), or with skip_bad is left out with a warning carrying the same message."""
    rows = []
    # split on "\n" only: str.splitlines would also cut at U+2028 and other separators a JSON string may hold raw
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            cause = f"{exc.msg}, column {exc.colno}"
        else:
            if isinstance(row, dict):
                rows.append(row)
                continue
            cause = f"a JSON {type(row).__name__}, not an object"
        message = f"{source}:{number}: not a {what} ({cause}){hint}"
        if not skip_bad:
            raise error(message)
        warnings.warn(f"{message}; line skipped", stacklevel=2)
    return rows
