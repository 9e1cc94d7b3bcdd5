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


def test_a_key_given_twice_is_refused_but_a_merge_may_be_overridden(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text("study: s\ndefaults:\n  steps: 3\n  lr: 0.1\n  steps: 4\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(path)
    assert str(err.value) == f"{path}:5:3: not valid YAML: key 'steps' given twice in one mapping (first at line 3)"
    path.write_text("base: &b {steps: 3, lr: 0.1}\nrun:\n  <<: *b\n  steps: 4\n")
    assert load_yaml(path)["run"] == {"steps": 4, "lr": 0.1}


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_number_that_is_not_finite_is_named_not_misread(tmp_path, value):
    path = tmp_path / "study.yaml"
    path.write_text("study: s\ndata: {source: synthetic}\nmodels: {m: {init: random, arch: qwen3}}\n"
                    f"defaults:\n  sampling: {{temperature: {value}}}\nruns: [{{engine: vllm}}]\n")
    with pytest.raises(ConfigError, match=r"study.yaml: defaults.sampling.temperature: not a finite number$"):
        load_study(path)


def test_a_folder_or_an_unwritable_output_is_one_line_naming_it(tmp_path, capsys):
    assert cli.main(["validate", "--config", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"hybridrl: {tmp_path}: Is a directory\n"
    blocker = tmp_path / "file"
    blocker.write_text("")
    # an output below a file: the folder cannot be made
    assert cli.main(["data", "--source", "synthetic", "--n-train", "4", "--n-test", "2",
                     "--out", str(blocker / "data")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hybridrl: {blocker}") and "Not a directory" in err, err


@pytest.mark.parametrize(("setting", "said"), [("wibble=1", "wibble: Extra inputs are not permitted"),
                                                ("steps=many", "steps: Input should be a valid integer"),
                                                ("steps=0", "steps: Input should be greater than or equal to 1")])
def test_bench_set_refuses_a_key_or_value_a_run_cannot_take_in_one_line(tmp_path, capsys, setting, said):
    from pathlib import Path

    from hybridrl.study.rule_params import run_spec_json

    study = load_study(Path(__file__).resolve().parents[1] / "config" / "smoke.yaml")
    cfg = tmp_path / "run.json"
    cfg.write_text(run_spec_json(study, next(iter(study.runs))))
    code = cli.main(["bench", "--run-config", str(cfg), "--model", str(tmp_path / "m"), "--data", str(tmp_path),
                     "--run-dir", str(tmp_path), "--out", str(tmp_path / "out.json"), "--set", setting])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"hybridrl: config error: bench --set: {said}") and err.count("\n") == 1, err


def test_a_model_spec_that_is_not_json_is_one_line(tmp_path, capsys):
    code = cli.main(["model", "--spec", "{bad", "--corpus", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("hybridrl: config error: --spec is not JSON (") and err.count("\n") == 1
    assert not (tmp_path / "m").exists()
