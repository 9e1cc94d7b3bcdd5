"""scripts/gpu/lease.sh: the parts of a lease fit the carry limit beside the tree; the results leave the tree and come
back as HEAD holds them; a pack leaves adapters and access lines behind; an import becomes a reference folder with
its table and report; bad input is one line and writes nothing."""

import gzip
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from test_report import write_run

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024
ACCESS = '127.0.0.1:5 - "POST /v1/completions HTTP/1.1" 200 OK\n'


def _lease(*args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess[str]:
    """The script of the repository at cwd (a scratch copy, or this checkout)."""
    return subprocess.run(["bash", str(cwd / "scripts" / "gpu" / "lease.sh"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HYBRIDRL_PYTHON": sys.executable, **env})


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def _repo(tmp: Path) -> Path:
    """A scratch repository with the script, one committed result and .gpu ignored."""
    repo = tmp / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    for script in ("lease.sh", "lease-caches.sh"):
        (repo / "scripts" / "gpu" / script).write_text((REPO / "scripts" / "gpu" / script).read_text())
    (repo / "results" / "reference" / "study").mkdir(parents=True)
    (repo / "results" / "reference" / "study" / "steps.csv").write_text("step,t\n1,2.5\n")
    (repo / ".gitignore").write_text("/.gpu/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    return repo


def _shared(tmp: Path, gpu: Path, stream: bytes) -> dict[str, str]:
    """A shared folder whose gpu-env and slurm-lease are never asked to download (their results are there)."""
    shared = tmp / "shared"
    (shared / "slurm").mkdir(parents=True)
    for tool in (shared / "gpu-env", shared / "slurm" / "slurm-lease"):
        tool.write_text("#!/bin/sh\necho should not download >&2; exit 9\n")
        tool.chmod(0o755)
    packed = gpu / "parts-vllm"
    packed.mkdir(parents=True)
    for i in range(0, len(stream), 7 * MiB):  # gpu-env's own cut, whatever it was
        (packed / f"part.{i // (7 * MiB):02d}").write_bytes(stream[i:i + 7 * MiB])
    for d in ("ctl", "slurm/debs", "slurm/whl"):
        (gpu / "start" / d).mkdir(parents=True)
    (gpu / "start" / "ctl" / "pydantic-2-py3-none-any.whl").write_bytes(b"w" * 1000)
    return {"HYBRIDRL_SHARED_GPU": str(shared), "HYBRIDRL_GPU_DIR": str(gpu)}


def test_parts_are_cut_so_that_each_call_fits_beside_the_tree(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    stream = os.urandom(40 * MiB)
    env = _shared(tmp_path, tmp_path / "gpu", stream)
    tree = sum(p.stat().st_size for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts)
    limit = tree + 4 * MiB + 3 * 1024 + 11 * MiB  # leaves 11 MiB a part after the margin (3 files)
    done = _lease("prepare", "vllm", cwd=repo, HYBRIDRL_CARRY_LIMIT=str(limit), **env)
    assert done.returncode == 0, done.stderr
    dirs = sorted((tmp_path / "gpu").glob("x[0-9][0-9]"))
    assert len(dirs) == 4  # 40 MiB in parts of at most 11 MiB
    parts = [next(d.glob("part.*")) for d in dirs]
    assert all(tree + p.stat().st_size + (p.parent / "gpu-env").stat().st_size <= limit for p in parts)
    assert b"".join(p.read_bytes() for p in parts) == stream  # gpu-env install joins them by name
    assert "call 1 carries .gpu/start; then x00 x01 x02 x03 one call each" in done.stdout
    assert (tmp_path / "gpu" / "start" / "slurm" / "kit" / "slurm-lease").exists()  # the kit travels in call 1
    small = _lease("prepare", "vllm", cwd=repo, HYBRIDRL_CARRY_LIMIT=str(tree + 8 * MiB), **env)
    assert small.returncode == 2 and "too little room for a part" in small.stderr and "lean off" in small.stderr


def test_trls_set_is_pinned_from_the_controllers_lock_and_packed_with_the_shared_ones(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / "requirements").mkdir()
    (repo / "requirements" / "controller.lock.txt").write_text(
        "pyarrow==26.0.1\ntorch==2.13.0\ntrl==1.16.0  # TRL's GRPOTrainer\ndatasets==5.2.0\n")
    env = _shared(tmp_path, tmp_path / "gpu", os.urandom(MiB))
    (tmp_path / "shared" / "vllm.txt").write_text("vllm==0.26.0\n")
    (tmp_path / "gpu" / "parts-vllm").rename(tmp_path / "gpu" / "parts-vllm-peer")
    done = _lease("prepare", "vllm", "peer", cwd=repo, **env)
    assert done.returncode == 0, done.stderr
    sets = tmp_path / "gpu" / "sets"
    assert (sets / "peer.txt").read_text().split() == ["pyarrow==26.0.1", "trl==1.16.0", "datasets==5.2.0"]
    assert (sets / "vllm.txt").exists() and (sets / "gpu-env").exists()  # gpu-env finds the sets beside itself
    (tmp_path / "gpu" / "parts-vllm-peer").rename(tmp_path / "gpu" / "parts-vllm")
    assert _lease("prepare", "vllm", cwd=repo, **env).returncode == 0
    assert not (sets / "peer.txt").exists()  # asked only where named


def test_lean_off_takes_the_results_out_of_what_travels_and_on_restores_head(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    env = {"HYBRIDRL_GPU_DIR": str(repo / ".gpu")}
    assert _lease("lean", "off", cwd=repo, **env).returncode == 0
    assert set(_git(repo, "ls-files", "--cached", "--others", "--exclude-standard").split()) == {
        ".gitignore", "scripts/gpu/lease.sh", "scripts/gpu/lease-caches.sh"}
    again = _lease("lean", "off", cwd=repo, **env)
    assert again.returncode == 2 and "the results are off already" in again.stderr
    done = _lease("lean", "on", cwd=repo, **env)
    assert done.returncode == 0, done.stderr
    assert _git(repo, "status", "--porcelain") == ""
    assert (repo / "results" / "reference" / "study" / "steps.csv").read_text() == "step,t\n1,2.5\n"
    (repo / "results" / "reference" / "study" / "steps.csv").write_text("changed\n")
    dirty = _lease("lean", "off", cwd=repo, **env)
    assert dirty.returncode == 2 and "uncommitted changes" in dirty.stderr


def _machine(tmp: Path, runs: tuple[str, ...], seed: int = 0) -> Path:
    """The study's working directory on the machine, as Snakemake leaves it."""
    work = tmp / "work"
    for i, rid in enumerate(runs):
        run = write_run(work / "results", rid, rid.split("-")[0], "colocate", seed=seed + i)
        (run / "config.json").write_text(json.dumps({"run_id": rid}) + "\n")
        (run / "requests").mkdir()
        (run / "requests" / "step-0001.jsonl").write_text(json.dumps({"request": 0, "tokens": 5}) + "\n")
        (run / "adapters" / "step-1").mkdir(parents=True)
        (run / "adapters" / "step-1" / "adapter_config.json").write_text("{}")
        (run / "logs").mkdir()
        (run / "logs" / "engine.log").write_text("started\n" + ACCESS * 3 + "slept\n")
    (work / "results" / "bench").mkdir(parents=True)
    (work / "results" / "bench" / "sglang-verdict.json").write_text('{"repeats": 5}\n')
    model = work / "resources" / "models" / "qwen3-0.6b-warm"
    model.mkdir(parents=True)
    (model / "warm_start.json").write_text(json.dumps({"base_accuracy": 0.44 + seed / 100}) + "\n")
    (model / "config.json").write_text("{}")
    (work / "logs" / "slurm").mkdir(parents=True)
    (work / "logs" / "slurm" / "job.log").write_text(f"lease {seed}\n")
    (work / "snakemake.log").write_text("Finished\n")
    (work / "command.txt").write_text("+ snakemake --profile slurm\n")
    return work


def _pack(work: Path, out: Path) -> Path:
    done = _lease("pack", str(out), HYBRIDRL_LEASE_WORK=str(work))
    assert done.returncode == 0, done.stderr
    return out


def test_a_pack_holds_the_results_without_adapters_models_or_access_lines(tmp_path: Path) -> None:
    tarball = _pack(_machine(tmp_path, ("sglang-verdict-795e3683",)), tmp_path / "latest.tar.gz")
    with tarfile.open(tarball) as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
        log = tar.extractfile("./results/runs/sglang-verdict-795e3683/logs/engine.log").read().decode()
    assert "results/runs/sglang-verdict-795e3683/steps.jsonl" in names
    assert "results/bench/sglang-verdict.json" in names and "resources/models/qwen3-0.6b-warm/warm_start.json" in names
    assert not any("adapters" in n or n.endswith("models/qwen3-0.6b-warm/config.json") for n in names)
    assert log == "started\nslept\n"


def test_an_import_becomes_a_reference_folder_and_a_later_lease_adds_to_it(tmp_path: Path) -> None:
    work = _machine(tmp_path / "a", ("sglang-verdict-795e3683", "vllm-verdict-4c49f35f", "sglang-verdict-8e3c1d2a"))
    (work / "results" / "runs" / "sglang-verdict-8e3c1d2a" / "steps.jsonl").unlink()  # died in its first step
    first = _pack(work, tmp_path / "a.tgz")
    dest = tmp_path / "results" / "2026-11-28-h100-verdict"
    done = _lease("import", str(first), str(dest))
    assert done.returncode == 0, done.stderr
    assert "(2 runs with steps); commit it now" in done.stdout and not dest.with_name(f"{dest.name}.partial").exists()
    records = dest / "runs" / "sglang-verdict-795e3683" / "requests"
    assert [p.name for p in records.iterdir()] == ["step-0001.jsonl.gz"]  # compacted
    assert json.loads(gzip.decompress((records / "step-0001.jsonl.gz").read_bytes())) == {"request": 0, "tokens": 5}
    died = dest / "runs" / "sglang-verdict-8e3c1d2a"  # kept with its logs, its requests compacted, not aggregated
    assert [p.name for p in (died / "requests").iterdir()] == ["step-0001.jsonl.gz"] and (died / "logs").is_dir()
    assert json.loads((dest / "models" / "qwen3-0.6b-warm" / "warm_start.json").read_text()) == {"base_accuracy": 0.44}
    assert (dest / "bench" / "sglang-verdict.json").exists() and (dest / "logs" / "snakemake.log").exists()
    assert len((dest / "steps.csv").read_text().splitlines()) == 1 + 2 * 8
    assert "# hybridrl study" in (dest / "report.md").read_text()
    later_work = _machine(tmp_path / "b", ("sglang-verdict-795e3683-r3",), seed=1)
    (later_work / "results" / "bench" / "sglang-verdict.json").rename(later_work / "results" / "bench" / "b.json")
    held = dest / "runs" / "sglang-verdict-795e3683"  # a measurement's input there: its run's config only, the same
    (later_work / "results" / "runs" / held.name).mkdir()
    (later_work / "results" / "runs" / held.name / "config.json").write_text(
        json.dumps({"run_id": held.name, "run": {"a_key_added_since": True}})
    )
    later = _pack(later_work, tmp_path / "b.tgz")
    added = _lease("import", str(later), str(dest), "lease2")
    assert added.returncode == 0, added.stderr
    assert len((dest / "steps.csv").read_text().splitlines()) == 1 + 3 * 8  # every run in one table
    assert (dest / "logs" / "lease2" / "slurm" / "job.log").read_text() == "lease 1\n"
    assert (dest / "logs" / "slurm" / "job.log").read_text() == "lease 0\n"  # the first lease's, untouched
    assert sorted(p.name for p in (dest / "bench").iterdir()) == ["b.json", "sglang-verdict.json"]
    assert (held / "steps.jsonl").exists() and (held / "requests").is_dir()  # the first lease's run, untouched


@pytest.mark.parametrize("case", ["exists", "not_tar", "missing", "run_twice", "config_differs", "bench_twice",
                                  "usage"])
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path: Path, case: str) -> None:
    tarball = _pack(_machine(tmp_path, ("sglang-verdict-795e3683",)), tmp_path / "t.tgz")
    dest = tmp_path / "out" / "study"
    if case == "exists":
        dest.mkdir(parents=True)
        (dest / "README.md").write_text("kept\n")
        done, want = _lease("import", str(tarball), str(dest)), "exists: nothing written"
    elif case == "not_tar":
        (tmp_path / "x.tgz").write_text("no")
        done, want = _lease("import", str(tmp_path / "x.tgz"), str(dest)), "is not a poll's gzipped tar"
    elif case == "missing":
        done, want = _lease("import", str(tmp_path / "none.tgz"), str(dest)), "no file"
    elif case == "run_twice":
        assert _lease("import", str(tarball), str(dest)).returncode == 0
        before = (dest / "steps.csv").read_text()
        done, want = _lease("import", str(tarball), str(dest), "lease2"), "holds sglang-verdict-795e3683 already"
        assert (dest / "steps.csv").read_text() == before and not (dest / "logs" / "lease2").exists()
    elif case == "config_differs":  # a run's config alone, but of another run id than the held run's
        assert _lease("import", str(tarball), str(dest)).returncode == 0
        later_work = _machine(tmp_path / "b", ("sglang-verdict-795e3683-r2",), seed=1)
        (later_work / "results" / "bench" / "sglang-verdict.json").unlink()
        (later_work / "results" / "runs" / "sglang-verdict-795e3683").mkdir()
        (later_work / "results" / "runs" / "sglang-verdict-795e3683" / "config.json").write_text('{"run_id": "x"}\n')
        later = _pack(later_work, tmp_path / "b.tgz")
        done, want = _lease("import", str(later), str(dest), "lease2"), "holds sglang-verdict-795e3683 already"
        assert not (dest / "runs" / "sglang-verdict-795e3683-r2").exists() and not (dest / "logs" / "lease2").exists()
    elif case == "bench_twice":  # a later lease that measured the same bench again: the first record stays
        assert _lease("import", str(tarball), str(dest)).returncode == 0
        (dest / "bench" / "sglang-verdict.json").write_text('{"repeats": 7}\n')
        later_work = _machine(tmp_path / "b", ("sglang-verdict-795e3683-r2",), seed=1)
        later = _pack(later_work, tmp_path / "b.tgz")
        done, want = _lease("import", str(later), str(dest), "lease2"), "holds bench/sglang-verdict.json already"
        assert (dest / "bench" / "sglang-verdict.json").read_text() == '{"repeats": 7}\n'
        assert not (dest / "runs" / "sglang-verdict-795e3683-r2").exists() and not (dest / "logs" / "lease2").exists()
    else:
        done, want = _lease("import", str(tarball)), "usage: lease.sh import TARBALL NAME [LABEL]"
    assert done.returncode == 2 and want in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert case in ("exists", "run_twice", "config_differs", "bench_twice") or not dest.exists()
    assert not dest.with_name("study.partial").exists()


def _home_with_caches(home: Path, sizes: dict[str, int]) -> None:
    """An engine machine's $HOME whose caches hold random (incompressible) files of these sizes."""
    for d, n in sizes.items():
        (home / d).mkdir(parents=True)
        (home / d / "kernel.bin").write_bytes(os.urandom(n))


def test_the_caches_come_back_in_numbered_pieces_over_as_many_calls_as_they_need(tmp_path: Path) -> None:
    home, stage = tmp_path / "home", tmp_path / "stage"
    _home_with_caches(home, {".cache/flashinfer": 20 * MiB, ".cache/vllm": 26 * MiB, ".cache/tvm-ffi": 4 * MiB,
                             ".triton/cache": 9 * MiB, ".nv/ComputeCache": 2 * MiB})
    env = {"HOME": str(home), "HYBRIDRL_LEASE_CACHES_OUT": str(stage)}
    calls, said = [tmp_path / f"call{i}" for i in range(3)], []
    for i, out in enumerate(calls):  # the last poll's call brings 3, each caches-back call 4 more
        out.mkdir()
        done = _lease("caches-back", str(out), *(["3"] if i == 0 else []), **env)
        assert done.returncode == 0, done.stderr
        said.append(done.stdout)
    assert "cache .cache/vllm: 26" in said[0] and "3 of 4 sent; 1 left" in said[0]  # sizes once, when packed
    assert "cache .cache/tvm-ffi: 4" in said[0]  # sgl-kernel's JIT builds travel too
    assert "not carried: .nv/ComputeCache: 2" in said[0] and ".cache/torch:" not in said[0]  # named, left behind
    got = [sorted(p.name for p in out.iterdir()) for out in calls]
    assert got == [["caches-000-of-004.part", "caches-001-of-004.part", "caches-002-of-004.part"],
                   ["caches-003-of-004.part"], []]  # 59 MiB of random bytes: four pieces
    assert all(p.stat().st_size <= 15 * MiB for out in calls for p in out.iterdir())  # a call returns 16 MiB files
    assert "all sent" in done.stdout
    gpu = tmp_path / "gpu"
    missing = _lease("join-caches", str(calls[0]), HYBRIDRL_GPU_DIR=str(gpu))
    assert missing.returncode == 2 and "3 of 4 pieces" in missing.stderr and not gpu.exists()
    joined = _lease("join-caches", *map(str, calls), HYBRIDRL_GPU_DIR=str(gpu))
    assert joined.returncode == 0, joined.stderr
    with tarfile.open(gpu / "caches.tar.gz") as tar:
        names = {n for n in tar.getnames() if n.endswith("kernel.bin")}
        vllm = tar.extractfile(".cache/vllm/kernel.bin").read()
    assert names == {".cache/flashinfer/kernel.bin", ".cache/tvm-ffi/kernel.bin", ".cache/vllm/kernel.bin",
                     ".triton/cache/kernel.bin"}
    assert vllm == (home / ".cache/vllm/kernel.bin").read_bytes()


def test_the_engines_caches_a_poll_packed_travel_with_the_next_lease(tmp_path: Path) -> None:
    tarball = _pack(_machine(tmp_path / "a", ("sglang-verdict-795e3683",)), tmp_path / "a.tgz")
    (tmp_path / "caches-000-of-002.part").write_bytes(b"cach")  # the pieces the last poll packed beside the results
    (tmp_path / "caches-001-of-002.part").write_bytes(b"es")
    gpu = tmp_path / "gpu"
    done = _lease("import", str(tarball), str(tmp_path / "study"), HYBRIDRL_GPU_DIR=str(gpu))
    assert done.returncode == 0, done.stderr
    assert (gpu / "caches.tar.gz").read_bytes() == b"caches"
    repo = _repo(tmp_path)
    env = _shared(tmp_path, gpu, os.urandom(2 * MiB))
    assert _lease("prepare", "vllm", cwd=repo, **env).returncode == 0
    assert (gpu / "start" / "caches.tar.gz").read_bytes() == b"caches"  # call 1 carries them
    big = os.urandom(25 * MiB)  # more than call 1 has room for beside the kit: transfer parts of their own
    (gpu / "caches.tar.gz").write_bytes(big)
    tree = sum(p.stat().st_size for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts)
    done = _lease("prepare", "vllm", cwd=repo, HYBRIDRL_CARRY_LIMIT=str(tree + 4 * MiB + 3 * 1024 + 11 * MiB), **env)
    assert done.returncode == 0, done.stderr
    assert not (gpu / "start" / "caches.tar.gz").exists()
    assert "then x00 x01 x02 x03 one call each" in done.stdout  # one overlay part, then three of the caches
    pieces = [next((gpu / f"x{i:02d}").glob("cache.*")) for i in (1, 2, 3)]
    assert b"".join(p.read_bytes() for p in pieces) == big
    stage = tmp_path / "stage"
    for d in ("x01", "x02"):  # on the machine: a cache part gathers beside the others, no overlay is collected
        moved = _lease("transfer", str(gpu / d), cwd=repo, HYBRIDRL_LEASE_CACHES=str(stage))
        assert moved.returncode == 0, moved.stderr
    assert sorted(p.name for p in stage.iterdir()) == ["cache.01", "cache.02"]


def test_the_last_transfer_unpacks_the_caches_into_home_before_the_jobs_start(tmp_path: Path) -> None:
    made, gpu = tmp_path / "made", tmp_path / "gpu"
    _home_with_caches(made, {".cache/flashinfer": 3 * MiB})
    whole = gpu / "caches.tar.gz"
    gpu.mkdir()
    subprocess.run(["tar", "czf", str(whole), "-C", str(made), ".cache/flashinfer"], check=True)
    for i, piece in enumerate((whole.read_bytes()[:MiB], whole.read_bytes()[MiB:])):
        (gpu / f"x{i:02d}").mkdir()
        (gpu / f"x{i:02d}" / f"cache.{i:02d}").write_bytes(piece)
        (gpu / f"x{i:02d}" / "gpu-env").write_text(  # installs one source file, as pip would: written now
            '#!/bin/sh\n[ "$1" != install ] || { mkdir -p "$HYBRIDRL_LEASE_ENVS/vllm" && echo x > '
            '"$HYBRIDRL_LEASE_ENVS/vllm/norm.cu"; }\n')
    home, envs = tmp_path / "home", tmp_path / "envs"
    home.mkdir()
    envs.mkdir()
    env = {"HOME": str(home), "HYBRIDRL_LEASE_CACHES": str(tmp_path / "stage"), "HYBRIDRL_LEASE_ENVS": str(envs)}
    assert _lease("transfer", str(gpu / "x00"), **env).returncode == 0
    assert not (home / ".cache").exists()  # not before the last part
    done = _lease("transfer", str(gpu / "x01"), "install", **env)
    assert done.returncode == 0, done.stderr
    assert (home / ".cache/flashinfer/kernel.bin").read_bytes() == (made / ".cache/flashinfer/kernel.bin").read_bytes()
    assert (envs / ".ready").exists()  # and the jobs may start
    # the overlay's sources are older than the carried kernels built from them, so ninja does not rebuild those
    assert (envs / "vllm" / "norm.cu").stat().st_mtime == 946684800
    assert (home / ".cache/flashinfer/kernel.bin").stat().st_mtime > 946684800


def _live_snakemake(tmp: Path, work: Path, queue: str | None) -> dict[str, str]:
    """A work dir whose Snakemake still runs (a sleeping process) and a `squeue` that prints `queue` (None: fails)."""
    (work / "env.sh").write_text("")
    sleeper = subprocess.Popen(["sleep", "120"])
    (work / "snakemake.pid").write_text(str(sleeper.pid))
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    body = "exit 1" if queue is None else f"printf '{queue}'"
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / "squeue").chmod(0o755)
    return {"HYBRIDRL_LEASE_WORK": str(work), "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp / "home"),
            "HYBRIDRL_LEASE_CACHES_OUT": str(tmp / "stage"), "HYBRIDRL_POLL_WAIT_S": "1", "_pid": str(sleeper.pid)}


@pytest.mark.parametrize("case", ["all_done", "one_missing", "bench_missing", "queued", "queue_unread", "no_targets"])
def test_a_poll_returns_once_every_target_is_done_and_the_queue_is_empty(tmp_path: Path, case: str) -> None:
    runs = ("sglang-verdict-795e3683", "vllm-verdict-4c49f35f")
    work = _machine(tmp_path, runs)
    targets = " ".join(f"results/runs/{r}/done.json" for r in runs)
    targets += " results/bench/trainer-x.json" if case == "bench_missing" else " results/bench/sglang-verdict.json"
    (work / "command.txt").write_text(f"+ snakemake --retries 0 {targets if case != 'no_targets' else ''} "
                                      "--profile slurm --configfile config/gpu-writeup.yaml\n")
    for r in runs[: 1 if case == "one_missing" else 2]:
        (work / "results" / "runs" / r / "done.json").write_text("{}")
    env = _live_snakemake(tmp_path, work, {"queued": "17\n", "queue_unread": None}.get(case, ""))
    pid = int(env.pop("_pid"))
    out = tmp_path / "out"
    out.mkdir()
    try:
        # one round: where the poll cannot tell the study is done, it waits out its round (a minute on a lease)
        done = subprocess.run(["bash", str(REPO / "scripts" / "gpu" / "lease.sh"), "poll", str(out), "1"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    finally:
        os.kill(pid, 9)
    assert done.returncode == 0, done.stderr
    if case == "all_done":
        assert "every target done and the queue empty" in done.stdout
        assert "caches:" in done.stdout  # the caches go back now, not after Snakemake's late notice
    else:
        assert "== snakemake running" in done.stdout and "caches:" not in done.stdout
    assert (out / "latest.tar.gz").exists()


@pytest.mark.parametrize("case", ["done", "queued"])
def test_a_second_start_is_refused_while_a_study_command_runs_and_stop_ends_it_once_done(tmp_path: Path,
                                                                                        case: str) -> None:
    """On a warm machine a second `start` would empty the first command's folder: it is refused while that Snakemake
    runs, and `stop` ends it only once every target is done and nothing is queued."""
    work = _machine(tmp_path, ("sglang-verdict-795e3683",))
    (work / "results" / "runs" / "sglang-verdict-795e3683" / "done.json").write_text("{}")
    (work / "command.txt").write_text("+ snakemake results/runs/sglang-verdict-795e3683/done.json --profile slurm\n")
    env = _live_snakemake(tmp_path, work, "" if case == "done" else "17\n")
    pid = int(env.pop("_pid"))
    try:
        again = _lease("start", "config/gpu-peer.yaml", **env)
        assert again.returncode == 2 and f"a study command still runs in {work} (pid {pid})" in again.stderr
        assert (work / "results" / "runs" / "sglang-verdict-795e3683" / "done.json").exists()  # nothing emptied
        stopped = _lease("stop", **env, HYBRIDRL_STOP_WAIT_S="2")  # here the killed sleeper lingers as a zombie
        if case == "done":
            assert stopped.returncode == 0 and f"stopped the study command (pid {pid})" in stopped.stdout
            subprocess.run(["sleep", "0.2"], check=True)
            assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0
        else:
            assert stopped.returncode == 2 and "still has targets to make or jobs queued" in stopped.stderr
            assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0
    finally:
        subprocess.run(["kill", "-9", str(pid)], capture_output=True)
