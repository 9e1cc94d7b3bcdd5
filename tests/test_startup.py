"""An engine's start split into its parts (hybridrl.engines.startup), from real engine logs of the committed GPU
studies and from made-up ones; and the in-process engine's log captured from the controller's own output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from hybridrl.engines.output_tee import OutputTee
from hybridrl.engines.startup import PARTS, TOTAL, UNEXPLAINED, combine, header, split_start, starts

REFERENCE = Path(__file__).resolve().parents[1] / "results" / "reference"
SGLANG_RUN = REFERENCE / "2026-11-27-h200-verdictinproc" / "runs" / "sglang-verdict-795e3683"
VLLM_RUN = REFERENCE / "2026-11-27-h200-verdictvllm" / "runs" / "vllm-verdict-4c49f35f"
INPROCESS_RUN = REFERENCE / "2026-11-27-h200-verdictinproc" / "runs" / "vllm-inprocess-verdict-cd807d87"
# its log kept only its head and tail: the lines between the KV cache and the server's start are gone
CUT_RUN = REFERENCE / "2026-11-24-h200-learning" / "runs" / "vllm-colocate-hf-qwen3-0.6b-warm-1bcaa0ac"
LOG_PARTS = ("import", "weights", "kv", "graphs", "ready")


def engine_start_s(run: Path, part: str = "") -> float:
    """The run's first engine start (or that start's part) as its first step recorded it."""
    key = f"timing_s/engine_start_{part}" if part else "timing_s/engine_start"
    return json.loads((run / "steps.jsonl").read_text().splitlines()[0])[key]


def first_start(run: Path, engine: str) -> dict[str, float | None]:
    """The split of the first start in a run's server log, against the run's recorded start time."""
    spawned, text = starts((run / "logs" / "engine.log").read_text(errors="replace"))[0]
    return split_start(text, engine, spawned=spawned, total_s=engine_start_s(run))


def assert_adds_up(split: dict[str, float | None], found: tuple[str, ...]) -> None:
    assert all(split[p] is not None and split[p] > 0 for p in found), split
    assert sum(split[p] for p in PARTS if split[p] is not None) <= split[TOTAL]
    assert split[UNEXPLAINED] == pytest.approx(split[TOTAL] - sum(split[p] for p in PARTS if split[p] is not None))


def test_a_real_sglang_start_is_split_into_every_part_and_little_is_left_unexplained() -> None:
    split = first_start(SGLANG_RUN, "sglang")
    assert_adds_up(split, LOG_PARTS)
    # its lines: spawned 12:07:00, weights begin 12:07:59, graphs 82.84 s by its own count, up 12:09:31, and its
    # own warm-up request done 12:09:42 (the controller's instant is not in a committed log)
    assert split["import"] == 59 and split["weights"] == 0.89 and split["graphs"] == 82.84
    assert split["kv"] == 7 and split["ready"] == 11
    assert split["first_request"] is None and 0 < split[UNEXPLAINED] < 5


def test_sglangs_graph_runner_set_up_before_the_capture_counts_with_its_graphs() -> None:
    # at TP 2 on a fresh machine: its KV pool at 07:33:25, then nothing logged until its FlashInfer all-reduce
    # fusion workspace and the capture's begin at 07:36:49, then the capture's own 100.18 s (the slower rank's)
    split = first_start(REFERENCE / "2026-11-28-4xh200-writeup" / "runs" / "sglang-writeup-f4e0f660", "sglang")
    assert_adds_up(split, LOG_PARTS)
    assert split["graphs"] == pytest.approx(204 + 100.18) and split[UNEXPLAINED] < 5


def test_a_real_vllm_server_start_is_split_and_ready_needs_the_controllers_instant() -> None:
    split = first_start(VLLM_RUN, "vllm")
    assert_adds_up(split, ("import", "weights", "kv", "graphs"))
    # torch.compile 41.54 s and capture 24 s, both as vLLM counts them; the profiling run 4.80 s, and its 3 s to
    # the KV cache's size left unexplained: this vLLM logs no graph-memory profiling to split them at
    assert split["graphs"] == pytest.approx(41.54 + 24) and split["kv"] == 4.80
    assert split["sampler"] is None
    assert split["ready"] is None  # its uvicorn line has no timestamp: the health check's instant is needed


def test_a_real_inprocess_vllm_log_gives_the_engines_parts_and_its_post_capture_gap_is_the_kernel_warmup() -> None:
    log = (INPROCESS_RUN / "train.log").read_text(errors="replace")
    total = engine_start_s(INPROCESS_RUN)
    split = split_start(log, "vllm-inprocess", total_s=total)  # no header in the controller's own output
    assert split["import"] is None and split["ready"] is None  # they need the controller's instants
    assert_adds_up(split, ("weights", "kv", "graphs", "warmup"))
    # capture finished 12:12:34 and the kernel warm-up's JIT monitor came up 12:14:28: the first start's gap
    assert split["warmup"] == 114


def test_vllms_kernel_warmup_is_minutes_on_a_machines_first_start_and_seconds_on_its_second() -> None:
    lease = REFERENCE / "2026-11-28-h100-verdict" / "runs"
    first, second = (first_start(lease / run, "vllm") for run in ("vllm-verdict-4c49f35f", "vllm-verdict-4c49f35f-r2"))
    assert first["warmup"] == 119 and second["warmup"] == 8  # 02:29:42 -> 02:31:41, then 02:34:38 -> 02:34:46
    assert first[UNEXPLAINED] < 10 and second[UNEXPLAINED] < 10  # what was a two-minute gap is accounted for


WRITEUP_DRAWN = REFERENCE / "2026-11-28-4xh200-writeupdrawn" / "runs"


def test_vllms_sampler_warmup_is_apart_from_its_kv_cache_minutes_on_a_machines_first_start() -> None:
    # TP 2 on a fresh machine: the profiling run 3.83 s, done 17:13:31; FlashInfer's sampling kernels built until
    # the first rank's graph-memory profiling at 17:15:39; the KV cache's size at 17:15:53
    run = WRITEUP_DRAWN / "vllm-writeup-4644f889"
    split = first_start(run, "vllm")
    assert split["sampler"] == 128 and split["kv"] == pytest.approx(3.83 + 14)
    # the two split the one span the run recorded as its KV cache, and share no second of it
    assert split["sampler"] + split["kv"] == pytest.approx(engine_start_s(run, "kv"))


def test_vllms_sampler_warmup_is_seconds_once_flashinfers_workspace_holds_its_kernels() -> None:
    # the same machine's next start, in process (its engine log has the controller's header): 17:21:09 -> 17:21:16
    split = first_start(WRITEUP_DRAWN / "vllm-inprocess-writeup-67c3b8ec-r2", "vllm-inprocess")
    assert split["sampler"] == 7 and split["kv"] == pytest.approx(1.96 + 7)  # 17:21:16 -> 17:21:23


def test_a_vllm_log_without_the_graph_memory_line_has_no_sampler_and_its_kv_is_the_profiling_run_alone() -> None:
    run = WRITEUP_DRAWN / "vllm-writeup-4644f889"
    spawned, text = starts((run / "logs" / "engine.log").read_text(errors="replace"))[0]
    whole = split_start(text, "vllm", spawned=spawned, total_s=engine_start_s(run))
    cut = "\n".join(line for line in text.splitlines() if "Profiling CUDA graph memory" not in line)
    split = split_start(cut, "vllm", spawned=spawned, total_s=engine_start_s(run))
    assert split["sampler"] is None and split["kv"] == 3.83
    assert split[UNEXPLAINED] == pytest.approx(whole[UNEXPLAINED] + 128 + 14)  # not put anywhere else
    assert {p: split[p] for p in PARTS if p not in ("kv", "sampler")} == {
        p: whole[p] for p in PARTS if p not in ("kv", "sampler")}


def test_sglang_has_no_sampler_part() -> None:
    assert first_start(SGLANG_RUN, "sglang")["sampler"] is None


def test_a_log_cut_in_the_middle_gives_none_for_the_parts_whose_lines_are_gone() -> None:
    split = first_start(CUT_RUN, "vllm")
    assert split["graphs"] is None and split["ready"] is None  # the capture's line is cut out, compile's kept
    assert_adds_up(split, ("import", "weights", "kv"))


def test_a_real_log_missing_one_marker_gives_none_for_that_part_alone() -> None:
    spawned, text = starts((SGLANG_RUN / "logs" / "engine.log").read_text(errors="replace"))[0]
    whole = split_start(text, "sglang", spawned=spawned, total_s=163.0)
    cut = "\n".join(line for line in text.splitlines() if "Load weight begin" not in line)
    split = split_start(cut, "sglang", spawned=spawned, total_s=163.0)
    assert split["import"] is None and whole["import"] == 59
    assert {p: split[p] for p in PARTS if p != "import"} == {p: whole[p] for p in PARTS if p != "import"}
    assert split[UNEXPLAINED] == pytest.approx(whole[UNEXPLAINED] + 59)  # its time is not put anywhere else


SGLANG_TP2 = """\
[2026-11-27 00:21:50] server_args=ServerArgs(...)
[2026-11-27 00:22:53 TP1] Load weight begin. avail mem=138.18 GB
[2026-11-27 00:22:54 TP0] Load weight begin. avail mem=137.37 GB
[2026-11-27 00:23:01 TP1] Load weight end. elapsed=7.88 s, type=Qwen3MoeForCausalLM
[2026-11-27 00:23:01 TP0] Load weight end. elapsed=7.96 s, type=Qwen3MoeForCausalLM
[2026-11-27 00:23:07 TP1] Memory pool end. avail mem=69.47 GB
[2026-11-27 00:23:09 TP0] Memory pool end. avail mem=68.65 GB
[2026-11-27 00:26:14 TP0] Capture target decode CUDA graph begin. backend=full
[2026-11-27 00:27:42 TP0] Capture target decode CUDA graph end. elapsed=88.08 s, mem usage=0.17 GB
[2026-11-27 00:27:42 TP1] Capture target decode CUDA graph end. elapsed=88.09 s, mem usage=0.17 GB
[2026-11-27 00:27:42] INFO:     Uvicorn running on http://127.0.0.1:38997 (Press CTRL+C to quit)
[2026-11-27 00:27:51] The server is fired up and ready to roll!
[2026-11-27 00:29:00 TP0] Load weight end. elapsed=99.00 s, a runtime line that must not count
"""


def test_ranks_each_logging_a_line_give_the_slowest_and_the_health_check_ends_ready() -> None:
    spawned, healthy = datetime(2026, 11, 27, 0, 21, 44, 600_000), datetime(2026, 11, 27, 0, 27, 50, 900_000)
    split = split_start(SGLANG_TP2, "sglang", spawned, healthy, total_s=380.5, first_request_s=0.25)
    # to the last rank's begin (each span: first begin to last end), the spawn taken to its second as the stamps are
    assert split["import"] == 70
    # the slower rank's capture, not the runtime line's, after the graph runner's set-up from the first rank's pool
    # (00:23:07) to the capture's begin (00:26:14)
    assert split["weights"] == 7.96 and split["graphs"] == pytest.approx(187 + 88.09)
    assert split["kv"] == 8  # from the first rank's weights end to the last rank's pool
    assert split["ready"] == 8 and split["first_request"] == 0.25  # the controller's instant, not the server's line
    assert split[UNEXPLAINED] == pytest.approx(380.5 - (70 + 7.96 + 8 + 187 + 88.09 + 8 + 0.25))
    assert split_start(SGLANG_TP2, "sglang", spawned)["ready"] == 9  # no instant: the server's own line


VLLM_NEW_YEAR = """\
(APIServer pid=1) INFO 12-31 23:59:58 [api_utils.py:273] non-default args: {}
(EngineCore pid=2) INFO 01-01 00:00:10 [model_runner.py:284] Loading model from scratch...
(EngineCore pid=2) INFO 01-01 00:00:13 [model_runner.py:305] Model loading took 1.12 GiB and 2.5 seconds
(EngineCore pid=2) INFO 01-01 00:00:20 [monitor.py:53] torch.compile took 6.50 s in total
(EngineCore pid=2) INFO 01-01 00:00:21 [monitor.py:81] Initial profiling/warmup run took 0.40 s
(EngineCore pid=2) INFO 01-01 00:00:23 [kv_cache_utils.py:2177] GPU KV cache size: 639,024 tokens
(EngineCore pid=2) INFO 01-01 00:00:35 [model_runner.py:747] Graph capturing finished in 11 secs, took 0.48 GiB
(EngineCore pid=2) INFO 01-01 00:01:30 [core.py:340] init engine (profile, create kv cache, warmup model) took 72 s
(APIServer pid=1) INFO:     Application startup complete.
"""


def test_vllms_stamps_without_a_year_read_across_new_year() -> None:
    spawned, healthy = datetime(2026, 12, 31, 23, 59, 55), datetime(2027, 1, 1, 0, 1, 33, 500_000)
    split = split_start(VLLM_NEW_YEAR, "vllm", spawned, healthy, total_s=100.0, first_request_s=1.0)
    assert (split["import"], split["weights"], split["ready"]) == (15, 2.5, 3)
    # no graph-memory line: the profiling run's 0.40 s alone, its 2 s to the KV cache's size unexplained
    assert split["kv"] == 0.40 and split["graphs"] == pytest.approx(6.50 + 11)
    # and capture's end to the initialised line: 55 s that no part holds
    assert split[UNEXPLAINED] == pytest.approx(100 - (15 + 2.5 + 0.4 + 17.5 + 3 + 1))
    assert split["first_request"] == 1.0


def test_an_engine_without_markers_keeps_only_what_the_controller_timed() -> None:
    split = split_start(SGLANG_TP2, "toy", datetime(2026, 1, 1), datetime(2026, 1, 1, 0, 1), 61.0, 0.5)
    assert all(split[p] is None for p in LOG_PARTS)
    assert (split["first_request"], split[UNEXPLAINED], split[TOTAL]) == (0.5, 60.5, 61.0)


def test_starts_cut_an_appended_log_at_the_controllers_headers_and_combine_sums_them() -> None:
    log = ("a cut head without its header\n" + header("python3 -m sglang.launch_server", datetime(2026, 1, 2, 3, 4, 5))
           + "first\n" + header("python3 -m sglang.launch_server", datetime(2026, 1, 2, 3, 9, 0)) + "second\n")
    assert [(at, text.strip()) for at, text in starts(log)] == [(datetime(2026, 1, 2, 3, 4, 5), "first"),
                                                                (datetime(2026, 1, 2, 3, 9), "second")]
    a, b = dict.fromkeys((*PARTS, UNEXPLAINED, TOTAL), 1.0), dict.fromkeys((*PARTS, UNEXPLAINED, TOTAL), 2.0)
    b["ready"] = None
    both = combine([a, b])
    assert both["weights"] == 3.0 and both[TOTAL] == 3.0 and both["ready"] is None
    assert all(v is None for v in combine([]).values())


CHILD = "import sys, time; time.sleep(0.5); print('child, after the capture', flush=True)"


def test_the_tee_copies_a_child_started_inside_to_the_file_until_it_exits_and_nothing_after(tmp_path, capfd):
    tee = OutputTee(tmp_path / "logs" / "engine.log")
    # the fds themselves: pytest's capture puts its own objects in sys.stdout and sys.stderr
    with tee.capture("==== head\n"):
        os.write(1, b"parent, inside\n")
        os.write(2, b"parent's stderr, inside\n")
        child = subprocess.Popen([sys.executable, "-c", CHILD])
    os.write(1, b"parent, after\n")
    assert child.wait(timeout=30) == 0
    assert tee.wait(10)  # the child's exit ends the copying
    text = tee.text()
    assert "parent, inside" in text and "parent's stderr, inside" in text and "child, after the capture" in text
    assert "parent, after" not in text and "head" not in text  # the header comes before the capture's text
    assert (tmp_path / "logs" / "engine.log").read_text().startswith("==== head\n")
    out, err = capfd.readouterr()  # and all of it still reaches the process's own output, each on its own fd
    assert "parent, inside" in out and "child, after the capture" in out and "parent, after" in out
    assert "parent's stderr, inside" in err


def test_parts_that_pass_the_whole_by_their_stamps_rounding_leave_nothing_unexplained() -> None:
    # a run recorded its parts 0.15 s over its whole start: each part read from one-second stamps may be up to a
    # second long. Here the same start's parts against a whole half a second short of them.
    run = REFERENCE / "2026-11-28-4xh200-writeupdrawn" / "runs" / "sglang-writeup-fafc5d80"
    spawned, text = starts((run / "logs" / "engine.log").read_text(errors="replace"))[0]
    parts = split_start(text, "sglang", spawned=spawned)
    found = sum(parts[p] for p in PARTS if parts[p] is not None)
    split = split_start(text, "sglang", spawned=spawned, total_s=found - 0.5)
    assert split[UNEXPLAINED] == 0
    # a shortfall beyond the stamps' rounding is no rounding: it stays negative, to be seen
    short = split_start(text, "sglang", spawned=spawned, total_s=found - 60)
    assert short[UNEXPLAINED] == pytest.approx(-60)
