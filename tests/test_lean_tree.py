"""scripts/gpu/lean-tree.sh: the committed results leave the carried tree for a lease's transfers and come back
exactly as HEAD holds them; it refuses whatever could lose a file."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "lean-tree.sh"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def _repo(tmp: Path) -> Path:
    """A scratch repository with the script, one committed result, one other file and .gpu ignored."""
    repo = tmp / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    (repo / "scripts" / "gpu" / "lean-tree.sh").write_text(SCRIPT.read_text())
    (repo / "results" / "reference" / "study").mkdir(parents=True)
    (repo / "results" / "reference" / "study" / "steps.csv").write_text("step,t\n1,2.5\n")
    (repo / "README.md").write_text("x\n")
    (repo / ".gitignore").write_text("/.gpu/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    return repo


def _lean(repo: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "scripts/gpu/lean-tree.sh", mode], cwd=repo, capture_output=True, text=True)


def _carried(repo: Path) -> set[str]:
    """What a device call is asked to carry: tracked files (present or not) and untracked ones git does not ignore."""
    return set(_git(repo, "ls-files", "--cached", "--others", "--exclude-standard").split())


def test_off_takes_the_results_out_of_what_travels_and_on_restores_head(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    assert _lean(repo, "off").returncode == 0
    assert _carried(repo) == {".gitignore", "README.md", "scripts/gpu/lean-tree.sh"}
    assert (repo / ".gpu" / "reference-stash" / "study" / "steps.csv").read_text() == "step,t\n1,2.5\n"
    res = _lean(repo, "on")
    assert res.returncode == 0, res.stderr
    assert _git(repo, "status", "--porcelain") == ""
    assert (repo / "results" / "reference" / "study" / "steps.csv").read_text() == "step,t\n1,2.5\n"


def test_off_refuses_uncommitted_results_and_twice(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / "results" / "reference" / "study" / "steps.csv").write_text("changed\n")
    res = _lean(repo, "off")
    assert res.returncode == 2 and "uncommitted changes" in res.stderr
    assert (repo / "results" / "reference" / "study" / "steps.csv").read_text() == "changed\n"
    _git(repo, "checkout", "--", ".")
    assert _lean(repo, "off").returncode == 0
    res = _lean(repo, "off")
    assert res.returncode == 2 and "exists already" in res.stderr


def test_on_refuses_to_overwrite_results_written_meanwhile(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    assert _lean(repo, "on").returncode == 2  # nothing stashed
    assert _lean(repo, "off").returncode == 0
    (repo / "results" / "reference" / "new").mkdir(parents=True)
    (repo / "results" / "reference" / "new" / "a.txt").write_text("lease\n")
    res = _lean(repo, "on")
    assert res.returncode == 2 and "beside the stash" in res.stderr
    assert (repo / "results" / "reference" / "new" / "a.txt").read_text() == "lease\n"
    assert (repo / ".gpu" / "reference-stash" / "study" / "steps.csv").is_file()
