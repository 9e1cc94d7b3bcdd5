"""The GPU lease driver (scripts/gpu/run_reference.sh): plans, lanes and snapshots, in dry-run mode."""

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "scripts" / "gpu" / "run_reference.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _driver(ref: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HYBRIDRL_REF_DIR": str(ref), "HYBRIDRL_DRY_RUN": "1"}
    return subprocess.run(["bash", str(DRIVER), *args], capture_output=True, text=True, env=env, timeout=120)


def _items(text: str) -> list[str]:
    return [line.split("dry run: ", 1)[1].strip() for line in text.splitlines() if "dry run: " in line]


@pytest.fixture
def ref(tmp_path: Path) -> Path:
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "steps.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "setup.done").touch()
    return tmp_path


def test_rest_plan_runs_lanes_on_their_gpus_then_the_two_gpu_runs(ref: Path) -> None:
    done = _driver(ref, "all", "rest")
    assert done.returncode == 0, done.stderr
    assert _items((ref / "lane0.log").read_text()) == [
        "train sglang-restart on GPU 0", "train vllm-inprocess-restart on GPU 0",
        "train sglang-colocate-megatron on GPU 0",
        "bench sglang-colocate-megatron step 3 on GPU 0 --set sglang_release=all"]
    assert _items((ref / "lane1.log").read_text()) == [
        "train vllm-restart on GPU 1", "train vllm-colocate-megatron on GPU 1", "train vllm-colocate on GPU 1",
        "bench vllm-colocate step 3 on GPU 1"]
    # the runs that need both GPUs come after both lanes, in the plan's order
    assert _items(done.stdout) == ["train sglang-colocate-megatron-tp2 on GPU 0,1",
                                               "train vllm-colocate-megatron-tp2 on GPU 0,1",
                                               "train vllm-split on GPU 1,0"]
    # a snapshot of what finished is there to copy out after every item
    with tarfile.open(ref / "latest.tar.gz") as tar:
        assert "ref/runs/r1/steps.jsonl" in tar.getnames()


def test_unknown_plan_and_missing_setup_are_clear_errors(ref: Path) -> None:
    bad = _driver(ref, "all", "nope")
    assert bad.returncode == 2 and "no plan named nope" in bad.stderr
    (ref / "setup.done").unlink()
    assert "run setup first" in _driver(ref, "all", "rest").stderr
