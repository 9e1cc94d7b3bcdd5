"""A study file that is not valid YAML: one line with file, line and column, from `hybridrl validate`."""

import pytest

from hybridrl import cli
from hybridrl.study.config import ConfigError, load_study, load_yaml

BAD = [
    ("study: smoke\ndata:\n  n_train: [1, 2\nmodels: {}\n", "4:7", "expected ',' or ']', but got ':' (while parsing a "
     "flow sequence that starts at line 3, column 12)"),
    ("study: smoke\n\tdata: 1\n", "2:1", "found character '\\t' that cannot start any token"),
    ("study: smoke\ndata: a: b\n", "2:8", "mapping values are not allowed here"),
    ('study: "smoke\nmodels: {}\n', "3:1", "found unexpected end of stream"),
    ("study: smoke\nruns: [\x01]\n", "2:8", "character U+0001: special characters are not allowed"),
]


@pytest.mark.parametrize(("text", "where", "what"), BAD)
def test_syntax_error_is_one_line_with_line_and_column(tmp_path, text, where, what):
    path = tmp_path / "study.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_study(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{where}: not valid YAML: {what}")


def test_undecodable_file(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_bytes(b"study: smoke\nname: \xff\n")
    with pytest.raises(ConfigError, match=r"study.yaml:2:7: not UTF-8 text \(byte 0xff\)"):
        load_yaml(path)


def test_validate_prints_one_line(tmp_path, capsys):
    path = tmp_path / "study.yaml"
    path.write_text(BAD[0][0])
    assert cli.main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"hybridrl: config error: {path}:4:7: not valid YAML: ")
