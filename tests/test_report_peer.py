"""hybridrl beside TRL in the report: TRL's records read (and refused when they are not records), the phase table,
hybridrl's step over TRL's judged against the peer targets, and the plot drawn only where records are."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from hybridrl.report import peer, targets

DEFAULTS = targets.Target(name="1.5x TRL's defaults", metric=targets.PEER_RATIO, against="trl-defaults",
                          at_most=0.667)
BEST = targets.Target(name="faster than TRL's best", metric=targets.PEER_RATIO, against="trl-best", at_most=1.0)


def _ours(step: float, runs: int = 2) -> pd.DataFrame:
    rows = []
    for r in range(runs):
        for i in range(1, 9):
            s = step + 0.02 * ((i + r) % 3)
            rows.append({"run_id": f"ours-r{r}", "config_id": "ours", "step": i, "time_unix": 100 * r + i,
                         "warmup_steps": 2, "timing_s/step_compared": s, "timing_s/gen": s / 2,
                         "timing_s/update_actor": s / 4, "timing_s/update_weights": 0.1})
    return pd.DataFrame(rows)


def _job(card: str | None) -> str:
    """A SLURM job record as `cluster record-job` writes it, on one GPU (or, without a card, naming none)."""
    return json.dumps({"jobs": [{"gpus": [{"index": 0, "uuid": card}] if card else []}]})


def _trl(bench: Path, name: str, step: float, gc: bool | None = None, sleep: bool = True,
         card: str | None = None) -> None:
    settings = ({} if gc is None else {"gradient_checkpointing": gc}) | {"vllm_enable_sleep_mode": sleep}
    steps = [{"step": i, "step_s": step + 0.03 * (i % 3), "generate_s": step / 2, "train_s": step / 3,
              "sync_weights_s": 0.2} for i in range(1, 11)]
    bench.mkdir(exist_ok=True)
    (bench / f"trl-x-{name}.json").write_text(json.dumps({"tool": "peer-trl", "settings": settings, "steps": steps}))
    (bench / f"trl-x-{name}.slurm.json").write_text(_job(card))  # the job record is no result


def test_records_skip_job_records_and_refuse_what_is_not_one(tmp_path: Path) -> None:
    _trl(tmp_path, "defaults", 6.0)
    _trl(tmp_path, "gc-off", 4.0, gc=False)
    _trl(tmp_path, "gc-off-awake", 3.5, gc=False, sleep=False)
    _trl(tmp_path, "gc-on-awake", 5.5, sleep=False)  # checkpointing TRL's default, vLLM not: not its defaults
    got = peer.records(tmp_path)
    assert [(r.label, r.defaults, len(r.steps)) for r in got] == [
        ("TRL GRPOTrainer · its defaults (gradient checkpointing on)", True, 8),
        ("TRL GRPOTrainer · gradient checkpointing off, vLLM awake", False, 8),  # file names' order
        ("TRL GRPOTrainer · gradient checkpointing off", False, 8),
        ("TRL GRPOTrainer · gradient checkpointing on (its default), vLLM awake", False, 8)]
    assert got[0].rest() == [pytest.approx([s["step_s"] - 3.0 - 2.0 - 0.2 for s in got[0].steps])]
    assert peer.records(tmp_path / "none") == []
    (tmp_path / "trl-x-bad.json").write_text(json.dumps({"tool": "trainer-bench"}))
    with pytest.raises(ValueError, match=r"trl-x-bad.json: not a record of `hybridrl peer-trl`"):
        peer.records(tmp_path)
    (tmp_path / "trl-x-bad.json").write_text(json.dumps({"tool": "peer-trl", "steps": [{"step": 1, "step_s": 1}]}))
    with pytest.raises(ValueError, match="trl-x-bad.json: no step after warm-up"):
        peer.records(tmp_path)


def test_a_configurations_processes_pool_into_one_record_with_an_interval_over_them(tmp_path: Path) -> None:
    """Replicates of one TRL configuration (trl-...-rK.json) are one row over processes and steps, not rows of
    their own; the interval then holds the processes' spread, and the words count them."""
    _trl(tmp_path, "defaults", 6.0)
    _trl(tmp_path, "defaults-r2", 7.0)
    _trl(tmp_path, "gc-off", 4.0, gc=False)
    got = peer.records(tmp_path)
    assert [(r.label, r.n) for r in got] == [("TRL GRPOTrainer · its defaults (gradient checkpointing on)", (2, 16)),
                                             ("TRL GRPOTrainer · gradient checkpointing off", (1, 8))]
    table = peer.phase_table(_ours(4.0), got, {"ours": "hybridrl"})
    assert [r[-1].text for r in table.rows] == ["2 runs × 12 steps", "2 runs × 16 steps", "1 run × 8 steps"]
    pooled = next(p for p in peer.pairs(_ours(4.0), got, {"ours": "hybridrl"}) if p.peer.defaults)
    alone = peer.pairs(_ours(4.0), peer.records(_only(tmp_path, "defaults")), {"ours": "hybridrl"})[0]
    assert pooled.est.hi - pooled.est.lo > 2 * (alone.est.hi - alone.est.lo)  # 6 s and 7 s processes
    assert "(2 runs, 12 steps vs 2 runs, 16 steps)" in pooled.words


def _only(bench: Path, name: str) -> Path:
    one = bench / "only"
    one.mkdir()
    (one / f"trl-x-{name}.json").write_text((bench / f"trl-x-{name}.json").read_text())
    return one


def test_the_phase_table_sets_each_configuration_beside_each_record(tmp_path: Path) -> None:
    _trl(tmp_path, "defaults", 6.0)
    table = peer.phase_table(_ours(4.0), peer.records(tmp_path), {"ours": "hybridrl"})
    assert [r[0].text for r in table.rows] == ["hybridrl", "TRL GRPOTrainer · its defaults (gradient checkpointing on)"]
    step, rest = float(table.rows[0][1].text.split()[0]), float(table.rows[0][5].text.split()[0])
    assert step == pytest.approx(4.02, abs=0.02) and rest == pytest.approx(step / 4 - 0.1, abs=0.02)
    assert table.rows[1][-1].text == "1 run × 8 steps"
    assert peer.phase_table(_ours(4.0), peer.records(tmp_path / "none"), {}) is None


@pytest.mark.parametrize(("ours", "verdicts"), [
    (3.0, {"its defaults": "met", "off": "met"}),       # 0.5x TRL's defaults, 0.75x its best
    (4.6, {"its defaults": "missed", "off": "missed"}),  # 0.77x the defaults, 1.15x the best
])
def test_the_ratio_is_judged_against_the_defaults_and_the_best_configuration(tmp_path: Path, ours: float,
                                                                             verdicts: dict[str, str]) -> None:
    _trl(tmp_path, "defaults", 6.0)
    _trl(tmp_path, "gc-off", 4.0, gc=False)
    table = peer.ratio_table(peer.pairs(_ours(ours), peer.records(tmp_path), {"ours": "hybridrl"}), [DEFAULTS, BEST])
    got = {("its defaults" if "defaults" in r[1].text else "off"): r[6].text for r in table.rows}
    assert got == {k: v + targets.ONE_RUN for k, v in verdicts.items()}  # one TRL process: steps only
    assert [(r[4].text, r[5].text) for r in table.rows] == [(DEFAULTS.name, "peer/step_ratio ≤ 0.667"),
                                                           (BEST.name, "peer/step_ratio ≤ 1")]
    assert table.intervals == 2


def test_the_plot_is_drawn_where_records_are_and_removed_where_none(tmp_path: Path) -> None:
    out = tmp_path / "plots" / "peer.png"
    out.parent.mkdir()
    _trl(tmp_path / "bench", "defaults", 6.0)
    drawn = peer.plot(_ours(4.0), peer.records(tmp_path / "bench"), {"ours": "hybridrl"}, out)
    assert drawn == out and out.stat().st_size > 0
    assert peer.plot(_ours(4.0), [], {}, out) is None and not out.exists()


def test_the_readme_figures_quote_the_sections_and_name_a_study_without_records() -> None:
    from hybridrl.report import figures

    with_trl, without = "results/reference/2026-11-28-h200-peer", "results/reference/2026-11-28-h100-peer"
    assert "TRL GRPOTrainer · gradient checkpointing off" in figures.peer_table(with_trl, "phases")
    assert "hybridrl / TRL, step" in figures.peer_table(with_trl, "ratios")
    assert "vllm-inprocess (vllm-inprocess-peer-16a0c566)" in figures.start_table(with_trl)
    with pytest.raises(ValueError, match="no TRL record"):
        figures.peer_table(without)
    with pytest.raises(ValueError, match="neither phases nor ratios"):
        figures.peer_table(with_trl, "steps")


def test_the_targets_command_lists_the_bench_targets_of_each_study(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from hybridrl.cli import main

    study = Path("results/reference/2026-11-28-h200-peer").resolve()
    (tmp_path / study.name).symlink_to(study)
    main(["targets", "--reference", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    peer_rows = [ln for ln in lines if "peer/step_ratio" in ln]
    assert len(peer_rows) == 4 and all(ln.startswith(study.name) for ln in peer_rows)
    assert any("start/over_cli ≤ 1.3 | not settled: no interval" in ln for ln in lines)


def test_the_report_job_waits_for_the_measurements_it_reads(tmp_path: Path) -> None:
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([str(repo / ".venv" / "bin" / "snakemake"), "-s", str(repo / "Snakefile"), "--configfile",
                          str(repo / "config" / "gpu-peer.yaml"), "-n", "--cores", "1", "results/report.md"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = (out.stdout + out.stderr).split("rule report:")[1].split("output:")[0]
    for name in ("trl-vllm-inprocess-peer-defaults", "trl-vllm-inprocess-peer-gc-off", "start-vllm-inprocess-peer",
                 "start-sglang-peer", "trainer-qwen3-0.6b-hf-mb64-vocab-151936-chunked-head-r2"):
        assert f"results/bench/{name}.json" in report


def test_the_verdict_names_each_pair_with_its_sentence(tmp_path: Path) -> None:
    _trl(tmp_path, "defaults", 6.0)
    _trl(tmp_path, "gc-off", 4.0, gc=False)
    lines = peer.verdict_lines(peer.pairs(_ours(4.6), peer.records(tmp_path), {"ours": "hybridrl"}))
    assert [pair for pair, _ in lines] == ["hybridrl vs TRL · its defaults (gradient checkpointing on)",
                                          "hybridrl vs TRL · gradient checkpointing off"]
    # one TRL process: a ranking says "in these runs"
    assert "hybridrl was faster than TRL · its defaults (gradient checkpointing on) in these runs" in lines[0][1]
    assert "hybridrl was slower than TRL · gradient checkpointing off in these runs" in lines[1][1]  # 1.15x
    assert peer.verdict_lines(peer.pairs(_ours(4.6), peer.records(tmp_path / "none"), {})) == []


def test_a_bad_trl_record_stops_the_report_with_one_line_naming_it(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from hybridrl.cli import main

    study = tmp_path / "study"
    (study / "runs").mkdir(parents=True)
    committed = Path(__file__).resolve().parents[1] / "results" / "reference" / "2026-11-28-h200-peer"
    (study / "steps.csv").write_text((committed / "steps.csv").read_text())
    (study / "bench").mkdir()
    (study / "bench" / "trl-x.json").write_text(json.dumps({"tool": "trainer-bench"}))
    (study / "report.md").write_text("kept\n")
    with pytest.raises(SystemExit, match=r"hybridrl report: .*trl-x.json: not a record of `hybridrl peer-trl`"):
        main(["report", "--table", str(study / "steps.csv"), "--md", str(study / "report.md"), "--html",
              str(study / "report.html"), "--plots", str(study / "plots"), "--title", "t"])
    assert (study / "report.md").read_text() == "kept\n"  # nothing already written is lost


def test_the_peer_figures_pool_records_joined_by_plus() -> None:
    """Two leases' processes of TRL's defaults (5.31 s and 4.37 s a step) pooled: a median between theirs, and an
    interval over both processes that holds each one's median."""
    from hybridrl.report import figures

    a, b = (f"results/reference/{s}/bench/trl-vllm-inprocess-peer-defaults.json"
            for s in ("2026-11-28-h200-peer", "2026-11-29-h200-peer"))
    medians = [float(figures.peer_median(p).split()[0]) for p in (a, b)]
    pooled = figures.peer_median(f"{a}+{b}")
    value, lo, hi = (float(x) for x in pooled.replace("[", "").replace("]", "").replace(",", "").split())
    assert min(medians) < value < max(medians) and lo <= min(medians) and hi >= max(medians)
    ours = figures.peer_ratio("results/reference/2026-11-29-h200-peer", "sglang-peer-awake-863ba334", f"{a}+{b}")
    assert ours != figures.peer_ratio("results/reference/2026-11-29-h200-peer", "sglang-peer-awake-863ba334", b)
    with pytest.raises(ValueError, match="no 'nothing' after step 2"):
        figures.peer_median(f"{a}+{b}", "nothing")


def test_each_pair_is_compared_on_the_cards_both_sides_ran_on(tmp_path: Path) -> None:
    """Two leases, one card each: a configuration run in the second lease only is set against TRL's processes of
    that lease, not against both; TRL's best is the best there; a TRL record with no process on a configuration's
    cards is not paired with it; over two cards the ratio is taken card by card; the phase table has a row for each
    card; without job records every run and process is compared, and pooled."""
    bench, runs = tmp_path / "bench", tmp_path / "runs"
    _trl(bench, "defaults", 6.0, card="GPU-a")
    _trl(bench, "defaults-r2", 3.4, card="GPU-b")  # the second lease's card ran everything faster
    _trl(bench, "gc-off", 2.0, gc=False, card="GPU-a")  # TRL's best in the first lease only
    _trl(bench, "gc-off-r2", 3.0, gc=False, card="GPU-b")
    _trl(bench, "gc-off-awake", 2.8, gc=False, sleep=False, card="GPU-a")  # the first lease only
    df = pd.concat([_ours(4.0), _ours(2.4, runs=1).assign(run_id="fast-r0", config_id="fast")], ignore_index=True)
    for run, card in (("ours-r0", "GPU-a"), ("ours-r1", "GPU-b"), ("fast-r0", "GPU-b")):
        (runs / run).mkdir(parents=True)
        (runs / run / "slurm.json").write_text(_job(card))
    labels = {"ours": "hybridrl", "fast": "fast"}
    found = peer.pairs(df, peer.records(bench), labels, runs)
    fast = {short_label(p.peer.label): p for p in found if p.name == "fast"}
    assert sorted(fast) == ["gradient checkpointing off", "its defaults"]  # no process of gc-off-awake on GPU-b
    assert fast["its defaults"].est.value == pytest.approx(2.42 / 3.43, abs=0.02)  # not over the pooled 6 s and 3.4 s
    assert "(1 run, 6 steps vs 1 run, 8 steps)" in fast["its defaults"].words
    assert len([p for p in found if p.name == "hybridrl"]) == 3  # on both cards, every record has a process
    ours = {short_label(p.peer.label): p for p in found if p.name == "hybridrl"}
    # card by card, then their geometric mean: each card's ratio of medians, not the pooled 4.02 s over 3.43 and 6.03
    assert ours["its defaults"].est.value == pytest.approx((4.02 / 6.03 * 4.02 / 3.43) ** 0.5, abs=0.01)
    assert "(2 runs, 12 steps vs 2 runs, 16 steps)" in ours["its defaults"].words
    table = peer.ratio_table(found, [DEFAULTS, BEST])
    best = [(r[0].text, r[1].text) for r in table.rows if r[4].text == BEST.name]
    assert best == [("fast", "TRL GRPOTrainer · gradient checkpointing off"),  # 3.0 s on GPU-b, against 3.4 s
                    ("hybridrl", "TRL GRPOTrainer · gradient checkpointing off")]  # 2.0 and 3.0 s pooled, not 2.8
    pooled = {short_label(p.peer.label): p for p in peer.pairs(df, peer.records(bench), labels) if p.name == "fast"}
    assert len(pooled) == 3 and "vs 2 runs, 16 steps" in pooled["its defaults"].words
    rows = [r[0].text for r in peer.phase_table(df, peer.records(bench), labels, runs).rows]
    assert rows[:3] == ["fast · GPU-b", "hybridrl · GPU-b", "hybridrl · GPU-a"]  # the earliest run's card first
    assert len(rows) == 3 + 2 + 1 + 2 and rows[-1] == "TRL GRPOTrainer · gradient checkpointing off · GPU-a"
    assert len(peer.phase_table(df, peer.records(bench), labels).rows) == 2 + 3  # without job records: pooled
    (runs / "fast-r0" / "slurm.json").unlink()  # a run without its job record: no card to match, all compared
    assert len(peer.phase_table(df, peer.records(bench), labels, runs).rows) == 2 + 3
    assert len([p for p in peer.pairs(df, peer.records(bench), labels, runs) if p.name == "fast"]) == 3


def short_label(label: str) -> str:
    return peer.short(label).removeprefix("TRL · ").split(" (")[0]


def test_the_pair_figure_quotes_the_ratio_tables_row_for_the_defaults_and_the_best() -> None:
    """peer_pair gives the ratio the report's table judges each target on (card by card), and names TRL's best;
    a configuration without a pair, or an unknown choice, is refused with the cause."""
    from hybridrl.report import figures
    from hybridrl.report.plots import config_labels

    study = "results/reference/2026-11-29-h200-peer"
    ratios = figures.peer_table(study, "ratios")
    config = "vllm-inprocess-peer-awake-ids-e8e76953"
    label = config_labels(figures._table(study))[config]
    for against, bound in (("defaults", "≤ 0.667 |"), ("best", "≤ 1 |")):
        row = next(r for r in ratios.splitlines() if r.startswith(f"| {label} |") and bound in r)
        assert f"| {figures.peer_pair(study, config, against)} |" in row
        assert figures.peer_pair(study, config, against, "label") in row
    assert figures.peer_pair(study, "vllm-inprocess-peer-awake-ids", "best") == figures.peer_pair(study, config, "best")
    with pytest.raises(ValueError, match="'nothing' matches 0 configurations"):
        figures.peer_pair(study, "nothing", "best")
    with pytest.raises(ValueError, match="no TRL record paired with 'vllm-inprocess-peer'"):
        figures.peer_pair("results/reference/2026-11-29-h200-vllmstart", "vllm-inprocess-peer", "best")
    with pytest.raises(ValueError, match="against is defaults or best"):
        figures.peer_pair(study, config, "worst")
