"""The verdict's wording per metric, the pairing of in-process vLLM, and when each run was recorded (issue 16)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from test_report import client_run, headline_run, headline_study

from hybridrl.report import conditions
from hybridrl.report.headline import headlines, sentence
from hybridrl.report.stats import Estimate
from hybridrl.report.wording import RATIO, ratio_text

T0 = 1_795_470_000.0  # 2026-11-23 UTC


def timed(run: pd.DataFrame, start: float, step_s: float = 10.0) -> pd.DataFrame:
    """The run's steps back to back from `start`, each step_s long (time_unix is a step's end)."""
    return run.assign(**{"timing_s/step": step_s, "time_unix": start + step_s * run["step"]})


def test_windows_run_from_the_engine_start_to_the_last_step_and_find_runs_that_shared_the_host() -> None:
    a = timed(headline_run("sglang-colocate-aaaa1111", "sglang"), T0)  # steps end at T0 + 10 ... T0 + 100
    b = timed(headline_run("vllm-colocate-bbbb2222", "vllm"), T0 + 200)
    wins = conditions.windows(headline_study(a, b))
    assert [w.run_id for w in wins] == ["sglang-colocate-aaaa1111", "vllm-colocate-bbbb2222"]
    # step 1 began at T0 + 0 after the engine's 60 s start; the last step ended at T0 + 100
    assert (wins[0].start, wins[0].stop) == (T0 - 60, T0 + 100)
    assert conditions.beside(wins) == {"sglang-colocate-aaaa1111": [], "vllm-colocate-bbbb2222": []}
    # b's engine starting during a's last steps is a start-up beside a's measured steps
    late = conditions.windows(headline_study(a, timed(headline_run("vllm-colocate-bbbb2222", "vllm"), T0 + 140)))
    assert conditions.beside(late) == {"sglang-colocate-aaaa1111": ["vllm-colocate-bbbb2222"],
                                       "vllm-colocate-bbbb2222": ["sglang-colocate-aaaa1111"]}
    assert conditions.windows(headline_study(a).drop(columns=["time_unix"])) == []


def _arms(order: str) -> pd.DataFrame:
    """Runs of configurations s (SGLang) and v (vLLM) recorded one after another in the given order."""
    runs, seen = [], {"s": 0, "v": 0}
    for i, arm in enumerate(order):
        seen[arm] += 1
        base = "sglang-colocate-aaaa1111" if arm == "s" else "vllm-colocate-bbbb2222"
        run_id = base if seen[arm] == 1 else f"{base}-r{seen[arm]}"
        runs.append(timed(headline_run(run_id, "sglang" if arm == "s" else "vllm", trainer="hf"), T0 + 600 * i))
    return headline_study(*runs)


def test_a_pair_recorded_arm_after_arm_gets_a_caveat_and_an_interleaved_one_none() -> None:
    wins = conditions.windows(_arms("svsvsv"))
    assert conditions.order_caveat(wins, "sglang-colocate-aaaa1111", "vllm-colocate-bbbb2222", "SGLang", "vLLM") is None
    wins = conditions.windows(_arms("sssvvv"))
    note = conditions.order_caveat(wins, "sglang-colocate-aaaa1111", "vllm-colocate-bbbb2222", "SGLang", "vLLM")
    assert note is not None and note.startswith("not interleaved: every vLLM run was recorded after every SGLang run")
    assert "7 min between them" in note  # the last SGLang run ended at T0 + 1300, the first vLLM began at T0 + 1740
    # one run a side cannot interleave: the time apart is the caveat that applies there
    wins = conditions.windows(_arms("sv"))
    assert conditions.order_caveat(wins, "sglang-colocate-aaaa1111", "vllm-colocate-bbbb2222", "SGLang", "vLLM") is None
    [h] = headlines(_arms("sssvvv"))
    assert any(c.startswith("not interleaved") for c in h.caveats)
    [h] = headlines(_arms("svvssv"))
    assert not any(c.startswith("not interleaved") for c in h.caveats)


def test_the_verdict_says_which_side_is_ahead_the_way_round_each_ratio_is_written() -> None:
    df = headline_study(headline_run("sglang-colocate-aaaa1111", "sglang", speed=2.0),
                        headline_run("sglang-colocate-aaaa1111-r2", "sglang", speed=2.0, seed=5),
                        headline_run("vllm-colocate-bbbb2222", "vllm"),
                        headline_run("vllm-colocate-bbbb2222-r2", "vllm", seed=6))
    [h] = headlines(df)
    said = {r.metric.name: sentence(r, "vLLM server") for r in h.rows}
    assert said["Rollout throughput"].startswith("Rollout throughput: SGLang is faster than vLLM server, "
                                                 "SGLang / vLLM server ")
    assert said["ITL, mean"].startswith("ITL, mean: vLLM server is slower than SGLang, vLLM server / SGLang ")
    assert said["p99 latency"].startswith("p99 latency: SGLang is faster than vLLM server, SGLang / vLLM server ")
    # each ratio the way round its words say: SGLang twice as fast, so half the latency
    quoted = {k: float(RATIO.search(v).group(1)) for k, v in said.items()}
    assert quoted["Rollout throughput"] == pytest.approx(2, rel=0.05)
    assert quoted["ITL, mean"] == pytest.approx(2, rel=0.05) and quoted["p99 latency"] == pytest.approx(0.5, rel=0.05)
    assert said["Peak GPU memory"].startswith("Peak GPU memory: SGLang is lower than vLLM server")
    assert "(2 runs, 16 steps vs 2 runs, 16 steps)" in said["Rollout throughput"]
    # the same engine speed on both sides: nothing is ranked
    df = headline_study(headline_run("sglang-colocate-aaaa1111", "sglang"), headline_run("sglang-colocate-aaaa1111-r2",
                        "sglang", seed=5), headline_run("vllm-colocate-bbbb2222", "vllm", seed=7),
                        headline_run("vllm-colocate-bbbb2222-r2", "vllm", seed=8))
    [h] = headlines(df)
    tput = next(r for r in h.rows if r.metric.name == "Rollout throughput")
    assert tput.est.contains(1.0)
    assert "could not be told apart" in sentence(tput, "vLLM server")


def test_an_interval_that_excludes_one_never_prints_as_one_to_one() -> None:
    assert ratio_text(Estimate(0.83, 0.74, 0.89, 24)) == "0.83x [0.74, 0.89]"
    assert ratio_text(Estimate(0.9968, 0.9961, 0.9975, 24)) == "0.997x [0.996, 0.998]"
    assert ratio_text(Estimate(1.0534, 1.0008, 1.3084, 5)) == "1.053x [1.001, 1.308]"  # not [1.00, 1.31]
    assert ratio_text(Estimate(1.05, 0.998, 1.31, 5)) == "1.05x [1.00, 1.31]"  # includes 1: nothing hidden


def test_in_process_vllm_pairs_with_the_http_engine_that_streams_the_same_share() -> None:
    df = headline_study(client_run("sglang-new-aaaa1111", "sglang", 0.125, False),
                        client_run("sglang-old-bbbb2222", "sglang", 1.0, True),
                        client_run("vllm-inprocess-new-cccc3333", "vllm-inprocess", 0.125, False),
                        client_run("vllm-inprocess-old-dddd4444", "vllm-inprocess", 1.0, False))
    pairs = {(h.sglang_run, h.vllm_run) for h in headlines(df)}
    assert pairs == {("sglang-new-aaaa1111", "vllm-inprocess-new-cccc3333"),
                     ("sglang-old-bbbb2222", "vllm-inprocess-old-dddd4444")}


@pytest.mark.parametrize("gap_s, shared", [(600.0, False), (50.0, True)])
def test_report_lists_the_runs_in_recording_order_and_flags_runs_that_shared_the_host(
        tmp_path: Path, gap_s: float, shared: bool) -> None:
    from hybridrl.report.render import render

    df = headline_study(timed(headline_run("sglang-colocate-aaaa1111", "sglang"), T0),
                        timed(headline_run("vllm-colocate-bbbb2222", "vllm"), T0 + gap_s))
    md = tmp_path / "report.md"
    render(df, md, tmp_path / "report.html", {}, "study", tmp_path / "runs")
    text = md.read_text()
    section = text.split("## When each run was recorded")[1].split("\n## ")[0]
    assert ("2 of 2 runs shared the host" in section) is shared
    assert ("No run shared the host" in section) is not shared
    rows = [line for line in section.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 2 and "2026-11-23" in rows[0]
    assert rows[0].rstrip(" |").endswith("none") is not shared
    assert "## Verdict" in text and "Rollout throughput: SGLang" in text.split("## Verdict")[1]


def test_runs_name_their_machine_by_boot_id_and_a_pair_from_two_machines_says_so(tmp_path: Path) -> None:
    from hybridrl.report.aggregate import provenance_fields
    from hybridrl.run.provenance import host_info

    boot = host_info()["boot_id"]
    assert boot is None or len(boot) >= 8  # Linux always has one; elsewhere it is simply not recorded
    prov = {"host": {"boot_id": "1a2b3c4d-0000-4000-8000-000000000000"}, "git": {"commit": "464302c"}}
    assert provenance_fields(prov)["machine"] == "1a2b3c4d"
    assert provenance_fields({"git": {}})["machine"] is None  # recorded before boot ids
    one = headline_run("sglang-colocate-aaaa1111", "sglang").assign(machine="1a2b3c4d")
    same = headline_run("vllm-colocate-bbbb2222", "vllm").assign(machine="1a2b3c4d")
    [h] = headlines(headline_study(one, same))
    assert not any("machines" in c for c in h.caveats)
    [h] = headlines(headline_study(one, same.assign(machine="99990000")))
    assert "recorded by different machines (boot ids): 1a2b3c4d (SGLang) vs 99990000" in h.caveats


def test_a_pair_reads_every_replicate_for_its_machines_code_and_hours_apart() -> None:
    """A replicate recorded elsewhere, or hours later, is a caveat even where each side's first run agrees."""
    one = timed(headline_run("sglang-colocate-aaaa1111", "sglang", trainer="hf"), T0).assign(machine="1a2b3c4d")
    two = timed(headline_run("sglang-colocate-aaaa1111-r2", "sglang", trainer="hf"), T0 + 600)
    vllm = timed(headline_run("vllm-colocate-bbbb2222", "vllm", trainer="hf"), T0 + 300).assign(machine="1a2b3c4d")
    [h] = headlines(headline_study(one, two.assign(machine="1a2b3c4d"), vllm))
    assert not any(c.startswith("recorded") for c in h.caveats)  # one machine, one sitting
    [h] = headlines(headline_study(one, two.assign(machine="99990000"), vllm))
    assert "recorded by different machines (boot ids): 1a2b3c4d, 99990000 (SGLang) vs 1a2b3c4d" in h.caveats
    [h] = headlines(headline_study(one, two.assign(machine="99990000"), vllm.assign(machine=None)))
    assert "recorded by different machines (boot ids): 1a2b3c4d, 99990000 (SGLang) vs not recorded" in h.caveats
    later = timed(headline_run("sglang-colocate-aaaa1111-r2", "sglang", trainer="hf"), T0 + 20 * 3600)
    [h] = headlines(headline_study(one, later.assign(machine="1a2b3c4d"), vllm))
    apart = [c for c in h.caveats if " h apart " in c]
    assert apart == [f"recorded 20 h apart ({conditions.span(T0 + 10, T0 + 20 * 3600 + 10)} SGLang, "
                     f"{conditions.utc(T0 + 310)} UTC vLLM), perhaps on different machines of the same kind"]


def test_a_colocated_megatron_trainer_holds_train_tp_x_train_ep_gpus_where_that_is_more_than_the_engine_s() -> None:
    import pandas as pd

    from hybridrl.report.aggregate import run_gpus

    row = {"device": "cuda", "placement": "colocate", "tp": 1, "trainer": "megatron", "train_tp": 1}
    assert run_gpus(pd.Series(row)) == 1.0  # recorded before train_ep existed: one rank
    assert run_gpus(pd.Series({**row, "train_ep": 2})) == 2.0
    assert run_gpus(pd.Series({**row, "tp": 2, "train_ep": 2})) == 2.0  # the engine's two GPUs, shared
    assert run_gpus(pd.Series({**row, "trainer": "hf", "train_ep": 2})) == 1.0


def test_a_split_run_that_saw_one_gpu_counts_one_and_its_pair_says_the_gpus_were_shared() -> None:
    own = [headline_run(f"{e}-split-{i}", e, placement="split").assign(tp=1, train_gpus=1, gpu_count=2)
           for e, i in (("sglang", "aaaa1111"), ("vllm", "bbbb2222"))]
    df = headline_study(*own)
    assert set(df["cost/gpus"]) == {2.0}
    [h] = headlines(df)
    assert not any("fewer GPUs" in c for c in h.caveats)
    df = headline_study(own[0].assign(gpu_count=1), own[1])
    assert set(df.loc[df["engine"] == "sglang", "cost/gpus"]) == {1.0}  # one GPU held, not two
    [h] = headlines(df)
    assert any(c.startswith("split on fewer GPUs than it asks for (SGLang)") for c in h.caveats)


def test_a_pair_whose_engine_was_restarted_mid_run_says_where() -> None:
    plain = headline_run("sglang-colocate-aaaa1111", "sglang"), headline_run("vllm-colocate-bbbb2222", "vllm")
    [h] = headlines(headline_study(*plain))
    assert not any("started again" in c for c in h.caveats)
    hit = plain[1].assign(**{"errors/engine_restarts": [0, 0, 1] + [0] * 7})
    [h] = headlines(headline_study(plain[0], hit))
    assert "vLLM server's engine was started again mid-run 1 time(s) (step 3; errors/engine_restarts): those steps " \
           "include the restart" in h.caveats


def test_readme_verdict_and_bench_figures_come_from_the_committed_data() -> None:
    from hybridrl.report.figures import evaluate

    study = "results/reference/2026-11-23-h200-verdict"
    said = evaluate(f"verdict {study} sglang-full vllm-server perf/throughput")
    assert said.startswith("Rollout throughput: sglang-full is ") and "(3 runs, 24 steps vs 3 runs, 24 steps)" in said
    step = evaluate(f"verdict {study} sglang-full vllm-server timing_s/step time")
    assert step.startswith("Step time, checks included: sglang-full is ") or "could not be told apart" in step
    compared = evaluate(f"verdict {study} sglang-full vllm-server timing_s/step_compared time")
    assert compared.startswith("Step time, checks excluded: sglang-full ") and compared != step
    with pytest.raises(ValueError, match="unknown verdict mode"):
        evaluate(f"verdict {study} sglang-full vllm-server timing_s/step quick")
    bench = evaluate(f"bench_ratio {study}/bench/sglang-full.json {study}/bench/vllm-server.json raw")
    assert RATIO.fullmatch(bench)
    with pytest.raises(ValueError, match="no repeats of path 'stream_all'"):
        evaluate(f"bench_ratio {study}/bench/sglang-full.json {study}/bench/vllm-server.json stream_all")


def test_the_wording_check_reads_each_list_item_as_its_own_sentence() -> None:
    from hybridrl.report.wording import violations

    items = ("Medians over runs:\n\n- Rollout throughput: A is faster than B, A / B 1.11x [1.04, 1.22] (3 runs)\n"
             "- TTFT p50: A and B could not be told apart, A / B 1.06x [0.80, 1.23] (3 runs)\n")
    assert violations(items) == []
    assert len(violations(items + "- Step time: A and B are equally fast, 1.12x [1.06, 1.17]\n")) == 1
    assert len(violations("- Step time: A is faster than B, 1.02x [0.96, 1.07]\n")) == 1


def _proc(tmp_path: Path, parents: dict[int, int]) -> Path:
    """A fake /proc: <pid>/stat with the parent in its fourth field, and a command name with a space."""
    for pid, ppid in parents.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python3 -m x) S {ppid} 1 1 0\n")
    return tmp_path


def test_gpu_processes_outside_the_runs_process_tree_are_foreign(tmp_path: Path) -> None:
    from hybridrl.run.telemetry import foreign_pids, parent_pid

    # 100 the controller; 200 its engine server, 201 the engine's scheduler; 300 another job under init
    proc = _proc(tmp_path, {100: 50, 200: 100, 201: 200, 300: 1, 50: 1})
    assert parent_pid(201, proc) == 200 and parent_pid(999, proc) is None
    assert foreign_pids({100, 200, 201}, root=100, proc=proc) == set()
    assert foreign_pids({100, 201, 300}, root=100, proc=proc) == {300}
    assert foreign_pids({999}, root=100, proc=proc) == set()  # not visible here: cannot be told apart


def test_the_memory_sampler_counts_foreign_gpu_processes_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridrl.run import telemetry

    class FakeDevices:
        handles = [(0, object())]
        pids = {4242}

        def used_gb(self) -> dict[int, float]:
            return {0: 1.0}

        def compute_pids(self) -> set[int]:
            return self.pids

        def conditions(self) -> dict:
            return {}

        def close(self) -> None:
            pass

    monkeypatch.setattr(telemetry.nvml, "open_devices", lambda indices=None: FakeDevices())
    monkeypatch.setattr(telemetry, "foreign_pids", lambda pids, root: set(pids))
    sampler = telemetry.MemorySampler([0])
    sampler.set_phase("gen")
    assert sampler.take()["host/foreign_gpu_procs"] == 1.0
    FakeDevices.pids = set()
    sampler.set_phase("gen")
    assert sampler.take()["host/foreign_gpu_procs"] == 0.0  # counted afresh each step
    sampler.close()


def test_report_flags_runs_that_saw_another_jobs_process_on_their_gpus(tmp_path: Path) -> None:
    from hybridrl.report.render import render

    a = timed(headline_run("sglang-colocate-aaaa1111", "sglang"), T0)
    b = timed(headline_run("vllm-colocate-bbbb2222", "vllm"), T0 + 600)
    for foreign, says in ((0.0, "No run saw another job's process"), (1.0, "1 run(s) saw another job's process")):
        df = headline_study(a.assign(**{"host/foreign_gpu_procs": 0.0}),
                            b.assign(**{"host/foreign_gpu_procs": [foreign] * 3 + [0.0] * 7}))
        md = tmp_path / "report.md"
        render(df, md, tmp_path / "report.html", {}, "study", tmp_path / "runs")
        section = md.read_text().split("## When each run was recorded")[1].split("\n## ")[0]
        assert says in section
        assert ("another job's GPU process in 3 step(s)" in section) is bool(foreign)


def test_each_configuration_says_how_it_was_recorded_against_the_baseline() -> None:
    from hybridrl.report.comparisons import ratio_table
    from hybridrl.report.plots import config_labels

    wins = conditions.windows(_arms("sssvvv"))
    assert conditions.relation(wins, "vllm-colocate-bbbb2222", "sglang-colocate-aaaa1111").startswith("after it")
    assert conditions.relation(wins, "sglang-colocate-aaaa1111", "vllm-colocate-bbbb2222").startswith("before it")
    assert conditions.relation(conditions.windows(_arms("svsvsv")), "vllm-colocate-bbbb2222",
                               "sglang-colocate-aaaa1111") == "interleaved"
    df = _arms("svvssv")
    _, table = ratio_table(df, config_labels(df))
    assert table.headers[-1] == "recorded, against the baseline" and table.rows[0][-1].text == "interleaved"


def test_the_recording_table_names_each_runs_executor_job_node_and_gpus_where_recorded(tmp_path: Path) -> None:
    from hybridrl.report.render import render

    uuid = "GPU-8932f937-0000-4000-8000-000000000000"
    slurm = timed(headline_run("sglang-colocate-aaaa1111", "sglang"), T0).assign(
        executor="slurm", slurm_job_id="21_2", node="gpu-node-7", gpu_uuids=uuid)
    older = timed(headline_run("vllm-colocate-bbbb2222", "vllm"), T0 + 600)  # recorded before the scheduler block
    gpuless = timed(headline_run("vllm-colocate-bbbb2222-r2", "vllm"), T0 + 1200).assign(executor="local",
                                                                                         node="laptop")

    def section(*runs: pd.DataFrame) -> str:
        md = tmp_path / "report.md"
        render(headline_study(*runs), md, tmp_path / "report.html", {}, "study", tmp_path / "runs")
        return md.read_text().split("## When each run was recorded")[1].split("\n## ")[0]

    text = section(slurm, older, gpuless)
    header = next(line for line in text.splitlines() if line.startswith("| #"))
    assert "| executor | SLURM job | node | GPUs (UUID) | beside it |" in header
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[8:12]]
            for line in text.splitlines() if line.startswith(("| 1 ", "| 2 ", "| 3 "))}
    assert sorted(rows.values()) == [["local", "–", "laptop", "none"], ["slurm", "21_2", "gpu-node-7", "GPU-8932f937"],
                                     ["–", "–", "–", "–"]]
    assert "SLURM job" in text.split("\n|")[0]  # the note says what the columns are
    # a study recorded before any run named its scheduler keeps the table it was rendered with
    assert "executor" not in section(older)


@pytest.mark.parametrize("second_on", ["same machine", "fresh machine"])
def test_a_start_that_followed_its_engines_start_on_the_same_machine_is_named(second_on: str) -> None:
    sglang = timed(headline_run("sglang-colocate-aaaa1111", "sglang"), T0).assign(machine="m1")
    vllm = timed(headline_run("vllm-colocate-bbbb2222", "vllm"), T0 + 1000).assign(machine="m1")
    again = timed(headline_run("vllm-colocate-bbbb2222-r2", "vllm", seed=1), T0 + 2000).assign(
        machine="m1" if second_on == "same machine" else "m2")
    [alone] = headlines(headline_study(sglang, vllm))
    assert not any(c.startswith("engine start:") for c in alone.caveats)  # each the first of its engine there
    df = headline_study(sglang, vllm, again)
    [h] = headlines(df)
    said = [c for c in h.caveats if c.startswith("engine start:")]
    if second_on == "same machine":
        assert conditions.later_starts(df, "vllm-colocate-bbbb2222") == (1, 2)
        assert len(said) == 1 and "(0 of SGLang's 1; 1 of vLLM server's 2)" in said[0]
    else:
        assert conditions.later_starts(df, "vllm-colocate-bbbb2222") == (0, 2) and said == []
