"""One reader for every JSON-lines file: a bad line named by file and line, or skipped with a warning."""

from __future__ import annotations

import json

import pytest

from hybridrl import jsonl


def test_objects_skips_blank_lines_and_keeps_crlf_and_raw_line_separators():
    # U+2028 may sit raw in a JSON string (ensure_ascii=False); it must not cut the line
    text = json.dumps({"a": "x\u2028y"}, ensure_ascii=False) + "\r\n\n  \n" + json.dumps({"b": 2}) + "\n"
    assert jsonl.objects(text, "f.jsonl", "record") == [{"a": "x\u2028y"}, {"b": 2}]


@pytest.mark.parametrize(("line", "cause"), [
    ('{"a": 1', "Expecting ',' delimiter, column 8"),
    ("[1, 2]", "a JSON list, not an object"),
    ("7", "a JSON int, not an object"),
])
def test_a_bad_line_raises_the_callers_error_naming_file_line_and_cause(line, cause):
    class Mine(RuntimeError):
        pass

    with pytest.raises(Mine) as exc:
        jsonl.objects('{"ok": 1}\n\n' + line + "\n", "runs/x/steps.jsonl", "step record", Mine, hint="; fix it")
    assert str(exc.value) == f"runs/x/steps.jsonl:3: not a step record ({cause}); fix it"


def test_skip_bad_warns_with_the_same_message_and_keeps_the_good_lines():
    with pytest.warns(UserWarning, match=r"^f:2: not a step record \(Unterminated string.*; line skipped$"):
        rows = jsonl.objects('{"step": 1}\n{"step": "2\n{"step": 3}\n', "f", "step record", skip_bad=True)
    assert rows == [{"step": 1}, {"step": 3}]
