"""results/README.md: generated from the committed studies' folder names and READMEs, and kept equal to that."""

from pathlib import Path

import pytest

from hybridrl import cli
from hybridrl.report import results_index, wording

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "results" / "reference"


def test_the_committed_index_is_what_the_generator_writes() -> None:
    wanted = results_index.render(results_index.studies(REFERENCE))
    assert (REPO / "results" / "README.md").read_text() == wanted, \
        "results/README.md is out of date: run `python -m hybridrl results-index`"


def test_every_committed_study_has_a_row_with_its_own_question_and_finding() -> None:
    rows = results_index.studies(REFERENCE)
    assert sorted(s.folder for s in rows) == sorted(d.name for d in REFERENCE.iterdir() if d.is_dir())
    for s in rows:
        text = (REFERENCE / s.folder / "README.md").read_text()
        # a marker, not the fallback: a README's first sentence says where it ran, not what it found
        assert f"<!-- finding: {s.finding} -->" in text, s.folder
        assert f"<!-- question: {s.question} -->" in text, s.folder
    assert [s.date for s in rows] == sorted((s.date for s in rows), reverse=True)


def test_the_index_follows_the_wording_rules() -> None:
    assert wording.violations((REPO / "results" / "README.md").read_text()) == []


@pytest.mark.parametrize(("folder", "machine"), [("2026-11-22-h200", "H200"), ("2026-11-27-2xh200-moe2new", "2 × H200"),
                                                 ("2026-11-22-4xh200-moe", "4 × H200"), ("2026-11-27-cpu-smoke", "CPU"),
                                                 ("2026-11-26-h100-offloadcheck", "H100")])
def test_the_machine_comes_from_the_folder_name(folder: str, machine: str) -> None:
    assert results_index.machine(folder) == machine


def test_a_folder_without_date_and_machine_is_refused_by_name() -> None:
    with pytest.raises(results_index.StudyIndexError, match=r"^smoke-h200: a study folder's name starts with "):
        results_index.machine("smoke-h200")


@pytest.mark.parametrize(("title", "question"), [
    ("The verdict study on one H200 (issue 16), 2026-11-23", "The verdict study on one H200"),
    ("The HF trainer's export (issue 15), 2026-11-25: no shorter", "The HF trainer's export"),
    ("2026-11-26, CPU: every bad input fed to hybridrl", "CPU: every bad input fed to hybridrl"),
    ("Colocate and split on two H200s, 2026-11-26 and 2026-11-27", "Colocate and split on two H200s"),
    ("Megatron trainer on H200s (2026-11-22)", "Megatron trainer on H200s"),
])
def test_a_title_gives_the_question_without_issue_date_or_finding(title: str, question: str) -> None:
    assert results_index.title_question(title) == question


def _study(root: Path, name: str, text: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "README.md").write_text(text)


def test_without_markers_the_row_takes_the_title_and_the_first_prose_sentence(tmp_path: Path) -> None:
    _study(tmp_path, "2026-01-02-cpu-x", "# Does it run? (issue 3), 2026-01-02\n\n> **Note:** a caveat first.\n\n"
                                          "It ran. Then more.\n")
    (row,) = results_index.studies(tmp_path)
    assert (row.question, row.finding, row.machine) == ("Does it run?", "It ran.", "CPU")


def test_a_later_study_that_supersedes_an_earlier_one_sets_its_status(tmp_path: Path) -> None:
    _study(tmp_path, "2026-01-01-h200-a", "# A\n<!-- question: Is A fast? -->\n<!-- finding: Yes | no. -->\n")
    _study(tmp_path, "2026-01-03-h200-c", "# C\n<!-- finding: C. -->\n<!-- supersedes: 2026-01-02-h200-b -->\n")
    _study(tmp_path, "2026-01-02-h200-b", "# B\n<!-- finding: B. -->\n<!-- supersedes: 2026-01-01-h200-a -->\n")
    page = results_index.render(results_index.studies(tmp_path))
    rows = page.splitlines()[-3:]
    assert [r.split(" | ")[0] for r in rows] == ["| 2026-01-03", "| 2026-01-02", "| 2026-01-01"]
    assert rows[0].split(" | ")[4] == "current"
    assert rows[1].split(" | ")[4] == "superseded by [2026-01-03-h200-c](reference/2026-01-03-h200-c/README.md)"
    assert "| Is A fast? | Yes \\| no. | superseded by [2026-01-02-h200-b]" in rows[2]


@pytest.mark.parametrize(("named", "said"), [
    ("2026-01-09-h200-z", "supersedes 2026-01-09-h200-z, which is not a study"),
    ("2026-01-05-h200-b", "supersedes 2026-01-05-h200-b, a later study"),
])
def test_a_supersedes_marker_must_name_an_earlier_study(tmp_path: Path, named: str, said: str) -> None:
    _study(tmp_path, "2026-01-05-h200-b", "# B\n")
    _study(tmp_path, "2026-01-01-h200-a", f"# A\n<!-- supersedes: {named} -->\n")
    with pytest.raises(results_index.StudyIndexError, match=f"^2026-01-01-h200-a: {said}"):
        results_index.studies(tmp_path)


def test_a_study_without_a_readme_or_with_two_findings_is_named(tmp_path: Path) -> None:
    (tmp_path / "2026-01-01-h200-a").mkdir()
    with pytest.raises(results_index.StudyIndexError, match="2026-01-01-h200-a: no README.md"):
        results_index.studies(tmp_path)
    (tmp_path / "2026-01-01-h200-a" / "README.md").write_text("# A\n<!-- finding: x -->\n<!-- finding: y -->\n")
    with pytest.raises(results_index.StudyIndexError, match=r"README.md: two finding markers"):
        results_index.studies(tmp_path)


def test_cli_writes_the_index_and_check_fails_when_it_is_stale(tmp_path: Path, capsys) -> None:
    _study(tmp_path / "ref", "2026-01-01-cpu-a", "# A\n<!-- finding: It ran. -->\n")
    out = tmp_path / "README.md"
    args = ["results-index", "--reference", str(tmp_path / "ref"), "--out", str(out)]
    with pytest.raises(SystemExit, match="is out of date with"):
        cli.main([*args, "--check"])
    assert not out.exists()
    assert cli.main(args) == 0 and "| It ran. | current |" in out.read_text()
    assert cli.main([*args, "--check"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{out}: written", f"{out}: up to date"]
