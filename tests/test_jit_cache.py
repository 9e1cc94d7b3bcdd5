"""Each engine family keeps FlashInfer's JIT builds in a workspace of its own (engines.jit_cache)."""

from pathlib import Path

import pytest

from hybridrl.engines import make_engine
from hybridrl.engines.jit_cache import WORKSPACE_VAR, with_jit_workspace
from hybridrl.study.run_config import RunConfig


def test_sglang_and_vllm_build_apart_and_vllms_two_engines_share_one(tmp_path: Path) -> None:
    spaces = {e: with_jit_workspace(e, {"python": "python3"}, {}, tmp_path)["env"][WORKSPACE_VAR]
              for e in ("sglang", "vllm", "vllm-inprocess")}
    assert spaces["sglang"] != spaces["vllm"] == spaces["vllm-inprocess"]
    assert spaces["sglang"] == str(tmp_path / ".cache" / "flashinfer-sglang")
    assert spaces["vllm"] == str(tmp_path)  # FlashInfer's default, where earlier leases' vLLM builds are


@pytest.mark.parametrize("where", ["study", "environment"])
def test_a_workspace_already_named_is_kept(tmp_path: Path, where: str) -> None:
    spec = {"python": "python3", "env": {"PYTHONPATH": "/tmp/envs/vllm"}}
    if where == "study":
        spec["env"][WORKSPACE_VAR] = "/scratch/fi"
    got = with_jit_workspace("vllm", spec, {WORKSPACE_VAR: "/scratch/fi"} if where == "environment" else {}, tmp_path)
    assert got["env"].get(WORKSPACE_VAR) == ("/scratch/fi" if where == "study" else None)
    assert got["env"]["PYTHONPATH"] == "/tmp/envs/vllm" and got["python"] == "python3"
    assert WORKSPACE_VAR not in spec["env"] or where == "study"  # the caller's spec is not changed


def test_an_engine_server_starts_with_its_familys_workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKSPACE_VAR, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    run = RunConfig(model="m", engine="sglang")
    engine = make_engine(run, tmp_path / "model", {"python": "python3"}, tmp_path / "logs")
    assert engine.extra_env[WORKSPACE_VAR] == str(tmp_path / ".cache" / "flashinfer-sglang")
