"""scripts/gpu/import-lease.sh: a poll's tarball, packed by the driver, becomes a reference folder with compacted
request records, logs, the warm-start record, the tidy table and the report; bad input is one clear line."""

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_report import write_run

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "scripts" / "gpu" / "run_reference.sh"
IMPORT = REPO / "scripts" / "gpu" / "import-lease.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _import(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYBRIDRL_PYTHON": sys.executable}
    return subprocess.run(["bash", str(IMPORT), *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture
def tarball(tmp_path: Path) -> Path:
    """What a poll returns: the driver's pack of a study with two runs, a warm start and logs."""
    root = tmp_path / "ref"
    study = root / "gpu-h200-learning"
    study.mkdir(parents=True)
    (study / "setup.done").touch()
    for i, rid in enumerate(("sglang-verdict-795e3683", "vllm-verdict-4c49f35f")):
        run = write_run(study, rid, rid.split("-")[0], "colocate", seed=i)
        (run / "requests").mkdir()
        (run / "requests" / "step-0001.jsonl").write_text(json.dumps({"request": 0, "tokens": 5}) + "\n")
        (run / "logs").mkdir()
        (run / "logs" / "engine.log").write_text("started\n")
    (study / "models" / "qwen3-0.6b-warm").mkdir(parents=True)
    (study / "models" / "qwen3-0.6b-warm" / "warm_start.json").write_text('{"base_accuracy": 0.44}\n')
    dead = study / "runs" / "vllm-verdict-4c49f35f-r2" / "logs"  # died at engine start: logs, no steps
    dead.mkdir(parents=True)
    (dead / "engine.log").write_text("CUDA error\n")
    (study / "lane-verdictwarm-1.log").write_text("lane\n")
    (root / "driver.log").write_text("driver\n")
    return _pack(root, tmp_path / "latest.tar.gz")


def _pack(root: Path, out: Path) -> Path:
    """The driver's own pack of the studies under root, as a poll returns it."""
    env = {"PATH": "/usr/bin:/bin", "HYBRIDRL_REF_DIR": str(root)}
    done = subprocess.run(["bash", str(DRIVER), "pack", str(out)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return out


def test_a_polls_tarball_becomes_a_reference_folder(tarball: Path, tmp_path: Path) -> None:
    dest = tmp_path / "results" / "2026-11-25-h200-verdictwarm2"
    done = _import(str(tarball), "gpu-h200-learning", str(dest))
    assert done.returncode == 0, done.stderr
    assert f"commit it now: git add -f {dest}" in done.stdout
    assert "(2 runs with steps)" in done.stdout and not (tmp_path / "results" / f"{dest.name}.partial").exists()
    runs = sorted(p.name for p in (dest / "runs").iterdir())
    assert runs == ["sglang-verdict-795e3683", "vllm-verdict-4c49f35f", "vllm-verdict-4c49f35f-r2"]
    assert (dest / "runs" / runs[2] / "logs" / "engine.log").read_text() == "CUDA error\n"  # kept for its cause
    records = dest / "runs" / runs[0] / "requests"
    assert [p.name for p in records.iterdir()] == ["step-0001.jsonl.gz"]  # compacted, as the tests demand
    assert json.loads(gzip.decompress((records / "step-0001.jsonl.gz").read_bytes())) == {"request": 0, "tokens": 5}
    assert (dest / "runs" / runs[0] / "logs" / "engine.log").read_text() == "started\n"
    assert json.loads((dest / "model" / "warm_start.json").read_text()) == {"base_accuracy": 0.44}
    assert sorted(p.name for p in (dest / "logs").iterdir()) == ["driver.log", "lane-verdictwarm-1.log"]
    assert len((dest / "steps.csv").read_text().splitlines()) == 1 + 2 * 8
    assert "# hybridrl study" in (dest / "report.md").read_text() and (dest / "plots" / "throughput.png").exists()


def test_bad_input_is_one_line_and_nothing_is_overwritten(tarball: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    wrong = _import(str(tarball), "gpu-h200-nope", str(dest))
    assert wrong.returncode == 2 and not dest.exists()
    assert wrong.stderr.strip() == f"import-lease: no study gpu-h200-nope in {tarball}; it holds: gpu-h200-learning"
    assert _import(str(tarball)).stderr == "import-lease: usage: import-lease.sh TARBALL STUDY NAME (got 1 arguments)\n"
    missing = _import(str(tmp_path / "none.tar.gz"), "gpu-h200-learning", str(dest))
    assert missing.returncode == 2 and "no file" in missing.stderr and not dest.exists()
    dest.mkdir()
    (dest / "README.md").write_text("kept\n")
    taken = _import(str(tarball), "gpu-h200-learning", str(dest))
    assert taken.returncode == 2 and "exists: nothing written" in taken.stderr
    assert [p.name for p in dest.iterdir()] == ["README.md"]
    not_tar = tmp_path / "x.tar.gz"
    not_tar.write_text("not a tarball")
    bad = _import(str(not_tar), "gpu-h200-learning", str(tmp_path / "other"))
    assert bad.returncode == 2 and bad.stderr.strip() == f"import-lease: {not_tar} is not a gzipped tar (a poll's " \
                                                        "latest.tar.gz)"
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.partial").exists()


def test_a_failure_half_way_leaves_no_folder_behind(tarball: Path, tmp_path: Path) -> None:
    dest = tmp_path / "results" / "x"
    env = {**os.environ, "HYBRIDRL_PYTHON": "/bin/false"}  # every hybridrl step fails
    done = subprocess.run(["bash", str(IMPORT), str(tarball), "gpu-h200-learning", str(dest)], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode != 0
    assert not dest.exists() and not dest.with_name("x.partial").exists()


def _later_round(tmp_path: Path, runs: tuple[str, ...]) -> Path:
    """A later lease's poll: the same study with other runs (the next round's replicates) and its own logs."""
    root = tmp_path / "later" / "ref"
    study = root / "gpu-h200-learning"
    study.mkdir(parents=True)
    (study / "setup.done").touch()
    for i, rid in enumerate(runs):
        write_run(study, rid, rid.split("-")[0], "colocate", seed=10 + i)
    (study / "models" / "qwen3-0.6b-warm").mkdir(parents=True)
    (study / "models" / "qwen3-0.6b-warm" / "warm_start.json").write_text('{"base_accuracy": 0.45}\n')
    (study / "lane-verdictwarm-1.log").write_text("lane of lease 2\n")
    (root / "driver.log").write_text("driver of lease 2\n")
    return _pack(root, tmp_path / "later.tar.gz")


def test_add_puts_a_later_leases_runs_beside_the_first_and_renders_them_together(tarball: Path,
                                                                                tmp_path: Path) -> None:
    dest = tmp_path / "results" / "study"
    assert _import(str(tarball), "gpu-h200-learning", str(dest)).returncode == 0
    later = _later_round(tmp_path, ("sglang-verdict-795e3683-r3", "vllm-verdict-4c49f35f-r3"))
    done = _import("--add", "lease2", str(later), "gpu-h200-learning", str(dest))
    assert done.returncode == 0, done.stderr
    assert "(4 runs with steps)" in done.stdout and not dest.with_name("study.partial").exists()
    assert sorted(p.name for p in (dest / "runs").iterdir()) == [
        "sglang-verdict-795e3683", "sglang-verdict-795e3683-r3", "vllm-verdict-4c49f35f",
        "vllm-verdict-4c49f35f-r2", "vllm-verdict-4c49f35f-r3"]
    assert sorted(p.name for p in (dest / "logs").iterdir()) == [
        "driver-lease2.log", "driver.log", "lane-verdictwarm-1-lease2.log", "lane-verdictwarm-1.log"]
    assert (dest / "logs" / "driver.log").read_text() == "driver\n"  # the first lease's, untouched
    assert json.loads((dest / "model" / "warm_start.json").read_text()) == {"base_accuracy": 0.44}
    assert json.loads((dest / "model" / "warm_start-lease2.json").read_text()) == {"base_accuracy": 0.45}
    assert len((dest / "steps.csv").read_text().splitlines()) == 1 + 4 * 8  # every run in one table


def test_add_refuses_a_run_or_label_the_folder_holds_and_changes_nothing(tarball: Path, tmp_path: Path) -> None:
    dest = tmp_path / "results" / "study"
    assert _import(str(tarball), "gpu-h200-learning", str(dest)).returncode == 0
    before = sorted(str(p.relative_to(dest)) for p in dest.rglob("*"))
    table = (dest / "steps.csv").read_text()
    again = _import("--add", "lease2", str(tarball), "gpu-h200-learning", str(dest))
    assert again.returncode == 2
    assert again.stderr.strip() == f"import-lease: {dest} already holds run sglang-verdict-795e3683: nothing written"
    later = _later_round(tmp_path, ("sglang-verdict-795e3683-r3",))
    assert _import("--add", "lease2", str(later), "gpu-h200-learning", str(dest)).returncode == 0
    other = _later_round(tmp_path / "b", ("vllm-verdict-4c49f35f-r3",))
    taken = _import("--add", "lease2", str(other), "gpu-h200-learning", str(dest))
    assert taken.returncode == 2 and "already holds" in taken.stderr and "another LABEL" in taken.stderr
    assert not (dest / "runs" / "vllm-verdict-4c49f35f-r3").exists()
    nowhere = _import("--add", "lease2", str(later), "gpu-h200-learning", str(tmp_path / "none"))
    assert nowhere.returncode == 2 and "holds no runs to add to" in nowhere.stderr
    assert not (tmp_path / "none").exists()
    odd = _import("--add", "../x", str(later), "gpu-h200-learning", str(dest))
    assert odd.returncode == 2 and "is not a plain word" in odd.stderr
    assert table != (dest / "steps.csv").read_text()  # the one good --add rendered anew
    assert set(before) <= {str(p.relative_to(dest)) for p in dest.rglob("*")}


def test_add_that_fails_half_way_leaves_the_folder_as_it_was(tarball: Path, tmp_path: Path) -> None:
    dest = tmp_path / "results" / "study"
    assert _import(str(tarball), "gpu-h200-learning", str(dest)).returncode == 0
    table = (dest / "steps.csv").read_text()
    later = _later_round(tmp_path, ("sglang-verdict-795e3683-r3",))
    env = {**os.environ, "HYBRIDRL_PYTHON": "/bin/false"}
    done = subprocess.run(["bash", str(IMPORT), "--add", "lease2", str(later), "gpu-h200-learning", str(dest)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0
    assert not dest.with_name("study.partial").exists() and (dest / "steps.csv").read_text() == table
    assert not (dest / "runs" / "sglang-verdict-795e3683-r3").exists()
