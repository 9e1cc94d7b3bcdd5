"""The artifact archive (pack, manifest, verify) and the provenance record."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from hybridrl.run import provenance
from hybridrl.study.run_config import RunConfig
from hybridrl.tools.archive import MANIFEST, ArchiveError, pack, verify

RUN = "results/runs/vllm-split-aaaa1111"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A tiny repository tree: a study config, a lock file and a results directory with one run."""
    root = tmp_path / "repo"
    files = {
        "config/smoke.yaml": "name: smoke\n",
        "requirements/cpu.txt": "numpy==2.0\n",
        f"{RUN}/steps.jsonl": '{"step": 1}\n{"step": 2}\n',
        f"{RUN}/provenance.json": '{"git": {"commit": "abc"}}\n',
        f"{RUN}/config.json": '{"engine": "vllm"}\n',
        f"{RUN}/logs/engine.log": "ready\n",
        f"{RUN}/adapters/step_000001/adapter_model.safetensors": "weights",
        f"{RUN}/.steps.jsonl.123.tmp": "half-written",
        "results/steps.csv": "run_id,step\n",
        "results/report.md": "# report\n",
        "results/plots/throughput.png": "png",
        "results/archive/old.tar.gz": "an older archive",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _pack(root: Path, out: Path) -> Path:
    return pack(root / "results", [root / "config" / "smoke.yaml"], out, root=root)


def _names(tar_path: Path) -> list[str]:
    with tarfile.open(tar_path) as tar:
        return tar.getnames()


def _rewrite(src: Path, dst: Path, edit: dict[str, bytes | None],
             add: dict[str, bytes] | None = None) -> None:
    """Copy an archive, replacing (bytes) or dropping (None) members and appending new ones."""
    with tarfile.open(src) as tar_in, tarfile.open(dst, "w:gz") as tar_out:
        for member in tar_in.getmembers():
            data = tar_in.extractfile(member).read()
            rel = member.name.split("/", 1)[1]
            if rel in edit:
                if edit[rel] is None:
                    continue
                data = edit[rel]
                member.size = len(data)
            tar_out.addfile(member, io.BytesIO(data))
        for rel, data in (add or {}).items():
            info = tarfile.TarInfo(f"{member.name.split('/')[0]}/{rel}")
            info.size = len(data)
            tar_out.addfile(info, io.BytesIO(data))


def test_pack_holds_results_configs_locks_and_manifest(repo: Path, tmp_path: Path) -> None:
    out = _pack(repo, tmp_path / "out" / "smoke-study.tar.gz")
    names = _names(out)
    assert names == sorted(names[:-1]) + ["smoke-study/MANIFEST.sha256"]  # sorted, manifest last
    rel = {n.split("/", 1)[1] for n in names}
    assert {f"{RUN}/steps.jsonl", f"{RUN}/provenance.json", f"{RUN}/config.json", f"{RUN}/logs/engine.log",
            "results/steps.csv", "results/report.md", "results/plots/throughput.png",
            "config/smoke.yaml", "requirements/cpu.txt", MANIFEST} == rel
    # adapter weights, temp files and earlier archives stay out
    assert not [n for n in names if "adapters" in n or n.endswith(".tmp") or "/archive/" in n]
    assert verify(out) == []
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]


def test_manifest_is_sha256sum_format(repo: Path, tmp_path: Path) -> None:
    out = _pack(repo, tmp_path / "a.tar.gz")
    with tarfile.open(out) as tar:
        manifest = tar.extractfile(f"a/{MANIFEST}").read().decode()
    lines = dict(reversed(line.split("  ", 1)) for line in manifest.splitlines())
    expected = hashlib.sha256((repo / RUN / "steps.jsonl").read_bytes()).hexdigest()
    assert lines[f"{RUN}/steps.jsonl"] == expected
    assert len(lines) == len(_names(out)) - 1


def test_same_inputs_give_same_bytes(repo: Path, tmp_path: Path) -> None:
    first = _pack(repo, tmp_path / "one" / "study.tar.gz").read_bytes()
    for path in (repo / "results").rglob("*"):  # new mtimes must not change the archive
        os.utime(path, (1_800_000_000, 1_800_000_000))
    second = _pack(repo, tmp_path / "two" / "study.tar.gz").read_bytes()
    assert first == second
    (repo / RUN / "steps.jsonl").write_text('{"step": 1}\n')
    assert _pack(repo, tmp_path / "three" / "study.tar.gz").read_bytes() != first
    with gzip.open(tmp_path / "one" / "study.tar.gz") as gz:
        assert gz.read(1)  # a valid gzip stream


def test_verify_detects_modified_member(repo: Path, tmp_path: Path) -> None:
    out = _pack(repo, tmp_path / "s.tar.gz")
    bad = tmp_path / "tampered.tar.gz"
    _rewrite(out, bad, {f"{RUN}/steps.jsonl": b'{"step": 1, "perf/throughput": 1e9}\n'})
    assert verify(bad) == [f"modified: {RUN}/steps.jsonl does not match its sha256 in the manifest"]


def test_verify_detects_missing_and_extra_members(repo: Path, tmp_path: Path) -> None:
    out = _pack(repo, tmp_path / "s.tar.gz")
    bad = tmp_path / "bad.tar.gz"
    _rewrite(out, bad, {"results/report.md": None}, add={"results/sneaky.txt": b"x"})
    problems = verify(bad)
    assert any(p.startswith("missing: results/report.md") for p in problems)
    assert any(p.startswith("extra: results/sneaky.txt") for p in problems)
    assert len(problems) == 2


def test_verify_without_manifest_or_archive(repo: Path, tmp_path: Path) -> None:
    out = _pack(repo, tmp_path / "s.tar.gz")
    bad = tmp_path / "nomanifest.tar.gz"
    _rewrite(out, bad, {MANIFEST: None})
    assert verify(bad) == [f"no {MANIFEST} in the archive"]
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tarball")
    with pytest.raises(ArchiveError, match=f"^{junk}: not a tar archive"):
        verify(junk)
    truncated = tmp_path / "trunc.tar.gz"
    truncated.write_bytes(out.read_bytes()[: len(out.read_bytes()) // 2])
    assert verify(truncated)[0].startswith("cannot read")


def test_pack_rejects_missing_inputs(repo: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        pack(repo / "results", [repo / "config" / "nope.yaml"], tmp_path / "x.tar.gz", root=repo)
    with pytest.raises(ValueError, match=r"\.tar\.gz"):
        pack(repo / "results", [], tmp_path / "x.zip", root=repo)
    assert not list(tmp_path.glob("x.*"))


def test_verify_answers_a_file_that_is_no_archive_in_one_line(repo: Path, tmp_path: Path, capsys) -> None:
    from hybridrl.cli import main

    text = repo / "config" / "smoke.yaml"
    assert main(["verify", str(text)]) == 1
    assert capsys.readouterr().err == (f"hybridrl: ArchiveError: {text}: not a tar archive (neither gzip, bzip2, xz "
                                       "nor plain tar)\n")
    assert main(["verify", str(tmp_path / "nope.tar.gz")]) == 2
    said = capsys.readouterr().err  # main()'s label for a missing input is its own
    assert said.startswith("hybridrl: ") and said.endswith(f"{tmp_path / 'nope.tar.gz'}: archive does not exist\n")
    assert said.count("\n") == 1


def test_pack_refuses_a_run_that_is_not_there(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "runs.tar.gz"
    with pytest.raises(ArchiveError, match=r"^--runs nosuch-run: no such run in .*/results/runs "
                                           r"\(runs there: vllm-split-aaaa1111\)$"):
        pack(repo / "results", [], out, root=repo, run_ids=["vllm-split-aaaa1111", "nosuch-run"])
    assert not list(tmp_path.glob("runs*"))
    pack(repo / "results", [], out, root=repo, run_ids=["vllm-split-aaaa1111"])
    assert f"runs/{RUN.rsplit('/', 1)[1]}" in " ".join(_names(out))


OTHER_RUN = "results/runs/sglang-split-bbbb2222"
STUDY_BENCH = {  # the study's measurements: an engine bench of its run with its logs, and a trainer bench
    "results/bench/vllm-split.json": "{}",
    "results/bench/vllm-split.slurm.json": "{}",
    "results/bench/bench-logs-vllm-split-aaaa1111/engine.log": "ready",
    "results/bench/trainer-tiny-hf-mb4.json": "{}",
}
NOT_THE_STUDY = {  # what a repository's results/ also holds: committed studies, their index, another study's work
    "results/README.md": "# every study\n",
    "results/reference/2026-11-23-cpu-smoke/steps.csv": "run_id,step\n",
    "results/reference/2026-11-23-cpu-smoke/runs/x/steps.jsonl": "{}\n",
    f"{OTHER_RUN}/steps.jsonl": "{}\n",
    "results/bench/sglang-split.json": "{}",
    "results/bench/sglang-split.slurm.json": "{}",
    "results/bench/bench-logs-sglang-split-bbbb2222/engine.log": "ready",
    "results/notes.txt": "someone's notes",
}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _rel_names(tar_path: Path) -> set[str]:
    return {n.split("/", 1)[1] for n in _names(tar_path)}


def test_a_study_archive_holds_that_study_and_nothing_else(repo: Path, tmp_path: Path) -> None:
    _write(repo, {**STUDY_BENCH, **NOT_THE_STUDY})
    out = pack(repo / "results", [repo / "config" / "smoke.yaml"], tmp_path / "smoke.tar.gz", root=repo,
               run_ids=["vllm-split-aaaa1111"], bench=["vllm-split", "trainer-tiny-hf-mb4"])
    assert _rel_names(out) == {f"{RUN}/steps.jsonl", f"{RUN}/provenance.json", f"{RUN}/config.json",
                               f"{RUN}/logs/engine.log", "results/steps.csv", "results/report.md",
                               "results/plots/throughput.png", "config/smoke.yaml", "requirements/cpu.txt", MANIFEST,
                               *STUDY_BENCH}
    assert verify(out) == []


def test_an_archive_of_every_run_still_leaves_out_what_is_no_studys(repo: Path, tmp_path: Path) -> None:
    _write(repo, {**STUDY_BENCH, **NOT_THE_STUDY})
    names = _rel_names(_pack(repo, tmp_path / "all.tar.gz"))
    assert f"{OTHER_RUN}/steps.jsonl" in names and "results/bench/sglang-split.json" in names  # every run, bench
    assert not [n for n in names if n.startswith("results/reference/")]
    assert "results/README.md" not in names and "results/notes.txt" not in names


def test_the_cli_packs_the_runs_and_measurements_it_is_given(repo: Path, tmp_path: Path) -> None:
    from hybridrl.cli import main

    _write(repo, {**STUDY_BENCH, **NOT_THE_STUDY})
    out = tmp_path / "cli.tar.gz"
    assert main(["archive", "--results", str(repo / "results"), "--runs", "vllm-split-aaaa1111", "--bench",
                 "vllm-split", "--root", str(repo), "--out", str(out)]) == 0
    bench = {n for n in _rel_names(out) if n.startswith("results/bench/")}
    assert bench == {n for n in STUDY_BENCH if "trainer-" not in n}


def test_pack_refuses_a_measurement_that_is_not_there(repo: Path, tmp_path: Path) -> None:
    _write(repo, STUDY_BENCH)
    with pytest.raises(ArchiveError, match=r"^--bench vllm-splt: no such measurement in .*/results/bench "
                                           r"\(results there: trainer-tiny-hf-mb4, vllm-split\)$"):
        pack(repo / "results", [], tmp_path / "b.tar.gz", root=repo, bench=["vllm-split", "vllm-splt"])
    assert not list(tmp_path.glob("b.*"))


def test_verify_fails_on_an_extra_file_alone(repo: Path, tmp_path: Path) -> None:
    out = _pack(repo, tmp_path / "s.tar.gz")
    bad = tmp_path / "extra.tar.gz"
    _rewrite(out, bad, {}, add={"results/reference/2026-11-23-cpu-smoke/steps.csv": b"run_id,step\n"})
    assert verify(bad) == ["extra: results/reference/2026-11-23-cpu-smoke/steps.csv is in the archive but not in "
                           "the manifest"]


# -- provenance ---------------------------------------------------------------------------------------

def test_provenance_collect_and_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDRL_IMAGE_DIGEST", "sha256:feedface")
    run = RunConfig(model="tiny", engine="vllm", lr=1e-4)
    prov = provenance.collect(run, {"flags": ["--enable-lora"]})
    for key in ("git", "python", "packages", "host", "gpu", "container", "engine", "run_config"):
        assert key in prov
    assert set(prov["git"]) == {"commit", "dirty", "source_sha256"}
    assert prov["packages"]["numpy"]  # installed here
    assert "megatron-core" in prov["packages"] and "sglang" in prov["packages"]
    assert prov["container"]["image_digest"] == "sha256:feedface"
    assert prov["engine"] == {"flags": ["--enable-lora"]}
    path = tmp_path / "run" / "provenance.json"
    provenance.write(path, prov)
    recorded = json.loads(path.read_text())["run_config"]
    assert RunConfig.model_validate(recorded) == run and recorded["micro_batch"] == 8  # every key, resolved
    assert [p.name for p in path.parent.iterdir()] == ["provenance.json"]


def test_a_launcher_given_commit_wins_and_the_source_digest_follows_the_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDRL_GIT_COMMIT", "539848d")
    info = provenance.git_info()
    assert info["commit"] == "539848d" and info["dirty"] is None
    assert info["source_sha256"] == provenance.source_digest()
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not code")
    before = provenance.source_digest(tmp_path / "pkg")
    (tmp_path / "pkg" / "notes.txt").write_text("changed, still not code")
    assert provenance.source_digest(tmp_path / "pkg") == before
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 3\n")
    assert provenance.source_digest(tmp_path / "pkg") != before


def test_provenance_missing_package_and_image_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert provenance.package_versions(("no-such-package-hybridrl-test",)) == {
        "no-such-package-hybridrl-test": None}
    image = tmp_path / "vllm.sif"
    image.write_bytes(b"image bytes")
    monkeypatch.delenv("HYBRIDRL_IMAGE_DIGEST", raising=False)
    monkeypatch.delenv("SINGULARITY_CONTAINER", raising=False)
    monkeypatch.setenv("APPTAINER_CONTAINER", str(image))
    info = provenance.container_info()
    assert info["image_digest"] == "sha256:" + hashlib.sha256(b"image bytes").hexdigest()
    assert info["path"] == str(image)
