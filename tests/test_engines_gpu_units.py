"""GPU engines: what can be checked without a GPU (request bodies, stream parsing, tags, flags, devices)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from hybridrl import nvml
from hybridrl.engines.base import EngineError, Request, Sampling
from hybridrl.engines.gpus import nvml_indices, split_engine_devices, visible_devices
from hybridrl.engines.sglang import (
    SGLangServer,
    generate_body,
    kv_capacity_from_info,
    parse_chunk,
    release_tags,
)
from hybridrl.engines.vllm import VLLMServer, engine_flags
from hybridrl.engines.vllm_inprocess import VLLMInProcess, sampled_logprobs, sampling_kwargs
from hybridrl.study.run_config import RunConfig


def _run(**over) -> RunConfig:
    run = {"engine": "sglang", "placement": "colocate", "device": "cuda", "tp": 1, "seed": 7, "model": "m",
           "gpu_memory_utilization": 0.5, "max_concurrency": 64, "sglang_release": "kv_cache",
           "vllm_sleep_level": 1, "engine_args": [], "startup_timeout_s": 60, "request_timeout_s": 60,
           "lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}}
    return RunConfig.model_validate({**run, **over})


# -- SGLang: release tags ------------------------------------------------------------------------
def test_kv_cache_policy_keeps_weights_resident():
    assert release_tags("kv_cache") == ["kv_cache", "cuda_graph"]
    assert "weights" not in release_tags("kv_cache")


def test_all_policy_names_every_tag_explicitly():
    tags = release_tags("all")
    assert set(tags) == {"kv_cache", "weights", "cuda_graph"}


def test_unknown_policy_is_an_error():
    with pytest.raises(EngineError, match="sglang_release"):
        release_tags("everything")


def test_release_tags_are_a_fresh_list():
    release_tags("kv_cache").append("weights")
    assert release_tags("kv_cache") == ["kv_cache", "cuda_graph"]


# -- SGLang: command line -------------------------------------------------------------------------
def test_command_has_memory_saver_and_lora(model_dir: Path, tmp_path: Path):
    eng = SGLangServer(model_dir, _run(), {"python": "py"}, tmp_path)
    cmd = eng.command(1234, None)
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    assert "--enable-memory-saver" in cmd and "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8"
    i = cmd.index("--lora-target-modules")
    assert cmd[i + 1 : i + 3] == ["q_proj", "v_proj"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--context-length") + 1] == "4096"
    assert "--enable-weights-cpu-backup" not in cmd
    assert "--lora-paths" not in cmd


def test_sglang_listens_for_its_nccl_rendezvous_on_the_port_its_start_claimed(model_dir: Path, tmp_path: Path):
    """Left to itself SGLang draws its NCCL port at random near --port, at any TP: two jobs on one node can meet."""
    eng = SGLangServer(model_dir, _run(), {}, tmp_path)
    assert eng.own_ports == ("nccl",)
    assert "--nccl-port" not in eng.command(1234, None)  # no start, no port taken
    eng.ports = {"engine_http": 1234, "nccl": 1299}  # what start() took
    cmd = eng.command(1234, None)
    assert cmd[cmd.index("--nccl-port") + 1] == "1299" and cmd[cmd.index("--port") + 1] == "1234"
    assert "--nccl-port" in eng.describe()["command"]  # the provenance's command line names it too


def test_sglang_without_text_starts_with_its_tokenizer_skipped(model_dir: Path, tmp_path: Path):
    """sglang_detokenize false: --skip-tokenizer-init, so no detokenizer turns tokens into text the run never reads
    (its requests carry token ids, its answers are read for output_ids and logprobs only)."""
    assert "--skip-tokenizer-init" not in SGLangServer(model_dir, _run(), {}, tmp_path).command(1, None)
    ids_only = SGLangServer(model_dir, _run(sglang_detokenize=False), {}, tmp_path).command(1, None)
    assert "--skip-tokenizer-init" in ids_only
    answer = {"output_ids": [5, 6], "meta_info": {"completion_tokens": 2, "finish_reason": {"type": "length"},
                                                  "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]]}}
    assert parse_chunk(answer, 0) == ([5, 6], [-0.5, -0.25], "length")  # the answer's shape without text


def test_release_all_always_keeps_a_cpu_backup(model_dir: Path, tmp_path: Path):
    eng = SGLangServer(model_dir, _run(sglang_release="all"), {}, tmp_path)
    assert "--enable-weights-cpu-backup" in eng.command(1, None)
    assert eng.tags == ["kv_cache", "weights", "cuda_graph"]


def test_release_all_keeps_its_pinned_cpu_copy_between_sleeps_unless_told_not_to(model_dir: Path, tmp_path: Path,
                                                                                 monkeypatch):
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "1")  # an inherited value must not decide it
    off = SGLangServer(model_dir, _run(sglang_release="all", sglang_retain_cpu_backup=False), {}, tmp_path)
    assert off.environment()["TMS_RETAIN_CPU_BACKUP"] == "0"
    on = SGLangServer(model_dir, _run(sglang_release="all"), {}, tmp_path)
    assert on.environment()["TMS_RETAIN_CPU_BACKUP"] == "1"
    assert on.describe()["env"]["TMS_RETAIN_CPU_BACKUP"] == "1"  # recorded with the run
    monkeypatch.delenv("TMS_RETAIN_CPU_BACKUP")
    kv = SGLangServer(model_dir, _run(sglang_release="kv_cache"), {}, tmp_path)
    assert "TMS_RETAIN_CPU_BACKUP" not in kv.environment()  # no CPU copy to keep


@pytest.mark.parametrize(("settings", "checked"), [
    ({"tp": 2, "keep_base_on_gpu": True}, False),  # the trainer's base fills one GPU of the group
    ({"tp": 2}, True),
    ({"tp": 1, "keep_base_on_gpu": True}, True),
    ({"tp": 2, "keep_base_on_gpu": True, "placement": "split"}, True),  # the trainer has GPUs of its own
])
def test_sglang_tp_memory_balance_check_is_off_only_beside_a_resident_trainer_base(
        model_dir: Path, tmp_path: Path, settings: dict, checked: bool):
    env = SGLangServer(model_dir, _run(**settings), {}, tmp_path).environment()
    assert ("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK" not in env) is checked
    if not checked:
        assert env["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] == "0"


def test_restart_with_adapter_preloads_it(model_dir: Path, tmp_path: Path):
    eng = SGLangServer(model_dir, _run(engine_args=["--disable-cuda-graph"]), {}, tmp_path)
    cmd = eng.command(1, ("policy", Path("/a/step-0002")))
    assert cmd[cmd.index("--lora-paths") + 1] == "policy=/a/step-0002"
    assert cmd[-1] == "--disable-cuda-graph"  # study flags come last


def test_sglang_refuses_cpu(model_dir: Path, tmp_path: Path):
    with pytest.raises(EngineError, match="CPU"):
        SGLangServer(model_dir, _run(device="cpu"), {}, tmp_path)


def test_engine_env_drops_controller_pythonpath(model_dir: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/controller/src")
    eng = SGLangServer(model_dir, _run(), {"env": {"PYTHONPATH": "/tmp/envs/sglang"}}, tmp_path)
    assert eng.environment()["PYTHONPATH"] == "/tmp/envs/sglang"
    eng = SGLangServer(model_dir, _run(), {}, tmp_path)
    assert "PYTHONPATH" not in eng.environment()


# -- SGLang: request bodies and the stream ----------------------------------------------------------
def test_generate_body_token_ids_logprobs_and_adapter():
    req = Request([1, 2, 3], Sampling(temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=5,
                                      ignore_eos=True, seed=11), adapter="policy", stream=True)
    body = generate_body(req)
    assert body["input_ids"] == [1, 2, 3]
    assert body["stream"] is True and body["return_logprob"] is True
    assert body["lora_path"] == "policy"
    assert body["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                                       "ignore_eos": True, "sampling_seed": 11}


def test_generate_body_base_model_has_no_lora_path():
    body = generate_body(Request([4], Sampling()))
    assert "lora_path" not in body and "sampling_seed" not in body["sampling_params"]
    assert body["stream"] is False  # a request answered whole: the rollout client's default


def _chunk(ids, lps, total, finish=None):
    return {"text": "", "output_ids": ids,
            "meta_info": {"completion_tokens": total, "finish_reason": finish,
                          "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]}}


def test_incremental_chunks_are_taken_whole():
    assert parse_chunk(_chunk([5, 6], [-0.1, -0.2], 2), 0) == ([5, 6], [-0.1, -0.2], None)
    assert parse_chunk(_chunk([7], [-0.3], 3), 2) == ([7], [-0.3], None)


def test_cumulative_chunks_drop_what_was_seen():
    ids, lps, finish = parse_chunk(_chunk([5, 6, 7], [-0.1, -0.2, -0.3], 3, {"type": "length", "length": 3}), 2)
    assert (ids, lps, finish) == ([7], [-0.3], "length")


def test_stream_of_cumulative_events_rebuilds_the_output():
    events = [_chunk([5], [-0.1], 1), _chunk([5, 6, 7], [-0.1, -0.2, -0.3], 3),
              _chunk([5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], 4)]
    got, lps = [], []
    for e in events:
        i, lp, _ = parse_chunk(e, len(got))
        got += i
        lps += lp
    assert got == [5, 6, 7, 8] and lps == [-0.1, -0.2, -0.3, -0.4]


def test_stop_finish_reason_and_missing_logprobs():
    chunk = {"output_ids": [9], "meta_info": {"completion_tokens": 1, "finish_reason": {"type": "stop", "matched": 2}}}
    assert parse_chunk(chunk, 0) == ([9], [], "stop")


def test_abort_is_an_engine_error():
    chunk = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "out of memory"}}}
    with pytest.raises(EngineError, match="out of memory"):
        parse_chunk(chunk, 0)


def test_kv_capacity_prefers_the_schedulers_live_reading():
    info = {"max_total_num_tokens": 1000, "internal_states": [{"memory_usage": {"token_capacity": 990}}]}
    assert kv_capacity_from_info(info) == 990
    assert kv_capacity_from_info({"max_total_num_tokens": 1000, "internal_states": [{}]}) == 1000
    assert kv_capacity_from_info({}) is None


# -- devices ---------------------------------------------------------------------------------------
def test_visible_devices_and_nvml_indices():
    assert visible_devices({}) is None
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "1, 3"}) == ["1", "3"]
    assert nvml_indices({"CUDA_VISIBLE_DEVICES": "1,3"}) == [1, 3]
    assert nvml_indices({"CUDA_VISIBLE_DEVICES": "GPU-abc"}) is None


def test_split_engine_takes_the_last_gpus():
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert split_engine_devices(_run(placement="split"), env) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert split_engine_devices(_run(placement="split", tp=2), {"CUDA_VISIBLE_DEVICES": "0,1,2"}) == \
        {"CUDA_VISIBLE_DEVICES": "1,2"}


def test_split_on_one_gpu_and_other_placements_change_nothing():
    assert split_engine_devices(_run(placement="split"), {"CUDA_VISIBLE_DEVICES": "0"}) == {}
    assert split_engine_devices(_run(placement="colocate"), {"CUDA_VISIBLE_DEVICES": "0,1"}) == {}
    assert split_engine_devices(_run(placement="split", device="cpu"), {"CUDA_VISIBLE_DEVICES": "0,1"}) == {}


# -- vLLM in-process -------------------------------------------------------------------------------
def test_inprocess_flags_match_the_server(model_dir: Path):
    args = engine_flags(model_dir, _run(engine="vllm-inprocess", engine_args=["--enforce-eager"]))
    assert "--enable-sleep-mode" in args and "--enable-lora" in args
    assert args[args.index("--max-lora-rank") + 1] == "8"
    assert args[-1] == "--enforce-eager"
    cpu = engine_flags(model_dir, _run(device="cpu"))
    assert "--enable-sleep-mode" not in cpu and "--gpu-memory-utilization" not in cpu


@pytest.mark.parametrize("over", [{}, {"device": "cpu"}, {"engine_args": ["--enforce-eager"], "tp": 2}])
def test_both_vllm_engines_start_with_the_same_flags(model_dir: Path, tmp_path: Path, over):
    server = VLLMServer(model_dir, _run(engine="vllm", **over), {"python": "py"}, tmp_path)
    inprocess = VLLMInProcess(model_dir, _run(engine="vllm-inprocess", **over), {}, tmp_path)
    cmd = server.command(1234, None)
    assert cmd[:7] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", "1234"]
    assert cmd[7:] == inprocess.cli_args() == engine_flags(model_dir, _run(engine="vllm", **over))
    assert cmd[cmd.index("--max-model-len") + 1] == "4096" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    with_adapter = server.command(1, ("policy", Path("/a/step-0002")))
    assert with_adapter[with_adapter.index("--lora-modules") + 1] == "policy=/a/step-0002"


def test_inprocess_sampling_kwargs():
    kw = sampling_kwargs(Sampling(temperature=0.5, max_new_tokens=9, ignore_eos=True, seed=3))
    assert kw["max_tokens"] == 9 and kw["logprobs"] == 0 and kw["seed"] == 3 and kw["ignore_eos"] is True
    assert kw["detokenize"] is True  # vLLM's default, unless the run says otherwise (vllm_detokenize)


class _LP:
    def __init__(self, v: float) -> None:
        self.logprob = v


def test_sampled_logprobs_pick_the_sampled_token():
    per_pos = [{5: _LP(-0.5), 9: _LP(-2.0)}, {6: _LP(-0.25)}]
    assert sampled_logprobs([5, 6], per_pos) == [-0.5, -0.25]
    assert sampled_logprobs([5], None) == []
    got = sampled_logprobs([7], [{5: _LP(-1.0)}])
    assert got[0] != got[0]  # NaN where the engine did not report the sampled token


# -- adapter reloads under a reused name -------------------------------------------------------------
def _record_posts(monkeypatch, module) -> list:
    calls: list = []

    class _Resp:
        content = b""

        def json(self) -> dict:
            return {}

    def fake_post(url, path, payload=None, **kw):
        calls.append((path, payload))
        return _Resp()

    from hybridrl.engines import server

    monkeypatch.setattr(server, "post_json", fake_post)  # every control call goes through HTTPEngine._post
    return calls


def test_vllm_server_reloads_by_unload_then_load(model_dir: Path, tmp_path: Path, monkeypatch):
    from hybridrl.engines import vllm as vllm_mod

    calls = _record_posts(monkeypatch, vllm_mod)
    eng = vllm_mod.VLLMServer(model_dir, _run(engine="vllm"), {}, tmp_path)
    monkeypatch.setattr(eng, "_url", lambda: "http://127.0.0.1:1")
    eng.load_adapter("policy", Path("/a/1"))
    eng.load_adapter("policy", Path("/a/2"))
    assert [c[0] for c in calls] == ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/load_lora_adapter"]
    assert all("load_inplace" not in (c[1] or {}) for c in calls)  # sticky in vLLM 0.26: reloads every request


def test_sglang_reloads_by_unload_then_load_and_sleeps_with_tags(model_dir: Path, tmp_path: Path, monkeypatch):
    from hybridrl.engines import sglang as sglang_mod

    calls = _record_posts(monkeypatch, sglang_mod)
    monkeypatch.setattr(nvml, "used_gb", lambda indices=None: 1.0)
    monkeypatch.setattr(nvml, "process_used_gb", lambda pid=None, indices=None: 0.5)
    eng = SGLangServer(model_dir, _run(), {}, tmp_path)
    monkeypatch.setattr(eng, "_url", lambda: "http://127.0.0.1:1")
    eng.load_adapter("policy", Path("/a/1"))
    eng.load_adapter("policy", Path("/a/2"))
    eng.sleep()
    eng.wake()
    paths = [c[0] for c in calls]
    assert paths == ["/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter",
                     "/release_memory_occupation", "/resume_memory_occupation"]
    assert calls[3][1] == calls[4][1] == {"tags": ["kv_cache", "cuda_graph"]}
    assert eng.step_metrics() == {"mem/engine_asleep_gb": 1.0, "mem/engine_awake_gb": 1.0, "mem/controller_gb": 0.5}
    assert eng.step_metrics() == {}


def test_vllm_flush_retries_until_the_reset_succeeds_and_fails_loudly(model_dir: Path, tmp_path: Path, monkeypatch):
    from hybridrl.engines import vllm as vllm_mod

    answers: list = []

    class _Resp:
        def __init__(self, body):
            self.body = body

        def json(self):
            if self.body is None:
                raise ValueError("empty body")  # older vLLM: a bare 200
            return self.body

    def fake_post(url, path, payload=None, **kw):
        return _Resp(answers.pop(0) if answers else {"success": False})

    from hybridrl.engines import server

    monkeypatch.setattr(server, "post_json", fake_post)
    monkeypatch.setattr(vllm_mod.time, "sleep", lambda s: None)
    eng = vllm_mod.VLLMServer(model_dir, _run(engine="vllm"), {}, tmp_path)
    monkeypatch.setattr(eng, "_url", lambda: "http://127.0.0.1:1")
    answers[:] = [{"success": False}, {"success": True}]
    eng.flush_cache()
    assert answers == []  # it asked again after the first refusal
    answers[:] = [None]
    eng.flush_cache()  # an empty 200 counts as done
    with pytest.raises(EngineError, match="success=false"):
        eng.flush_cache()  # held blocks that never free: one clear error, not stale prefixes


# -- vLLM: NVLink multicast stays off where the host turns it off -----------------------------------
@pytest.mark.parametrize("host", [{"NCCL_NVLS_ENABLE": "0"}, {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}])
def test_vllm_server_keeps_allreduce_off_multicast_where_the_host_does(model_dir: Path, tmp_path: Path,
                                                                        monkeypatch, host):
    from hybridrl.engines import vllm as vllm_mod

    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", *vllm_mod.MULTICAST_OFF_VLLM_ENV):
        monkeypatch.delenv(key, raising=False)
    run = _run(engine="vllm", tp=2)
    assert "VLLM_FLASHINFER_ALLREDUCE_BACKEND" not in vllm_mod.VLLMServer(model_dir, run, {}, tmp_path).environment()
    for key, value in host.items():
        monkeypatch.setenv(key, value)
    env = vllm_mod.VLLMServer(model_dir, run, {}, tmp_path).environment()
    assert env["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == "trtllm" and env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    # an explicit choice wins: the host's, then the study's engine env
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_SYMM_MEM", "1")
    spec = {"env": {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "mnnvl"}}
    env = vllm_mod.VLLMServer(model_dir, run, spec, tmp_path).environment()
    assert env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "1" and env["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == "mnnvl"


def test_vllm_inprocess_keeps_allreduce_off_multicast_where_the_host_does(model_dir: Path, tmp_path: Path,
                                                                          monkeypatch):
    from hybridrl.engines.vllm import MULTICAST_OFF_VLLM_ENV
    from hybridrl.engines.vllm_inprocess import VLLMInProcess

    for key in MULTICAST_OFF_VLLM_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    eng = VLLMInProcess(model_dir, _run(engine="vllm-inprocess", tp=2), {}, tmp_path)
    assert {k: eng._env[k] for k in MULTICAST_OFF_VLLM_ENV} == MULTICAST_OFF_VLLM_ENV
    monkeypatch.setenv("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "mnnvl")  # the host's own choice is left alone
    eng = VLLMInProcess(model_dir, _run(engine="vllm-inprocess", tp=2), {}, tmp_path)
    assert "VLLM_FLASHINFER_ALLREDUCE_BACKEND" not in eng._env


# -- preflight: a missing engine is named before the trainer is built ------------------------------
def test_preflight_names_an_engine_missing_from_its_environment(model_dir: Path, tmp_path: Path):
    import sys

    overlay = tmp_path / "overlay"
    overlay.mkdir()
    engine = SGLangServer(model_dir, _run(), {"python": sys.executable, "env": {"PYTHONPATH": str(overlay)}},
                          tmp_path / "logs")
    with pytest.raises(EngineError, match=f"sglang is not installed for {sys.executable} with "
                                          f"PYTHONPATH={overlay}: none of sglang is importable there"):
        engine.preflight()
    # the overlay that holds it (here only its metadata) makes the same engine pass, with its version
    (overlay / "sglang-0.5.16.dist-info").mkdir()
    (overlay / "sglang-0.5.16.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\n"
                                                                 "Version: 0.5.16\n")
    assert engine.preflight() == "0.5.16"


def test_preflight_names_a_missing_interpreter(model_dir: Path, tmp_path: Path):
    engine = SGLangServer(model_dir, _run(), {"python": "/nonexistent/bin/python3"}, tmp_path / "logs")
    with pytest.raises(EngineError, match="no Python interpreter '/nonexistent/bin/python3' for the engine"):
        engine.preflight()


def test_inprocess_stop_cancels_the_output_reader_before_the_engine_core_goes(model_dir: Path, tmp_path: Path):
    # vLLM's own shutdown stops the core first, and the reader task then logs EngineDeadError
    eng = VLLMInProcess(model_dir, _run(engine="vllm-inprocess"), {}, tmp_path)
    order: list[str] = []

    async def read_outputs() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            order.append("reader cancelled")
            raise

    class FakeLLM:
        output_handler = None

        def shutdown(self) -> None:
            order.append("core shut down")

    async def spawn() -> asyncio.Task:
        return asyncio.get_running_loop().create_task(read_outputs())

    llm = FakeLLM()
    eng.llm = llm
    llm.output_handler = eng._call(spawn())
    eng.stop()
    assert order == ["reader cancelled", "core shut down"]
    assert eng.llm is None and eng._loop is None


def test_inprocess_stop_lets_tasks_that_vllms_shutdown_cancels_finish_before_the_loop_stops(model_dir: Path,
                                                                                         tmp_path: Path):
    # vLLM's shutdown, called from outside the loop, only schedules the cancel of its output-queue task; a loop
    # stopped at once left that task pending, and Python said "Task was destroyed but it is pending!" at exit
    eng = VLLMInProcess(model_dir, _run(engine="vllm-inprocess"), {}, tmp_path)

    async def spawn() -> asyncio.Task:
        return asyncio.get_running_loop().create_task(asyncio.sleep(3600), name="EngineCoreOutputQueueTask")

    queue_task = eng._call(spawn())
    loop = eng._loop

    class FakeLLM:
        output_handler = None

        def shutdown(self) -> None:
            loop.call_soon_threadsafe(queue_task.cancel)

    eng.llm = FakeLLM()
    eng.stop()
    assert queue_task.done() and queue_task.cancelled()
    assert loop.is_closed() and eng._loop is None


# -- the engines' own per-request timing (run key engine_timing) ---------------------------------------
def test_engine_timing_asks_each_engine_for_its_request_stats_and_only_then(model_dir: Path, tmp_path: Path):
    def sglang(**over):
        return SGLangServer(model_dir, _run(**over), {"python": "py"}, tmp_path).command(1, None)

    def vllm(**over):
        return VLLMServer(model_dir, _run(engine="vllm", **over), {"python": "py"}, tmp_path).command(1, None)

    assert "--enable-metrics" not in sglang() and "--enable-metrics" in sglang(engine_timing=True)
    # and every token reaches its API server, whose first-token stamp a whole answer's timing then rests on
    env = SGLangServer(model_dir, _run(engine_timing=True), {"python": "py"}, tmp_path).environment()
    assert env["SGLANG_FORCE_STREAM_INTERVAL"] == "1"
    plain = SGLangServer(model_dir, _run(), {"python": "py"}, tmp_path).environment()
    assert "SGLANG_FORCE_STREAM_INTERVAL" not in plain
    assert "--enable-per-request-metrics" not in vllm()
    on = vllm(engine_timing=True, engine_args=["--enforce-eager"])
    assert "--enable-per-request-metrics" in on and on[-1] == "--enforce-eager"  # the study's args stay last
    # a flag of vLLM's HTTP server: the in-process engine's parser would refuse it
    inprocess = VLLMInProcess(model_dir, _run(engine="vllm-inprocess", engine_timing=True), {}, tmp_path)
    assert "--enable-per-request-metrics" not in inprocess.cli_args()


def test_sglang_timing_counts_from_arrival_to_the_prefill_then_per_later_token():
    from hybridrl.engines.sglang import answer_timing

    meta = {"request_received_ts": 100.0, "prefill_finished_time": 100.25, "request_finished_ts": 101.27,
            "completion_tokens": 256}
    ttft, tpot = answer_timing({"meta_info": meta})
    assert ttft == pytest.approx(0.25) and tpot == pytest.approx(1.02 / 255)
    # a server started without --enable-metrics sends no stamps: unknown, never zero
    assert all(math.isnan(x) for x in answer_timing({"meta_info": {"completion_tokens": 256, "e2e_latency": 1.3}}))
    assert math.isnan(answer_timing({"meta_info": {**meta, "completion_tokens": 1}})[1])  # one token: no TPOT
    # SGLang 0.5.16 on the H200 sent no prefill stamp: the API server's first token, from its decode throughput
    api = {"request_received_ts": 100.0, "request_finished_ts": 101.27, "decode_throughput": 250.0,
           "completion_tokens": 256}
    assert answer_timing({"meta_info": api}) == pytest.approx((0.25, 1 / 250.0))
    one = {"request_received_ts": 100.0, "request_finished_ts": 100.2, "completion_tokens": 1}
    ttft, tpot = answer_timing({"meta_info": one})
    assert ttft == pytest.approx(0.2) and math.isnan(tpot)


def test_vllm_timing_adds_the_queue_to_its_time_to_first_token():
    from hybridrl.engines.vllm import answer_timing

    answer = {"choices": [], "metrics": {"queue_time_ms": 40.0, "time_to_first_token_ms": 210.0,
                                         "mean_itl_ms": 7.5, "generation_time_ms": 1912.5}}
    assert answer_timing(answer) == pytest.approx((0.25, 0.0075))
    assert all(math.isnan(x) for x in answer_timing({"choices": [], "metrics": None}))
    assert math.isnan(answer_timing({"metrics": {"time_to_first_token_ms": 210.0}})[0])  # no queue: unknown


def test_inprocess_timing_reads_vllms_request_stats_like_the_server():
    from types import SimpleNamespace

    from hybridrl.engines.vllm_inprocess import stats_timing

    stats = SimpleNamespace(queued_ts=10.0, scheduled_ts=10.04, first_token_ts=10.25, last_token_ts=12.1625)
    assert stats_timing(stats, 256) == pytest.approx((0.25, 1.9125 / 255))
    assert all(math.isnan(x) for x in stats_timing(None, 256))  # stats off: unknown


@pytest.mark.parametrize("detokenize", [True, False])
def test_inprocess_asks_vllm_for_text_only_where_the_run_does(model_dir: Path, tmp_path: Path, monkeypatch,
                                                               detokenize: bool):
    """The run's vllm_detokenize reaches every request's SamplingParams; the completion is token ids and
    logprobs either way (the run decodes them in its reward phase)."""
    import sys
    from types import ModuleType, SimpleNamespace

    class SamplingParams:
        def __init__(self, **kw) -> None:
            self.kw = kw

    vllm, sampling = ModuleType("vllm"), ModuleType("vllm.sampling_params")
    vllm.SamplingParams = SamplingParams
    sampling.RequestOutputKind = SimpleNamespace(DELTA="delta", FINAL_ONLY="final")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    seen: list[dict] = []

    class FakeLLM:
        async def generate(self, prompt, params, request_id, lora_request=None):
            seen.append(params.kw)
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[4, 5], logprobs=[{4: _LP(-0.5)}, {5: _LP(-1.0)}],
                                                           finish_reason="length")])

        def shutdown(self) -> None:
            pass

    eng = VLLMInProcess(model_dir, _run(engine="vllm-inprocess", vllm_detokenize=detokenize), {}, tmp_path)
    eng.llm = FakeLLM()
    try:
        done = eng.generate([Request([1, 2], Sampling(max_new_tokens=2))])
    finally:
        eng.stop()
    assert [kw["detokenize"] for kw in seen] == [detokenize]
    assert (done[0].token_ids, done[0].logprobs, done[0].finish_reason) == ([4, 5], [-0.5, -1.0], "length")
