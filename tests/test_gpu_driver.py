"""The GPU lease driver: the plans, scheduler and items in Python (src/hybridrl/tools/lease), called in-process,
and scripts/gpu/run_reference.sh's CLI and glue (start, all, plans, status, poll, pack, prepare), in dry-run mode."""

import dataclasses
import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from unittest import mock

import pytest

from hybridrl.study.run_config import split_replicate
from hybridrl.tools.lease import plans
from hybridrl.tools.lease.driver import Lease, Refused, check, run_plan, runs_of
from hybridrl.tools.lease.items import Bench, Fault, Train, TrainerTool, parse_item
from hybridrl.tools.lease.plan import interleave, one_lane, tool_rounds
from hybridrl.tools.lease.runners import ItemFailed, Site, run_item

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "scripts" / "gpu" / "run_reference.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _driver(root: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    # this Python as python3: the driver lists a plan's study's runs through `python3 -m hybridrl`
    env = {**_python3_on_path(root.parent), "HYBRIDRL_REF_DIR": str(root), "HYBRIDRL_DRY_RUN": "1", **extra}
    return subprocess.run(["bash", str(DRIVER), *args], capture_output=True, text=True, env=env, timeout=120)


def _items(log: Path) -> list[str]:
    return [line.split("dry run: ", 1)[1].strip() for line in log.read_text().splitlines() if "dry run: " in line]


def _dry_run(root: Path, plan: str, repo: Path = REPO, **env: str) -> str:
    """A plan's dry run in this process (run_reference.sh all PLAN's Python half); its console output."""
    out = io.StringIO()
    with mock.patch.dict(os.environ, {"HYBRIDRL_REF_DIR": str(root), **env}):
        run_plan(Lease(repo, root, dry_run=True), plan, out)
    return out.getvalue()


def _one_lane_plan(root: Path, study: str, plan: str, **env: str) -> list[str]:
    """The items of a one-lane plan's dry run, its study marked as set up."""
    (root / study).mkdir(exist_ok=True)
    (root / study / "setup.done").touch()
    _dry_run(root, plan, **env)
    return _items(root / study / f"lane-{plan}-1.log")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Two studies set up, one finished run in the dense one."""
    (tmp_path / "gpu-h200" / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "gpu-h200" / "runs" / "r1" / "steps.jsonl").write_text('{"step": 1}\n')
    for study in ("gpu-h200", "gpu-2xh200-moe"):
        (tmp_path / study).mkdir(exist_ok=True)
        (tmp_path / study / "setup.done").touch()
    return tmp_path


def test_rest_plan_runs_lanes_on_their_gpus_then_the_two_gpu_runs(root: Path) -> None:
    done = _driver(root, "all", "rest")
    assert done.returncode == 0, done.stderr
    study = root / "gpu-h200"
    assert _items(study / "lane-rest-1.log") == [
        "train sglang-restart on GPU 0", "train vllm-inprocess-restart on GPU 0",
        "train sglang-colocate-megatron on GPU 0",
        "bench sglang-colocate-megatron step 3 on GPU 0 --set sglang_release=all"]
    assert _items(study / "lane-rest-2.log") == [
        "train vllm-restart on GPU 1", "train vllm-colocate-megatron on GPU 1", "train vllm-colocate on GPU 1",
        "bench vllm-colocate step 3 on GPU 1"]
    # the runs that need both GPUs start only after both single-GPU lanes are through
    assert done.stdout.index("p1 done") < done.stdout.index("lane 3: 0,1")
    assert _items(study / "lane-rest-3.log") == [
        "train sglang-colocate-megatron-tp2 on GPU 0,1", "train vllm-colocate-megatron-tp2 on GPU 0,1",
        "train vllm-split on GPU 1,0"]
    # a snapshot of what finished, every study, is there to copy out after every item
    with tarfile.open(root / "latest.tar.gz") as tar:
        assert "ref/gpu-h200/runs/r1/steps.jsonl" in tar.getnames()


def test_four_gpu_plans_run_after_each_other_on_their_own_studies(root: Path) -> None:
    done = _driver(root, "plans", "rest4", "moe4")
    assert done.returncode == 0, done.stderr
    assert done.stdout.index("plan rest4, config/gpu-h200.yaml") < done.stdout.index(
        "plan moe4, config/gpu-2xh200-moe.yaml")
    dense, moe = root / "gpu-h200", root / "gpu-2xh200-moe"
    # each restart run has a GPU of its own; the two-GPU runs use the pairs
    assert _items(dense / "lane-rest4-1.log") == ["train sglang-restart on GPU 0"]
    assert _items(dense / "lane-rest4-3.log")[0] == "train vllm-inprocess-restart on GPU 2"
    assert _items(dense / "lane-rest4-6.log") == ["train vllm-colocate-megatron-tp2 on GPU 2,3"]
    # one MoE run a lane: the colocate trio, then the split pair, each phase behind one start barrier
    assert [_items(moe / f"lane-moe4-{n}.log") for n in range(1, 7)] == [
        ["train sglang-colocate-megatron on GPU 0"], ["train vllm-colocate-megatron on GPU 1"],
        ["train vllm-inprocess-colocate-megatron on GPU 2"], ["train sglang-split-megatron on GPU 0,1"],
        ["train vllm-split-megatron on GPU 2,3"], ["train vllm-inprocess-split-megatron on GPU 0,1"]]
    assert f"p1: start barrier of 3 runs ({moe}/barrier/moe4-p1)" in done.stdout
    assert f"p2: start barrier of 2 runs ({moe}/barrier/moe4-p2)" in done.stdout
    assert "p3: start barrier" not in done.stdout.split("plan moe4")[1]  # a run alone waits for nobody
    assert not (moe / "lane-rest4-1.log").exists()


def test_unknown_plan_and_missing_setup_are_clear_errors(root: Path) -> None:
    bad = _driver(root, "all", "nope")
    assert bad.returncode == 2
    plans = ("asyncstate client exportstage exportviews faults full hfexport hffused hfrounds learnentropy "
             "learning learnlr moe moe1full moe1pin moe1pin2 moe1vllm moe2full moe2keep moe2new moe4 moe4full "
             "moepermute moerounds overlap1 overlapproc packing placement placement1 placement1s placement1v "
             "placementlong placementrest rest rest4 soak syncfree syncfree2 timed timingcost trainer "
             "trainerfast trainerfuse trainerloop trainermoe trainervocab verdict verdictdraws verdictinproc "
             "verdictkv verdictpin verdictsglang verdictvllm verdictvllmtimed verdictwarm verdictwarmkv vocabbench")
    assert f"no plan named nope ({plans}" in bad.stderr
    assert "no plan named nope" in _driver(root, "start", "rest", "nope").stderr
    for bad_round in ("x", "0"):
        out = _driver(root, "all", "placement", HYBRIDRL_ROUND=bad_round)
        assert out.returncode == 2 and out.stderr.strip() == (
            f"plan placement: HYBRIDRL_ROUND='{bad_round}': expected a round number, 1 or more"), out.stderr
    (root / "gpu-h200" / "setup.done").unlink()
    assert "run setup first" in _driver(root, "all", "rest").stderr


def test_full_shape_moe_plan_never_puts_two_runs_on_one_gpu(root: Path) -> None:
    (root / "gpu-4xh200-moe").mkdir()
    (root / "gpu-4xh200-moe" / "setup.done").touch()
    done = _driver(root, "all", "moe4full")
    assert done.returncode == 0, done.stderr
    study = root / "gpu-4xh200-moe"
    # the colocate pair side by side on disjoint pairs, then the four-GPU runs alone
    assert _items(study / "lane-moe4full-1.log") == ["train sglang-colocate-megatron on GPU 0,1"]
    assert _items(study / "lane-moe4full-2.log") == ["train vllm-colocate-megatron on GPU 2,3"]
    assert done.stdout.index("p1 done") < done.stdout.index("lane 3: 0,1,2,3")
    assert _items(study / "lane-moe4full-3.log")[-2:] == ["train vllm-inprocess-colocate-megatron on GPU 0,1",
                                                          "train vllm-inprocess-split-megatron on GPU 0,1,2,3"]


def test_full_shape_moe_on_two_gpus_runs_colocate_one_at_a_time(root: Path) -> None:
    (root / "gpu-4xh200-moe").mkdir()
    (root / "gpu-4xh200-moe" / "setup.done").touch()
    done = _driver(root, "all", "moe2full")
    assert done.returncode == 0, done.stderr
    assert _items(root / "gpu-4xh200-moe" / "lane-moe2full-1.log") == [
        "train sglang-colocate-megatron on GPU 0,1", "train vllm-inprocess-colocate-megatron on GPU 0,1",
        "train vllm-colocate-megatron on GPU 0,1"]
    assert "start barrier" not in done.stdout and not (root / "gpu-4xh200-moe" / "lane-moe2full-2.log").exists()


def test_runs_wait_for_the_engine_overlays_when_asked(root: Path, tmp_path: Path) -> None:
    ready = tmp_path / "envs.ready"
    env = {**_python3_on_path(root.parent), "HYBRIDRL_REF_DIR": str(root), "HYBRIDRL_DRY_RUN": "1",
           "HYBRIDRL_ENVS_READY": str(ready), "HYBRIDRL_ENVS_WAIT_S": "2"}
    late = subprocess.run(["bash", str(DRIVER), "plans", "moe"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert late.returncode == 1
    assert f"no {ready} after 2 s: the engine overlays were never installed" in late.stdout
    assert not (root / "gpu-2xh200-moe" / "lane-moe-1.log").exists()  # nothing ran
    waiting = subprocess.Popen(["bash", str(DRIVER), "plans", "moe"], stdout=subprocess.PIPE, text=True,
                               env={**env, "HYBRIDRL_ENVS_WAIT_S": "60"})
    time.sleep(1.5)  # the plans are waiting by now (or, on a slow host, about to)
    ready.touch()
    out, _ = waiting.communicate(timeout=60)
    assert waiting.returncode == 0
    assert out.index("study start (plan moe") > 0
    assert _items(root / "gpu-2xh200-moe" / "lane-moe-1.log")[0] == "train sglang-colocate-megatron on GPU 0"


def test_status_counts_a_run_without_steps_quietly(root: Path) -> None:
    (root / "gpu-h200" / "runs" / "r2").mkdir()
    done = _driver(root, "status")
    assert "No such file" not in done.stderr
    lines = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines() if " steps" in line}
    assert lines == {"r1": "1", "r2": "0"}


def test_pack_keeps_the_first_error_of_a_long_engine_log(root: Path, tmp_path: Path) -> None:
    run = root / "gpu-h200" / "runs" / "r1"
    (run / "logs").mkdir()
    lines = [f"loading {i}" for i in range(1000)] + ["ERROR RuntimeError: the root cause"]
    lines += [f"cascade {i}" for i in range(2000)]
    (run / "logs" / "engine.log").write_text("\n".join(lines) + "\n")
    model = root / "gpu-h200" / "models" / "warm"
    model.mkdir(parents=True)
    (model / "warm_start.json").write_text('{"base_accuracy": 0.44}\n')
    (model / "model.safetensors").write_bytes(b"weights")
    done = _driver(root, "pack", str(tmp_path / "out.tar.gz"))
    assert done.returncode == 0, done.stderr
    with tarfile.open(tmp_path / "out.tar.gz") as tar:
        kept = tar.extractfile("ref/gpu-h200/runs/r1/logs/engine.log").read().decode().splitlines()
        assert tar.extractfile("ref/gpu-h200/runs/r1/steps.jsonl").read() == b'{"step": 1}\n'
        # a warm start's record travels, its model does not
        assert tar.extractfile("ref/gpu-h200/models/warm/warm_start.json").read() == b'{"base_accuracy": 0.44}\n'
        assert not any(name.endswith(".safetensors") for name in tar.getnames())
    assert "ERROR RuntimeError: the root cause" in kept
    assert kept[0] == "loading 0" and kept[-1] == "cascade 1999"
    assert len(kept) < 700


def test_pack_leaves_out_rollout_access_lines_so_a_runs_engine_messages_survive(root: Path, tmp_path: Path) -> None:
    run = root / "gpu-h200" / "runs" / "r1"
    (run / "logs").mkdir()
    ok = '(APIServer pid=1) INFO:     127.0.0.1:5{i} - "POST /v1/completions HTTP/1.1" 200 OK'
    sg = 'INFO:     127.0.0.1:4{i} - "POST /generate HTTP/1.1" 200 OK'
    control = 'INFO:     127.0.0.1:1 - "POST /load_lora_adapter HTTP/1.1" 200 OK'
    lines = ["start"] + [ok.format(i=i) for i in range(3000)] + ["Loaded new LoRA adapter: name 'policy'", control]
    lines += [sg.format(i=i) for i in range(3000)] + ['INFO:     127.0.0.1:1 - "POST /sleep HTTP/1.1" 500 Internal']
    (run / "logs" / "engine.log").write_text("\n".join(lines) + "\n")
    # a long log stays long without them: trimmed as before, counting the lines left
    long = [f"loading {i}" for i in range(400)] + [ok.format(i=i) for i in range(500)] + ["ERROR the cause"]
    long += [f"cascade {i}" for i in range(800)]
    (run / "logs" / "server.log").write_text("\n".join(long) + "\n")
    done = _driver(root, "pack", str(tmp_path / "out.tar.gz"))
    assert done.returncode == 0, done.stderr
    with tarfile.open(tmp_path / "out.tar.gz") as tar:
        kept = tar.extractfile("ref/gpu-h200/runs/r1/logs/engine.log").read().decode().splitlines()
        trimmed = tar.extractfile("ref/gpu-h200/runs/r1/logs/server.log").read().decode().splitlines()
    # the adapter load, its control call and a failed request stay
    assert kept == ["[... 6000 rollout access lines (HTTP 200) left out ...]", "start",
                    "Loaded new LoRA adapter: name 'policy'", control, lines[-1]]
    assert trimmed[0] == "[... 500 rollout access lines (HTTP 200) left out ...]"
    assert "[... trimmed to the first error, line 402 without the access lines ...]" in trimmed
    assert "ERROR the cause" in trimmed and trimmed[-1] == "cascade 799" and not any("POST" in x for x in trimmed)
    assert "[... trimmed: 1202 lines in all without the access lines; the last 300 follow ...]" in trimmed


def test_only_a_lanes_first_run_meets_the_start_barrier(root: Path) -> None:
    done = _driver(root, "all", "rest")
    assert done.returncode == 0, done.stderr
    lane = (root / "gpu-h200" / "lane-rest-1.log").read_text().splitlines()
    barrier = f"meets the others at the start barrier {root}/gpu-h200/barrier/rest-p1:2"
    assert [line.split("] ", 1)[1] for line in lane[:3]] == [
        "dry run: train sglang-restart on GPU 0", "  " + barrier, "dry run: train vllm-inprocess-restart on GPU 0"]
    assert sum(barrier in line for line in lane) == 1  # the lane's later runs do not wait
    # the last phase has one lane: nobody to wait for
    assert "start barrier" not in (root / "gpu-h200" / "lane-rest-3.log").read_text()


def _spec(run_id: str, engine: str, trainer: str) -> str:
    """A run's config file (cfg/<name>.json) as prepare-study writes it, for a run of model m."""
    from hybridrl.study.run_config import RunConfig, RunSpec

    return RunSpec(run_id=run_id, run=RunConfig(model="m", engine=engine, trainer=trainer), study="s").model_dump_json()


def test_a_run_already_done_releases_the_start_barrier(root: Path, tmp_path: Path) -> None:
    study = root / "gpu-h200"
    (study / "cfg").mkdir()
    (study / "cfg" / "x.json").write_text(_spec("rid", "sglang", "hf"))
    (study / "runs" / "rid").mkdir()
    (study / "runs" / "rid" / "done.json").write_text("{}")
    (tmp_path / "b").mkdir()
    # the driver (python3 -m hybridrl.tools.lease) is this interpreter, wherever it lives
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HYBRIDRL_REF_DIR": str(root),
           "HYBRIDRL_START_BARRIER": f"{tmp_path}/b:2"}
    done = subprocess.run(["bash", str(DRIVER), "train", "x", "0"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "train x already done" in done.stdout
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["rid.gone"]


def test_client_plan_measures_the_ceiling_then_the_http_engines_new_and_old_then_in_process(root: Path) -> None:
    assert _one_lane_plan(root, "gpu-h200-client", "client") == [
        "client ceiling",
        "train sglang-new on GPU 0", "bench sglang-new step 3 on GPU 0",
        "train vllm-new on GPU 0", "bench vllm-new step 3 on GPU 0",
        "train sglang-old on GPU 0", "train vllm-old on GPU 0",
        "train vllm-inprocess-new on GPU 0", "bench vllm-inprocess-new step 3 on GPU 0",
        "train vllm-inprocess-old on GPU 0"]


def test_timed_plan_runs_each_engine_streaming_nothing_with_its_own_timing_then_benches_it(root: Path) -> None:
    from hybridrl.study.config import load_study

    items = _one_lane_plan(root, "gpu-h200-client", "timed")
    engines = ["sglang", "vllm", "vllm-inprocess"]
    assert [i.split(" on ")[0] for i in items] == [x for e in engines for x in (
        f"train {e}-timed", f"bench {e}-timed step 3")]
    assert all(i.endswith("--paths raw client stream_all") for i in items[1::2])
    runs = {r.name: r for r in load_study(REPO / "config" / "gpu-h200-client.yaml").runs.values()}
    assert all(runs[f"{e}-timed"].engine_timing and runs[f"{e}-timed"].stream_fraction == 0 for e in engines)


def test_placement_plan_runs_one_round_of_the_six_arms_and_the_long_runs_apart(root: Path) -> None:
    from hybridrl.study.config import load_study

    first = _one_lane_plan(root, "gpu-2xh200-placement", "placement")
    arms = ["sglang-colocate", "vllm-colocate", "sglang-split", "vllm-split", "sglang-overlap", "vllm-overlap"]
    gpus = ["0", "0", "0,1", "0,1", "0,1", "0,1"]  # colocate on one GPU; split: engine on GPU 1, trainer on GPU 0
    assert first == [f"train {a} on GPU {g}" for a, g in zip(arms, gpus, strict=True)]
    (root / "gpu-2xh200-placement" / "lane-placement-1.log").unlink()
    third = _one_lane_plan(root, "gpu-2xh200-placement", "placement", HYBRIDRL_ROUND="3")
    # round 3 reverses the placements (engine pairs together), so none always runs first in its lease
    reverse = [4, 5, 2, 3, 0, 1]
    assert third == [f"train {arms[i]}-r3 on GPU {gpus[i]}" for i in reverse]
    from hybridrl.tools.lease.plans import placement_round

    assert [i.split()[1] for i in placement_round(4)] == [f"{a}-r4" for a in arms]  # even rounds: as given
    assert [i.split()[1] for i in placement_round(5)] == [f"{arms[i]}-r5" for i in reverse]
    assert _one_lane_plan(root, "gpu-2xh200-placement", "placementlong") == [
        "train sglang-overlap-long on GPU 0,1", "train vllm-overlap-long on GPU 0,1"]
    # what the first lease left: round 2's colocate arms and vLLM's overlapped run, then round 3
    rest = _one_lane_plan(root, "gpu-2xh200-placement", "placementrest")
    assert rest == ["train sglang-colocate-r2 on GPU 0", "train vllm-colocate-r2 on GPU 0",
                    "train vllm-overlap-r2 on GPU 0,1", *third]
    # every item names a run config the study writes; overlap is split with one step of staleness, corrected
    study = load_study(REPO / "config" / "gpu-2xh200-placement.yaml")
    runs = {r.name: r for r in study.runs.values()}
    assert {runs[f"{e}-overlap"].overlap for e in ("sglang", "vllm")} == {1}
    assert {runs[f"{e}-overlap"].rollout_is for e in ("sglang", "vllm")} == {"truncate"}
    assert {runs[f"{e}-overlap-long"].steps for e in ("sglang", "vllm")} == {30}
    names = {split_replicate(rid)[0] for rid in study.runs}
    # six arms x 3, the overlapped arms' replicates 4-5, two -proc arms x 2, two long runs
    assert len(names) == 10 and len(study.runs) == 6 * 3 + 2 * 2 + 2 * 2 + 2
    # overlapproc: each overlapped arm's replicates 4 and 5 (client in a thread) against the same arm with the
    # client in a worker process, interleaved by engine; the -proc arms differ from their baseline in that key only
    assert _one_lane_plan(root, "gpu-2xh200-placement", "overlapproc") == [
        f"train {run} on GPU 0,1" for k in (1, 2) for e in ("sglang", "vllm")
        for run in (f"{e}-overlap-r{k + 3}", f"{e}-overlap-proc" + (f"-r{k}" if k > 1 else ""))]
    for e in ("sglang", "vllm"):
        base, proc = runs[f"{e}-overlap"], runs[f"{e}-overlap-proc"]
        assert proc.rollout_process and not base.rollout_process
        same = {"rollout_process": False, "name": base.name, "replicates": base.replicates}
        assert proc.model_copy(update=same) == base
    # issue 18 asks for the realistic dense model: issue 17's warm-started policy, its answers stopping at EOS
    assert {r.model for r in runs.values()} == {"qwen3-0.6b-warm"} and "warm_start" in study.models["qwen3-0.6b-warm"]
    assert not any(r.sampling.ignore_eos for r in runs.values()) and all(r.eval_every == 5 for r in runs.values())


def test_one_gpu_overlap_plan_runs_each_engine_and_trainer_and_hits_the_rollout_ahead(root: Path) -> None:
    from hybridrl.study.config import load_study

    assert _one_lane_plan(root, "gpu-h200-overlap", "overlap1") == [
        "train sglang-overlap on GPU 0", "train vllm-overlap on GPU 0",
        "fault sglang-overlap-fault on GPU 0: engine kill in step 3, SIGTERM in step 5",
        "fault vllm-overlap-fault on GPU 0: engine kill in step 3, SIGTERM in step 5",
        "train sglang-overlap-megatron on GPU 0", "train vllm-overlap-megatron on GPU 0"]
    runs = load_study(REPO / "config" / "gpu-h200-overlap.yaml").runs.values()
    assert {(r.placement, r.overlap, r.rollout_is) for r in runs} == {("split", 1, "truncate")}
    assert {(r.engine, r.trainer) for r in runs} == {(e, t) for e in ("sglang", "vllm") for t in ("hf", "megatron")}
    assert {r.steps for r in runs} == {6}  # the fault runs' SIGTERM at step 5 needs a step after it


def test_balanced_rounds_reverse_every_second_round_so_no_arm_always_runs_first() -> None:
    assert interleave(3, "a", "b") == ["train a", "train b", "train a-r2", "train b-r2", "train a-r3", "train b-r3"]
    assert interleave(4, "a", "b", balanced=True) == ["train a", "train b", "train b-r2", "train a-r2",
                                                     "train a-r3", "train b-r3", "train b-r4", "train a-r4"]
    assert tool_rounds(2, "x", "y", "z", balanced=True) == ["x r1", "y r1", "z r1", "z r2", "y r2", "x r2"]


def test_one_gpu_placement_plan_interleaves_two_rounds_of_colocate_and_overlap(root: Path) -> None:
    from hybridrl.study.config import load_study

    arms = ["sglang-colocate", "vllm-colocate", "sglang-overlap", "vllm-overlap"]
    assert _one_lane_plan(root, "gpu-h200-placement1", "placement1") == [
        *(f"train {a} on GPU 0" for a in arms), *(f"train {a}-r2 on GPU 0" for a in arms)]
    runs = load_study(REPO / "config" / "gpu-h200-placement1.yaml").runs
    assert {(r.placement, r.overlap) for r in runs.values()} == {("colocate", 0), ("split", 1)}
    # like for like: the engine's share of the GPU, and so its KV cache, is the same in both placements
    assert {r.gpu_memory_utilization for r in runs.values()} == {0.5}
    assert len(runs) == 4 * 3  # every item names a run the study writes, the third round's too
    (root / "gpu-h200-placement1" / "lane-placement1-1.log").unlink()
    assert _one_lane_plan(root, "gpu-h200-placement1", "placement1v") == [
        "train vllm-colocate-r3 on GPU 0", "train vllm-overlap-r3 on GPU 0"]
    assert _one_lane_plan(root, "gpu-h200-placement1", "placement1s") == [
        "train sglang-colocate-r3 on GPU 0", "train sglang-overlap-r3 on GPU 0"]


def test_soak_plan_runs_each_engine_for_fifty_steps_one_after_another(root: Path) -> None:
    import yaml

    assert _one_lane_plan(root, "gpu-h200-soak", "soak") == [
        "train sglang-soak on GPU 0", "train vllm-soak on GPU 0", "train vllm-inprocess-soak on GPU 0"]
    study = yaml.safe_load((REPO / "config" / "gpu-h200-soak.yaml").read_text())
    assert study["defaults"]["steps"] >= 50 and study["defaults"]["placement"] == "colocate"


def test_verdict_plans_keep_the_like_for_like_arms_in_one_lease_interleaved_and_the_kv_arm_in_another(
        root: Path) -> None:
    from hybridrl.study.config import load_study
    from hybridrl.study.prepare_study import short_name

    items = _one_lane_plan(root, "gpu-h200-verdict", "verdict")
    pair = ("sglang-full", "vllm-server")
    rounds = [f"train {a}{'' if k == 1 else f'-r{k}'} on GPU 0" for k in (1, 2, 3) for a in pair]
    assert items[:6] == rounds  # A B A B A B: a drift of the host falls on both arms alike
    assert [i.split(" on ")[0] for i in items[6:]] == [
        "bench sglang-full step 3", "bench vllm-server step 3", "client ceiling"]
    assert all(i.endswith("--paths raw client") for i in items[6:8])  # the client lease measured the rest
    assert not (root / "gpu-h200-verdict" / "lane-verdict-2.log").exists()  # one run at a time, nothing beside it
    pair = ("vllm-inprocess", "sglang-kv")
    kv = [f"train {a}{'' if k == 1 else f'-r{k}'} on GPU 0" for k in (1, 2, 3) for a in pair]
    items = _one_lane_plan(root, "gpu-h200-verdict", "verdictkv")
    assert items[:6] == kv
    assert [i.split(" on ")[0] for i in items[6:]] == ["bench vllm-inprocess step 3", "bench sglang-kv step 3"]
    # SGLang's timing pair: two replicates each, interleaved, differing in engine_timing alone
    timing = [f"train {a}{'' if k == 1 else f'-r{k}'} on GPU 0" for k in (1, 2) for a in ("sglang-untimed",
                                                                                         "sglang-timed")]
    assert _one_lane_plan(root, "gpu-h200-verdict", "timingcost") == timing
    assert _one_lane_plan(root, "gpu-h200-verdict", "verdictpin") == rounds  # the pair again, SGLang's copy kept
    # the three plans train every run config `prepare` writes: the arm's name, -rK for replicate k
    study = load_study(REPO / "config" / "gpu-h200-verdict.yaml")
    names = [short_name(rid, run) for rid, run in study.runs.items()]
    assert sorted(f"train {n} on GPU 0" for n in names) == sorted(rounds + kv + timing)
    pair = [next(r for r in study.runs.values() if r.name == n) for n in ("sglang-untimed", "sglang-timed")]
    differ = {k for k in type(pair[0]).model_fields if getattr(pair[0], k) != getattr(pair[1], k)}
    assert differ == {"name", "engine_timing"} and pair[1].engine_timing and pair[0].stream_fraction == 0
    # the like-for-like arms release weights and KV cache alike; the study has Qwen's vocabulary (issue 17)
    runs = {r.name: r for r in study.runs.values()}
    assert runs["sglang-full"].sglang_release == "all" and runs["sglang-kv"].sglang_release == "kv_cache"
    assert {runs[a].vllm_sleep_level for a in ("vllm-server", "vllm-inprocess")} == {1}
    assert study.models[runs["sglang-full"].model]["tokenizer"] == "qwen"


def test_faults_plan_hits_each_engine_in_a_rollout_and_in_training(root: Path) -> None:
    from hybridrl.study.config import load_study

    items = _one_lane_plan(root, "gpu-h200-soak", "faults")
    assert items == [f"fault {e}-fault on GPU 0: engine kill in step 2, SIGTERM in step 4"
                     for e in ("sglang", "vllm", "vllm-inprocess")]
    runs = {r.name: r for r in load_study(REPO / "config" / "gpu-h200-soak.yaml").runs.values()}
    assert all(runs[f"{e}-fault"].steps > 4 for e in ("sglang", "vllm", "vllm-inprocess"))


def test_a_lease_can_take_the_rest_of_a_plan_that_an_earlier_one_began(root: Path) -> None:
    items = _one_lane_plan(root, "gpu-h200-soak", "faults", HYBRIDRL_SKIP="sglang-fault vllm-inprocess")
    # only whole run names match: vllm-inprocess names no run of this plan, so vllm-inprocess-fault stays
    assert [i.split(" on ")[0] for i in items] == ["fault vllm-fault", "fault vllm-inprocess-fault"]
    log = (root / "gpu-h200-soak" / "lane-faults-1.log").read_text()
    assert "skipped: fault sglang-fault 2 4 (HYBRIDRL_SKIP)" in log


def test_learning_plan_runs_the_long_runs_then_measures_the_vocabularies(root: Path) -> None:
    from hybridrl.study.config import load_study
    from hybridrl.study.prepare_study import short_name

    items = _one_lane_plan(root, "gpu-h200-learning", "learning")
    names = [i.removeprefix("train ").split(" on ")[0] for i in items]
    # the 30-step runs first, so a lease cut short keeps them
    assert names == ["sglang-colocate", "vllm-colocate", "sglang-vocab-small", "sglang-vocab-qwen",
                     "vllm-vocab-small", "vllm-vocab-qwen"]
    # the verdict pair on the warm-started model: three replicates a side, interleaved
    pair = [i.removeprefix("train ").split(" on ")[0] for i in _one_lane_plan(root, "gpu-h200-learning",
                                                                              "verdictwarm")]
    assert pair == [f"{a}{'' if k == 1 else f'-r{k}'}" for k in (1, 2, 3) for a in ("sglang-verdict", "vllm-verdict")]
    # the two plans train every run `prepare` writes: the short name, -rK for replicate k
    study = load_study(REPO / "config" / "gpu-h200-learning.yaml")
    short = {short_name(rid, run) for rid, run in study.runs.items()}
    # ten times the learning rate, 50 steps a side
    learn = _one_lane_plan(root, "gpu-h200-learning", "learnlr")
    assert learn == ["train sglang-learn on GPU 0", "train vllm-learn on GPU 0"]
    assert {r.lr for r in study.runs.values() if (r.name or "").endswith("-learn")} == {1e-3}
    # the entropy measurement: SGLang at lr 1e-3, then its lr 1e-4 control, the runs of learnlr and learning
    assert _one_lane_plan(root, "gpu-h200-learning", "learnentropy") == [
        "train sglang-learn on GPU 0", "train sglang-colocate on GPU 0",
        "trainer-bench qwen3-0.6b hf mb 32 on GPU 0", "trainer-profile qwen3-0.6b hf mb 32 on GPU 0"]
    # PEFT's adapter forward against the fused one, in one lease, then the control
    fused = _one_lane_plan(root, "gpu-h200-learning", "hffused")
    assert fused[:2] == ["trainer-bench qwen3-0.6b hf mb 32 peft-lora on GPU 0",
                         "trainer-bench qwen3-0.6b hf mb 32 on GPU 0"]
    assert fused[-1] == "train sglang-colocate on GPU 0"
    # issue 16's other two arms on this model, interleaved, then their benchmarks (5 repeats each)
    kv = _one_lane_plan(root, "gpu-h200-learning", "verdictwarmkv")
    kv_runs = [i.removeprefix("train ").split(" on ")[0] for i in kv if i.startswith("train ")]
    assert kv_runs == [f"{a}{'' if k == 1 else f'-r{k}'}" for k in (1, 2, 3)
                       for a in ("sglang-verdict-kv", "vllm-inprocess-verdict")]
    assert [i.split(" step ")[0] for i in kv[6:]] == ["bench sglang-verdict-kv", "bench vllm-inprocess-verdict"]
    # the headline pair again with a draw of answers per replicate
    draws = [i.removeprefix("train ").split(" on ")[0] for i in _one_lane_plan(root, "gpu-h200-learning",
                                                                               "verdictdraws")]
    assert draws == [f"{a}{'' if k == 1 else f'-r{k}'}" for k in (1, 2, 3)
                     for a in ("sglang-verdict-draws", "vllm-verdict-draws")]
    # the two vLLM arms with the engines timing every request: in-process first in each round, as in verdictvllm
    timed = [i.removeprefix("train ").split(" on ")[0] for i in _one_lane_plan(root, "gpu-h200-learning",
                                                                               "verdictvllmtimed")]
    assert timed == ["vllm-inprocess-verdict-timed", "vllm-verdict-timed", "vllm-verdict-timed-r2",
                     "vllm-inprocess-verdict-timed-r2", "vllm-inprocess-verdict-timed-r3", "vllm-verdict-timed-r3"]
    assert {r.engine_timing for r in study.runs.values() if (r.name or "").endswith("-timed")} == {True}
    assert set(names + pair + kv_runs + draws + timed
               + [i.removeprefix("train ").split(" on ")[0] for i in learn]) == short
    # the pair differs in the engine and its release alone
    sg, vl = (next(r for r in study.runs.values() if r.name == n) for n in ("sglang-verdict", "vllm-verdict"))
    differ = {k for k in type(sg).model_fields if getattr(sg, k) != getattr(vl, k)}
    assert differ <= {"name", "engine", "sglang_release", "engine_args"}, differ
    assert not sg.sampling.ignore_eos and sg.model == "qwen3-0.6b-warm"
    # and each new arm from its engine's verdict arm in the release or the engine alone
    for base, arm, allowed in (("sglang-verdict", "sglang-verdict-kv", {"name", "sglang_release"}),
                               ("vllm-verdict", "vllm-inprocess-verdict", {"name", "engine"}),
                               ("sglang-verdict", "sglang-verdict-draws", {"name", "replicate_seeds"}),
                               ("vllm-verdict", "vllm-verdict-draws", {"name", "replicate_seeds"})):
        a, b = (next(r for r in study.runs.values() if r.name == n) for n in (base, arm))
        assert {k for k in type(a).model_fields if getattr(a, k) != getattr(b, k)} == allowed, arm


def test_trainer_plan_benchmarks_the_dense_then_the_moe_shape_on_one_gpu(root: Path) -> None:
    from hybridrl.tools.trainer_bench import SHAPES

    items = _one_lane_plan(root, "gpu-h200", "trainer")
    assert items == ["trainer-bench qwen3-0.6b hf mb 32 on GPU 0", "trainer-bench qwen3-0.6b megatron mb 32 on GPU 0",
                     "trainer-bench qwen3-30b-a3b hf mb 16 on GPU 0",
                     "trainer-bench qwen3-30b-a3b megatron mb 16 on GPU 0"]
    assert not (root / "gpu-h200" / "lane-trainer-2.log").exists()  # one benchmark at a time
    moe = SHAPES["qwen3-30b-a3b"]
    assert moe.config["num_hidden_layers"] == 48 and (moe.samples, moe.completion) == (64, 256)
    assert (SHAPES["qwen3-0.6b"].samples, SHAPES["qwen3-0.6b"].completion) == (128, 256)


def test_poll_packs_while_the_driver_runs_and_returns_at_once_when_it_has_stopped(tmp_path: Path) -> None:
    root, out = tmp_path / "ref", tmp_path / "out"
    (root / "gpu-h200" / "runs").mkdir(parents=True)
    (root / "gpu-h200" / "setup.done").touch()
    out.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HYBRIDRL_REF_DIR": str(root), "HYBRIDRL_POLL_S": "0.2"}
    poll = ["bash", str(DRIVER), "poll", str(out), "3"]
    gone = subprocess.run(poll, capture_output=True, text=True, env=env, timeout=60)
    assert gone.returncode == 0, gone.stderr
    assert "the driver is not running" in gone.stdout and (out / "latest.tar.gz").is_file()
    driver = subprocess.Popen(["sleep", "30"])
    try:
        (root / "driver.pid").write_text(str(driver.pid))
        (out / "latest.tar.gz").unlink()
        alive = subprocess.run(poll, capture_output=True, text=True, env=env, timeout=60)
        assert "the driver is not running" not in alive.stdout and (out / "latest.tar.gz").is_file()
    finally:
        driver.kill()
    # a driver that stops while the poll waits out its interval: the poll returns within a second or two of it,
    # not at the interval's end
    # (started in the background of a shell that exits, as the driver is: not a child left to reap here)
    pid = subprocess.run(["bash", "-c", "sleep 2 > /dev/null 2>&1 & echo $!"], capture_output=True, text=True).stdout
    (root / "driver.pid").write_text(pid.strip())
    start = time.monotonic()
    done = subprocess.run(poll, capture_output=True, text=True, env={**env, "HYBRIDRL_POLL_S": "40"}, timeout=120)
    assert done.returncode == 0 and time.monotonic() - start < 20, (time.monotonic() - start, done.stderr)


def _python3_on_path(tmp_path: Path) -> dict[str, str]:
    """PATH whose python3 is this interpreter, as the driver calls it (`python3 -m hybridrl ...`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def _tiny_study(tmp_path: Path, **defaults: object) -> Path:
    """The smoke study without its warm start (seconds to build), one arm replicated."""
    import yaml

    raw = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    del raw["models"]["tiny-qwen3"]["warm_start"]
    raw["runs"][2]["replicates"] = 2
    raw["defaults"].update(defaults)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _hybridrl_argv(line: str) -> list[str]:
    """`python -m hybridrl CMD ...` without the shell's redirections, path-valued options as basenames."""
    import shlex

    words = shlex.split(line)
    words = words[words.index("hybridrl") + 1:]
    words = words[:next((i for i, w in enumerate(words) if w in ("2>&1", ">", "|")), len(words))]
    return [Path(w).name if i and words[i - 1] in ("--out", "--corpus", "--test") else w
            for i, w in enumerate(words)]


def test_prepare_writes_the_run_configs_data_and_models_the_dag_would(tmp_path: Path) -> None:
    from hybridrl.study.config import load_study, read_run_spec
    from hybridrl.study.prepare_study import run_spec_json

    config = _tiny_study(tmp_path)
    root = tmp_path / "ref"
    env = {**_python3_on_path(tmp_path), "HYBRIDRL_REF_DIR": str(root)}
    done = subprocess.run(["bash", str(DRIVER), "prepare", str(config)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = root / "tiny"
    assert (ref / "setup.done").exists() and (ref / "models" / "tiny-qwen3" / "config.json").exists()
    assert (ref / "data" / "train.jsonl").stat().st_size > 0

    # the DAG of the same study, dry: its run ids and the shell commands of its data and model rules
    dag = subprocess.run([str(Path(sys.executable).with_name("snakemake")), "-s", str(REPO / "Snakefile"),
                          "--configfile", str(config), "-n", "-p", "--cores", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert dag.returncode == 0, dag.stderr[-3000:]
    text = dag.stdout + dag.stderr
    dag_ids = {line.split("results/runs/")[1].split("/")[0] for line in text.splitlines()
               if "output: results/runs/" in line and "config.json" in line}
    dag_cmds = sorted(_hybridrl_argv(line) for line in text.splitlines()
                      if line.startswith("Shell command: python -m hybridrl data")
                      or line.startswith("Shell command: python -m hybridrl model"))
    ran = sorted(_hybridrl_argv(line) for line in done.stdout.splitlines() if line.startswith("$ python -m hybridrl"))
    assert [c[0] for c in dag_cmds] == ["data", "model"]
    assert ran == [c[:-1] + ["data" if c[0] == "data" else c[-1]] for c in dag_cmds]  # only the --out folder differs

    # one config per run, named as the plans call it, holding the file the `run_config` rule writes
    study = load_study(config)
    index = dict(line.split() for line in done.stdout.splitlines() if line.split()[-1:] and line.split()[-1] in dag_ids)
    assert set(index.values()) == dag_ids == set(study.runs)
    assert set(index) == {"vllm-split", "vllm-restart", "vllm-overlap", "vllm-overlap-r2"}
    for short, rid in index.items():
        cfg = ref / "cfg" / f"{short}.json"
        assert cfg.read_text() == run_spec_json(study, rid)
        assert read_run_spec(cfg).run_id == rid


def test_prepare_of_a_bad_study_is_one_clear_line(tmp_path: Path) -> None:
    config = _tiny_study(tmp_path, stepz=3)
    root = tmp_path / "ref"
    env = {**_python3_on_path(tmp_path), "HYBRIDRL_REF_DIR": str(root)}
    done = subprocess.run(["bash", str(DRIVER), "prepare", str(config)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"hybridrl: config error: {config}: unknown key 'stepz' in defaults; did you mean 'steps'?"]
    assert not (root / "tiny" / "setup.done").exists() and not (root / "tiny" / "cfg").exists()


def test_tbench_leaves_no_process_of_its_benchmark_behind(root: Path, tmp_path: Path) -> None:
    # a stand-in python3 that starts a worker and dies, as the 30B benchmark did when the host killed it
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pid_file = tmp_path / "worker.pid"
    (bin_dir / "python3").write_text(f"#!/bin/bash\nsleep 300 &\necho $! > {pid_file}\nexit 137\n")
    (bin_dir / "python3").chmod(0o755)
    out = _item(root, "tbench tiny hf 4", "0", {"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert "trainer-bench tiny hf mb 4 exit 137" in out
    worker = int(pid_file.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]


def test_a_replicate_flag_names_the_result_and_is_not_passed_on(root: Path, tmp_path: Path) -> None:
    # a stand-in python3 that writes the arguments it got where --out points
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/bash\nwhile [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; a+=("$1"); '
                                     'shift; done\necho "${a[*]}" > "$out"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    _item(root, "tbench tiny hf 4 peft-lora r2", "0", env)
    [result] = (root / "gpu-h200" / "bench").glob("trainer-tiny-hf-mb4-peft-lora-r2.json")
    args = result.read_text().split()
    assert "--peft-lora" in args and "--r2" not in args and "r2" not in args
    # a profile by hand, as after a plan: its flags passed on the same way
    _item(root, "tprof tiny megatron 4 export", "0", env)
    args = (root / "gpu-h200" / "bench" / "profile-tiny-megatron-mb4-export.txt").read_text().split()
    assert args[:3] == ["-m", "hybridrl", "trainer-profile"] and "--export" in args
    items = _one_lane_plan(root, "gpu-h200", "hfrounds")
    assert len(items) == 20 and items[:2] == ["trainer-bench qwen3-0.6b hf mb 32 peft-lora r1 on GPU 0",
                                              "trainer-bench qwen3-0.6b hf mb 32 r1 on GPU 0"]
    assert items[-1] == "trainer-bench qwen3-0.6b megatron mb 64 r4 on GPU 0"
    permute = _one_lane_plan(root, "gpu-h200", "moepermute")
    assert permute[:6] == [f"trainer-bench qwen3-30b-a3b megatron mb 16{flag} r{k} on GPU 0"
                           for k in (1, 2, 3) for flag in (" megatron-permute", "")]
    assert permute[6:] == ["trainer-profile qwen3-30b-a3b megatron mb 16 megatron-permute on GPU 0",
                           "trainer-profile qwen3-30b-a3b megatron mb 16 on GPU 0"]
    _item(root, "tbench tiny hf 4 vocab=300 r2", "0", env)  # a flag with a value, named without its '='
    args = (root / "gpu-h200" / "bench" / "trainer-tiny-hf-mb4-vocab-300-r2.json").read_text().split()
    assert "--vocab=300" in args and "r2" not in args
    vocab = _one_lane_plan(root, "gpu-h200", "trainervocab")
    assert vocab[:2] == ["trainer-bench qwen3-0.6b hf mb 32 r1 on GPU 0",
                         "trainer-bench qwen3-0.6b hf mb 32 vocab=151936 r1 on GPU 0"]
    assert vocab[4] == "trainer-bench qwen3-0.6b megatron mb 32 vocab=151936 r2 on GPU 0"  # round 2 reversed
    assert len(vocab) == 13 and vocab[-1] == "trainer-bench qwen3-30b-a3b megatron mb 16 vocab=151936 on GPU 0"
    moe = _one_lane_plan(root, "gpu-h200", "moerounds")
    assert moe == [f"trainer-bench qwen3-30b-a3b {t} mb 16 r{k} on GPU 0"
                   for k in (1, 2, 3) for t in ("megatron", "hf")]


def _driver_copy(tmp_path: Path) -> Path:
    """The driver in a repository of its own under tmp_path (it finds the source beside itself)."""
    repo = tmp_path / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    for d in ("config", "src", "workflow"):
        (repo / d).symlink_to(REPO / d)
    driver = repo / "scripts" / "gpu" / "run_reference.sh"
    shutil.copy(DRIVER, driver)
    return driver


def test_a_src_flag_runs_a_source_snapshot_names_the_result_and_is_not_passed_on(tmp_path: Path) -> None:
    repo = _driver_copy(tmp_path).parents[2]
    (repo / ".gpu" / "src-abc123" / "src" / "hybridrl").mkdir(parents=True)
    (repo / ".gpu" / "src-abc123" / "src" / "hybridrl" / "__init__.py").touch()
    # a stand-in python3 that writes its PYTHONPATH and arguments where --out points
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/bash\nwhile [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; a+=("$1"); '
                                     'shift; done\nprintf "%s\\n%s\\n" "$PYTHONPATH" "${a[*]}" > "$out"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}

    def tbench(*flags: str) -> str:
        return _item(tmp_path / "ref", " ".join(["tbench tiny hf 4", *flags]), "0", env, repo=repo)

    tbench("src-abc123", "r2")
    path, args = (tmp_path / "ref" / "gpu-h200" / "bench" / "trainer-tiny-hf-mb4-src-abc123-r2.json").read_text() \
        .splitlines()
    assert f"{repo}/.gpu/src-abc123/src" in path.split(":") and f"{repo}/src" not in path.split(":")
    assert "src-abc123" not in args.split() and "--src-abc123" not in args.split()
    tbench()  # no flag: the tree's own source
    path, _ = (tmp_path / "ref" / "gpu-h200" / "bench" / "trainer-tiny-hf-mb4.json").read_text().splitlines()
    assert f"{repo}/src" in path.split(":")
    out = io.StringIO()
    with pytest.raises(ItemFailed):  # it stops its lane
        run_item(parse_item("tbench tiny hf 4 src-fffff"), "0", _site(tmp_path / "ref", repo), env, out)
    assert "no hybridrl source at" in out.getvalue() and "scripts/gpu/snapshot-src.sh" in out.getvalue()
    assert not (tmp_path / "ref" / "gpu-h200" / "bench" / "trainer-tiny-hf-mb4-src-fffff.json").exists()


def test_a_plan_of_source_snapshots_needs_them_all_and_takes_them_along(tmp_path: Path) -> None:
    driver = _driver_copy(tmp_path)
    repo, root = driver.parents[2], tmp_path / "ref"
    (root / "gpu-h200").mkdir(parents=True)
    (root / "gpu-h200" / "setup.done").touch()
    env = {**_python3_on_path(tmp_path), "HYBRIDRL_REF_DIR": str(root), "HYBRIDRL_DRY_RUN": "1"}

    def driver_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(driver), *args], capture_output=True, text=True, env=env, timeout=120)

    for args in (["all", "syncfree"], ["start", "syncfree"]):  # refused before anything runs
        done = driver_run(*args)
        assert done.returncode == 2
        assert done.stderr.strip() == (f"plan syncfree runs source snapshots {repo}/.gpu lacks: src-ec2b5bd "
                                       "(scripts/gpu/snapshot-src.sh REV, carried with the call)")
    assert not (root / "gpu-h200" / "lane-syncfree-1.log").exists()
    (repo / ".gpu" / "src-ec2b5bd" / "src" / "hybridrl").mkdir(parents=True)
    (repo / ".gpu" / "src-ec2b5bd" / "src" / "hybridrl" / "__init__.py").touch()
    done = driver_run("start", "syncfree")
    assert done.returncode == 0, done.stderr
    # the running plan's copy of the code holds the snapshot too (its items run from that copy)
    assert (root / "code" / ".gpu" / "src-ec2b5bd" / "src" / "hybridrl" / "__init__.py").exists()
    pid = int((root / "driver.pid").read_text())
    for _ in range(600):
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    # the commit before and the tree, interleaved: the 48-layer rows first, then the dense ones, then the profiles
    sync = _items(root / "gpu-h200" / "lane-syncfree-1.log")
    assert sync[:6] == [f"trainer-bench qwen3-30b-a3b megatron mb 16{src} r{k} on GPU 0"
                        for k in (1, 2, 3) for src in (" src-ec2b5bd", "")]
    assert sync[6:10] == [f"trainer-bench qwen3-0.6b {t} mb 32{src} r1 on GPU 0"
                          for t in ("hf", "megatron") for src in (" src-ec2b5bd", "")]
    assert len(sync) == 21 and sync[-1] == "trainer-profile qwen3-0.6b hf mb 32 on GPU 0"
    shutil.rmtree(root / "gpu-h200")
    (root / "gpu-h200").mkdir()
    (root / "gpu-h200" / "setup.done").touch()
    assert driver_run("all", "syncfree2").returncode == 0
    again = _items(root / "gpu-h200" / "lane-syncfree2-1.log")
    assert again[:8] == [f"trainer-bench qwen3-30b-a3b megatron mb 16{src} r{k} on GPU 0"
                         for k in (1, 2, 3, 4) for src in (" src-ec2b5bd", "")]
    assert again[8:] == [f"trainer-bench qwen3-0.6b hf mb 32{src} r{k} on GPU 0"
                         for k in (1, 2, 3) for src in (" src-ec2b5bd", "")]
    (repo / ".gpu" / "src-c931dfb" / "src" / "hybridrl").mkdir(parents=True)
    (repo / ".gpu" / "src-c931dfb" / "src" / "hybridrl" / "__init__.py").touch()
    assert driver_run("all", "hfexport").returncode == 0
    assert _items(root / "gpu-h200" / "lane-hfexport-1.log") == [
        f"trainer-bench qwen3-0.6b hf mb 32{src} r{k} on GPU 0" for k in range(1, 6) for src in (" src-c931dfb", "")]
    (repo / ".gpu" / "src-38fe1e5" / "src" / "hybridrl").mkdir(parents=True)
    (repo / ".gpu" / "src-38fe1e5" / "src" / "hybridrl" / "__init__.py").touch()
    assert driver_run("all", "exportviews").returncode == 0
    views = _items(root / "gpu-h200" / "lane-exportviews-1.log")
    assert views[:10] == [f"trainer-bench qwen3-0.6b hf mb 32{src} r{k} on GPU 0"
                          for k in range(1, 6) for src in (" src-38fe1e5", "")]
    assert views[10:] == [f"trainer-bench qwen3-30b-a3b megatron mb 16{src} r{k} on GPU 0"
                          for k in range(1, 4) for src in (" src-38fe1e5", "")]
    assert driver_run("all", "asyncstate").returncode != 0  # src-5173bee is not there yet: refused
    (repo / ".gpu" / "src-5173bee" / "src" / "hybridrl").mkdir(parents=True)
    (repo / ".gpu" / "src-5173bee" / "src" / "hybridrl" / "__init__.py").touch()
    assert driver_run("all", "asyncstate").returncode == 0
    both = _items(root / "gpu-h200" / "lane-asyncstate-1.log")
    assert both[:12] == [f"trainer-bench qwen3-0.6b hf mb 32{src} r{k} on GPU 0"
                         for k in range(1, 5) for src in (" src-38fe1e5", " src-5173bee", "")]
    assert both[12:] == [f"trainer-bench qwen3-30b-a3b megatron mb 16{src} r{k} on GPU 0"
                         for k in range(1, 4) for src in (" src-5173bee", "")]
    (repo / ".gpu" / "src-5bf06b5" / "src" / "hybridrl").mkdir(parents=True)
    (repo / ".gpu" / "src-5bf06b5" / "src" / "hybridrl" / "__init__.py").touch()
    assert driver_run("all", "exportstage").returncode == 0
    staged = _items(root / "gpu-h200" / "lane-exportstage-1.log")
    srcs = (" src-5bf06b5", "")
    assert staged == [f"trainer-bench qwen3-0.6b hf mb 32{src} r{k} on GPU 0" for k in (1, 2, 3) for src in srcs] + [
        f"trainer-bench qwen3-30b-a3b megatron mb 16{src} r{k} on GPU 0" for k in (1, 2) for src in srcs]


def test_a_source_snapshot_holds_the_commits_source(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    (repo / "src" / "hybridrl").mkdir(parents=True)
    script = repo / "scripts" / "gpu" / "snapshot-src.sh"
    shutil.copy(REPO / "scripts" / "gpu" / "snapshot-src.sh", script)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "src" / "hybridrl" / "__init__.py").write_text("OLD = 1\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "src" / "hybridrl" / "__init__.py").write_text("NEW = 1\n")  # the tree moves on; the snapshot does not
    done = subprocess.run(["bash", str(script), rev], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (repo / ".gpu" / f"src-{rev}" / "src" / "hybridrl" / "__init__.py").read_text() == "OLD = 1\n"
    bad = subprocess.run(["bash", str(script), "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "snapshot-src: no commit nope"


def _misnamed(monkeypatch: pytest.MonkeyPatch, second: str) -> None:
    """One plan more, whose second item is SECOND."""
    plan = one_lane("train sglang-colocate-megatron", second, study="config/gpu-h200-moefull.yaml")
    monkeypatch.setitem(plans._PLANS, "misnamed", lambda: dataclasses.replace(plan, name="misnamed"))


def test_a_plan_naming_a_run_its_study_lacks_is_refused_before_anything_runs(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # a plan whose second item misnames a run (as moe1full's HF item once did: it failed after the first run's
    # 11 minutes)
    _misnamed(monkeypatch, "train sglang-colocate-hf")
    root = tmp_path / "ref"
    (root / "gpu-h200-moefull").mkdir(parents=True)
    (root / "gpu-h200-moefull" / "setup.done").touch()
    lease = Lease(REPO, root, dry_run=True)
    # `all` and `start` (which checks every plan before it starts anything)
    for refuse in (lambda: run_plan(lease, "misnamed", io.StringIO()), lambda: check(lease, ["misnamed"])):
        with pytest.raises(Refused) as refused:
            refuse()
        assert refused.value.code == 2
        [line] = refused.value.message.splitlines()
        assert line.startswith("plan misnamed names runs its study (config/gpu-h200-moefull.yaml) does not have: "
                               "sglang-colocate-hf (it has: ")
        assert " sglang-colocate-megatron " in line and " sglang-colocate " in line
    assert not (root / "gpu-h200-moefull" / "lane-misnamed-1.log").exists()  # nothing ran
    # the same plan with the run's right name goes through
    _misnamed(monkeypatch, "train sglang-colocate")
    _dry_run(root, "misnamed")
    assert _items(root / "gpu-h200-moefull" / "lane-misnamed-1.log") == [
        "train sglang-colocate-megatron on GPU 0", "train sglang-colocate on GPU 0"]


def test_every_plan_loads_and_names_only_runs_of_its_study_on_gpus_it_has() -> None:
    """What each dry run before a lease checked: every item of every plan is well formed, every train, bench and
    fault item names a run its study writes, and every lane and item runs on GPUs the plan asks for."""
    names = plans.known_plans()
    assert len(names) == len(set(names)) >= 45
    runs: dict[str, list[str]] = {}
    for name in names:
        plan = plans.load_plan(name)
        assert plan.name == name and plan.description, name
        study = runs.setdefault(plan.study, runs_of(REPO / plan.study))
        for item in plan.items():
            if isinstance(item, Train | Bench | Fault):
                assert item.name in study, (name, item.text, plan.study)
        for phase in plan.phases:
            for lane in phase:
                assert lane.items, name
                for gpus in [lane.gpus] + [it.gpus for it in lane.items if isinstance(it, Train) and it.gpus]:
                    assert {int(g) for g in gpus.split(",")} <= set(range(plan.gpus)), (name, gpus)
        assert all(isinstance(it, TrainerTool) for it in plan.items() if it.text.startswith(("tbench", "tprof")))
    # only the verdict, client and vocabulary plans compare benchmarks over 5 repeats; nothing else changes the env
    assert {n for n in names if plans.load_plan(n).env} == {"client", "timed", "verdict", "verdictkv", "verdictvllm",
                                                           "verdictwarmkv", "vocabbench"}
    with pytest.raises(ValueError, match="not a plan item"):
        parse_item("bench sglang-full")  # no step: refused when the plan loads, not when its turn comes


def test_the_controller_path_follows_the_run_config_not_its_name(root: Path, tmp_path: Path) -> None:
    # a stand-in python3 that writes its PYTHONPATH and GPUs into the run's train.log (where the driver sends it)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/bash\necho "$PYTHONPATH|${CUDA_VISIBLE_DEVICES-unset}"\n')
    (bin_dir / "python3").chmod(0o755)
    study = root / "gpu-h200"
    (study / "cfg").mkdir()
    for name, engine, trainer in (("plain", "vllm-inprocess", "megatron"), ("vllm-inprocess-megatron", "sglang",
                                                                             "hf")):
        (study / "cfg" / f"{name}.json").write_text(_spec(f"{name}-id", engine, trainer))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "7"}
    out = _item(root, "train plain", "0,1", env)
    assert "train plain (plain-id) on GPU 0,1" in out and "train plain exit 0 (0 steps)" in out
    log = study / "runs" / "plain-id" / "train.log"
    assert log.read_text() == f"/tmp/envs/trainer:/tmp/envs/vllm:/tmp/ctl:{REPO}/src|0,1\n"
    assert (study / "runs" / "plain-id" / "config.json").read_text() == (study / "cfg" / "plain.json").read_text()
    _item(root, "train vllm-inprocess-megatron", None, env)  # no GPUs named: every GPU visible
    log = study / "runs" / "vllm-inprocess-megatron-id" / "train.log"
    assert log.read_text() == f"/tmp/ctl:{REPO}/src|unset\n"


def _site(root: Path, repo: Path = REPO) -> Site:
    return Site(repo, root, root / "gpu-h200")


def _item(root: Path, text: str, gpus: str | None, env: dict[str, str], repo: Path = REPO) -> str:
    """One item run for real in the default study (a stand-in python3 on env's PATH); what it said."""
    out = io.StringIO()
    run_item(parse_item(text), gpus, _site(root, repo), env, out)
    return out.getvalue()
