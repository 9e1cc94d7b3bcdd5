"""What each step records about the machine it ran on: the GPUs' clock, power, temperature and slowdown during
rollout and training (NVML), and the CPU of the run's busiest thread (/proc)."""

from __future__ import annotations

import multiprocessing
import sys
import time
import types
from pathlib import Path

import pytest

from hybridrl import nvml
from hybridrl.proc import descendants, thread_cpu_ticks
from hybridrl.run import telemetry
from hybridrl.run.record import GPU, RECORD_KEYS, STRINGS
from hybridrl.run.telemetry import MemorySampler, Timings, limiting, run_thread_ticks, thread_load


def _stat(pid: int, name: str, ppid: int, utime: int = 0, stime: int = 0) -> str:
    """A /proc stat line: pid (comm) state ppid ... utime (field 14) stime (field 15)."""
    return f"{pid} ({name}) S {ppid} {pid} {pid} 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0\n"


def _fake_proc(root: Path, procs: dict[int, tuple[str, int, dict[int, tuple[str, int, int]]]]) -> Path:
    """A fake /proc: pid -> (name, parent, {tid: (thread name, utime, stime)})."""
    for pid, (name, ppid, threads) in procs.items():
        (root / str(pid) / "task").mkdir(parents=True)
        (root / str(pid) / "stat").write_text(_stat(pid, name, ppid))
        for tid, (tname, utime, stime) in threads.items():
            (root / str(pid) / "task" / str(tid)).mkdir()
            (root / str(pid) / "task" / str(tid) / "stat").write_text(_stat(tid, tname, ppid, utime, stime))
    return root


def test_the_runs_threads_are_every_thread_below_the_controller(tmp_path: Path) -> None:
    # 100 the controller; 200 an engine server (a name with a space and a parenthesis), 201 its scheduler;
    # 300 another job's process under init
    proc = _fake_proc(tmp_path, {
        100: ("python", 1, {100: ("python", 5, 1)}),
        200: ("sglang (server", 100, {200: ("sglang (server", 1, 1), 205: ("loop", 7, 3)}),
        201: ("sglang::scheduler", 200, {201: ("sglang::schedul", 40, 2)}),
        300: ("other", 1, {300: ("other", 99, 99)}),
        400: ("python3", 100, {400: ("python3", 60, 10), 401: ("asyncio_0", 1, 0)}),
    })
    (proc / "400" / "cmdline").write_bytes(b"/env/bin/python3\0-m\0vllm.entrypoints.openai.api_server\0--port\0")
    assert sorted(descendants(100, proc)) == [200, 201, 400]
    ticks = thread_cpu_ticks([100, *descendants(100, proc)], proc)
    assert ticks[(200, 205)] == (10, "sglang (server/loop")
    assert ticks[(201, 201)] == (42, "sglang::scheduler/sglang::schedul")  # comm is cut at 15 characters
    assert ticks[(200, 200)][1] == "sglang (server"  # a process's main thread: its name once
    # a Python process is named by the module it runs; the controller without a cmdline keeps its comm
    assert ticks[(400, 400)] == (70, "vllm.entrypoints.openai.api_server")
    assert ticks[(400, 401)][1] == "vllm.entrypoints.openai.api_server/asyncio_0"
    assert ticks[(100, 100)][1] == "python"
    assert (300, 300) not in ticks
    assert thread_cpu_ticks([999], proc) == {}  # a process gone meanwhile is left out


def test_thread_load_finds_the_busiest_thread() -> None:
    before = {(1, 1): (100, "python/python"), (2, 2): (50, "vllm/EngineCore")}
    after = {(1, 1): (120, "python/python"), (2, 2): (140, "vllm/EngineCore"), (2, 3): (30, "vllm/new")}
    load = thread_load(before, after, seconds=1.0, tick_s=0.01)
    assert load["busiest_thread"] == "vllm/EngineCore"
    assert load["busiest_thread_cpu_pct"] == pytest.approx(90.0)
    assert load["run_cpu_pct"] == pytest.approx(140.0)  # 20 + 90 + 30 (a new thread counts from zero)
    assert thread_load(before, {}, 1.0)["busiest_thread"] is None  # /proc could not be read
    assert thread_load(before, after, 0.0)["run_cpu_pct"] is None


def test_thread_load_reads_nothing_from_a_window_of_a_few_ticks() -> None:
    """Over 2 ms (overlap's wait for a rollout that ran ahead) one 10 ms tick of a thread read as 500% of a core
    (the 2026-11-26 placement lease's machine table): a window under MIN_CPU_WINDOW_TICKS ticks gives no reading."""
    from hybridrl.run.telemetry import MIN_CPU_WINDOW_TICKS

    before = {(1, 1): (100, "python/hybridrl")}
    after = {(1, 1): (101, "python/hybridrl")}
    assert thread_load(before, after, seconds=0.002, tick_s=0.01)["busiest_thread_cpu_pct"] is None
    short = (MIN_CPU_WINDOW_TICKS - 1) * 0.01
    assert thread_load(before, after, seconds=short, tick_s=0.01)["run_cpu_pct"] is None
    load = thread_load(before, after, seconds=MIN_CPU_WINDOW_TICKS * 0.01, tick_s=0.01)
    assert load["busiest_thread_cpu_pct"] == pytest.approx(100.0 / MIN_CPU_WINDOW_TICKS)


def test_timings_record_the_busiest_thread_of_rollout_outside_its_time() -> None:
    reads = iter([{(1, 1): (0, "p/a")}, {(1, 1): (50, "p/a")}])

    def slow_reader() -> dict:
        time.sleep(1.0)  # a /proc walk that takes long must not lengthen the phase it watches
        return next(reads)

    t = Timings(cpu_reader=lambda: None, own_cpu=lambda: 0.0, threads=slow_reader)
    with t.phase("gen"):
        time.sleep(0.25)  # long enough for a CPU reading (MIN_CPU_WINDOW_TICKS)
    with t.phase("reward"):  # not watched: the reader is not called again (next() would raise)
        pass
    rec = t.record()
    assert 0.25 <= rec["timing_s/gen"] < 1.0  # the two 1 s readings are outside it
    assert rec["host/busiest_thread_gen"] == "p/a"
    assert 0 < rec["host/busiest_thread_cpu_pct_gen"] == rec["host/run_cpu_pct_gen"]
    assert {"host/busiest_thread_gen", "host/run_cpu_pct_gen"} <= set(RECORD_KEYS)
    assert "host/busiest_thread_gen" in STRINGS


def _spin(cpu_seconds: float) -> None:
    """Use cpu_seconds of CPU time, however long a loaded host takes to give them."""
    while time.process_time() < cpu_seconds:
        pass


def test_a_busy_child_process_is_the_busiest_thread_on_this_machine() -> None:
    """The real /proc: a child spinning on one core shows as the run's busiest thread, with the CPU time it used."""
    before = run_thread_ticks()
    t0 = time.perf_counter()
    child = multiprocessing.get_context("fork").Process(target=_spin, args=(1.0,), name="spinner")
    child.start()
    after_mid = {}
    while child.is_alive():
        after_mid = run_thread_ticks() or after_mid  # read while the child is still there
        time.sleep(0.1)
    child.join()
    wall = time.perf_counter() - t0
    load = thread_load(before, after_mid, wall)
    assert any(pid == child.pid for pid, _ in after_mid)
    # the last reading comes up to a poll before the child's 1 s of CPU is used up; this process mostly sleeps
    assert load["busiest_thread_cpu_pct"] * wall / 100 >= 0.5, (load, wall)


def _fake_pynvml(clock: dict[int, int], reasons: dict[int, int]) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.NVML_CLOCK_SM, m.NVML_TEMPERATURE_GPU = 1, 0
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(clock)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetClockInfo = lambda h, kind: clock[h] if kind == 1 else 0
    m.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980 if kind == 1 else 0
    m.nvmlDeviceGetPowerUsage = lambda h: 450_000 + 100_000 * h  # milliwatts
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    m.nvmlDeviceGetTemperature = lambda h, sensor: 60 + h if sensor == 0 else 0
    m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: reasons[h]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=10**9, total=141 * 10**9)
    m.nvmlDeviceGetName = lambda h: "H200"
    m.nvmlSystemGetDriverVersion = lambda: "570.1"
    m.nvmlSystemGetCudaDriverVersion = lambda: 12080
    return m


def test_nvml_reads_clock_power_temperature_and_slowdown(monkeypatch: pytest.MonkeyPatch) -> None:
    # GPU 0 idle and at its application clocks (not slowdowns), GPU 1 held by the software power cap
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml({0: 1980, 1: 1500}, {0: 0x1 | 0x2, 1: 0x4}))
    with nvml.devices() as session:
        got = session.conditions()
    assert got[0] == nvml.Conditions(1980.0, 450.0, 60.0, False)
    assert got[1] == nvml.Conditions(1500.0, 550.0, 61.0, True)
    state = limiting(got.values())
    assert (state.sm_mhz, state.power_w, state.temp_c, state.slowed) == (1500.0, 550.0, 61.0, True)
    device = nvml.gpu_info()["devices"][1]
    assert device["max_sm_clock_mhz"] == 1980.0 and device["power_limit_w"] == 700.0


def test_a_gpu_that_cannot_tell_its_clock_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml({0: 1980, 1: 1500}, {0: 0, 1: 0})

    def no_reasons(h: int) -> int:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    fake.nvmlDeviceGetCurrentClocksEventReasons = no_reasons
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with nvml.devices() as session:
        assert session.conditions() == {}
    assert limiting([]) is None


class _Devices:
    """Two GPUs whose state the test sets between sampler reads."""

    handles = [(0, 0), (1, 1)]

    def __init__(self) -> None:
        self.state = {0: nvml.Conditions(1980.0, 500.0, 55.0, False), 1: nvml.Conditions(1980.0, 520.0, 57.0, False)}

    def used_gb(self) -> dict[int, float]:
        return {0: 10.0, 1: 12.0}

    def conditions(self) -> dict[int, nvml.Conditions]:
        return dict(self.state)

    def compute_pids(self) -> set[int]:
        return set()

    def close(self) -> None:
        pass


def test_the_sampler_summarises_the_gpus_per_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = _Devices()
    monkeypatch.setattr(telemetry.nvml, "open_devices", lambda indices=None: devices)
    sampler = MemorySampler([0, 1], hz=1000.0, conditions_every=1).start()

    def reads(name: str, more: int) -> None:
        until, deadline = len(sampler.conditions[name]) + more, time.monotonic() + 30
        while len(sampler.conditions[name]) < until and time.monotonic() < deadline:
            time.sleep(0.005)

    sampler.set_phase("gen")
    reads("gen", 5)
    sampler.set_phase("update_actor")
    reads("update_actor", 1)
    devices.state[1] = nvml.Conditions(1200.0, 700.0, 80.0, True)  # then GPU 1 hits its power cap
    reads("update_actor", 30)
    rec = sampler.take()
    assert rec["gpu/sm_clock_mhz_gen"] == 1980.0 and rec["gpu/slowdown_frac_gen"] == 0.0
    assert rec["gpu/temp_c_gen"] == 57.0 and rec["gpu/power_w_gen"] == pytest.approx(520.0)
    assert rec["gpu/sm_clock_mhz_update_actor"] == 1200.0 and rec["gpu/temp_c_update_actor"] == 80.0
    assert rec["gpu/slowdown_frac_update_actor"] > 0.5  # a read or two may fall before the change
    assert set(GPU) <= set(rec) and set(GPU) <= set(RECORD_KEYS)
    assert sampler.take()["gpu/sm_clock_mhz_gen"] is None  # each step afresh: no gen reads since
    sampler.close()


def test_the_report_shows_the_machine_under_each_run_and_flags_slowdowns(tmp_path: Path) -> None:
    from test_report import headline_run, headline_study

    from hybridrl.report.render import render

    cool = {"gpu/sm_clock_mhz_gen": 1980.0, "gpu/power_w_gen": 450.0, "gpu/temp_c_gen": 55.0,
            "gpu/slowdown_frac_gen": 0.0, "host/busiest_thread_cpu_pct_gen": 40.0,
            "host/run_cpu_pct_gen": 120.0, "host/busiest_thread_gen": "sglang::scheduler/sglang::schedul"}
    capped = {**cool, "gpu/sm_clock_mhz_gen": 1410.0, "gpu/slowdown_frac_gen": 0.5,
              "host/busiest_thread_cpu_pct_gen": 99.0, "host/busiest_thread_gen": "VLLM::EngineCore/VLLM::EngineCor"}
    a = headline_run("sglang-colocate-aaaa1111", "sglang").assign(**cool)
    b = headline_run("vllm-colocate-bbbb2222", "vllm").assign(**capped)
    md = tmp_path / "report.md"
    render(headline_study(a, b), md, tmp_path / "report.html", {}, "study", tmp_path / "runs")
    section = md.read_text().split("## The machine under each run")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith(("| sglang", "| vllm"))]
    assert len(rows) == 2
    assert "1,980" in rows[0] and "0%" in rows[0] and "sglang::scheduler" in rows[0]
    assert "1,410" in rows[1] and "50%" in rows[1] and "VLLM::EngineCore" in rows[1]
    html = (tmp_path / "report.html").read_text()
    assert '<td class="fail">50%</td>' in html and '<td class="num">99.00</td>' in html  # a slowdown is flagged
    assert '<td class="num">0%</td>' in html

    render(headline_study(headline_run("sglang-colocate-aaaa1111", "sglang")), md, tmp_path / "report.html", {},
           "study", tmp_path / "runs")
    assert "The machine under each run" not in md.read_text()  # records from before these keys: no section


def test_the_machine_table_shows_the_collector_pauses_only_where_the_study_recorded_them() -> None:
    from test_report import headline_run, headline_study

    from hybridrl.report import stats
    from hybridrl.report.plots import run_labels
    from hybridrl.report.run_tables import machine_table

    machine_keys = {"gpu/sm_clock_mhz_gen": 1980.0}
    a = headline_run("sglang-colocate-aaaa1111", "sglang").assign(**machine_keys)
    older = headline_study(a)
    assert "full collections" not in machine_table(older, run_labels(older)).headers  # records from before the keys
    steps = len(a)
    a = a.assign(**{"host/gc_pause_s_gen": [0.01] * (steps - 1) + [0.4], "host/gc_full_collections": [1] * steps})
    study = headline_study(a)
    table = machine_table(study, run_labels(study))
    header = table.headers
    row = [cell.text for cell in table.rows[0]]
    assert "collector pause in rollout (s, longest step)" in header and "full collections" in header
    assert row[header.index("collector pause in rollout (s, longest step)")] == "0.400"  # the longest steady step
    steady = len(stats.steady_state(study))  # warm-up steps are left out
    assert 0 < steady < steps and row[header.index("full collections")] == str(steady)


def test_the_machine_plot_is_drawn_only_where_a_run_recorded_its_machine(tmp_path: Path) -> None:
    from test_report import headline_run, headline_study

    from hybridrl.report.plots import plot_machine

    a = headline_run("sglang-colocate-aaaa1111", "sglang").assign(**{"gpu/power_w_gen": 240.0})
    assert plot_machine(headline_study(a), tmp_path / "machine.png") == tmp_path / "machine.png"
    assert (tmp_path / "machine.png").stat().st_size > 0
    assert plot_machine(headline_study(headline_run("sglang-colocate-aaaa1111", "sglang")), tmp_path / "b.png") is None
    assert not (tmp_path / "b.png").exists()
