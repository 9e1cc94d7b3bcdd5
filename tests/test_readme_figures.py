"""README figures against the committed data, and the READMEs' conclusions against the wording rules."""

import json
import statistics
from pathlib import Path

import pandas as pd
import pytest

from hybridrl.report import figures, wording

REPO = Path(__file__).resolve().parents[1]
READMES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
           *sorted((REPO / "results" / "reference").glob("*/README.md"))]


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_marked_figure_matches_the_committed_steps(readme: Path) -> None:
    text = readme.read_text()
    assert figures.check(text) == []  # `python -m hybridrl figures --fix FILE` writes the data's figures


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_readme_conclusions_follow_the_wording_rules(readme: Path) -> None:
    assert wording.violations(readme.read_text()) == []


def test_the_reference_readmes_quote_figures_from_data() -> None:
    marked = {p.relative_to(REPO).as_posix(): len(figures.MARK.findall(p.read_text())) for p in READMES}
    assert marked["README.md"] >= 10 and marked["docs/results.md"] >= 20
    for name in ("2026-11-22-h200", "2026-11-22-4xh200-moe", "2026-11-23-2xh200-moe-full", "2026-11-23-h200-client",
                 "2026-11-23-h200-verdict", "2026-11-24-h200-learning", "2026-11-24-h200-trainer",
                 "2026-11-24-h200-soak", "2026-11-24-h200-timed", "2026-11-24-h200-packing",
                 "2026-11-24-h200-trainerloop", "2026-11-24-h200-timed-sglang", "2026-11-24-h200-trainerfuse",
                 "2026-11-24-h200-trainerfuse2", "2026-11-24-h200-trainerfast", "2026-11-24-h200-timingcost",
                 "2026-11-24-h200-trainerrepeat", "2026-11-24-h200-moe1full", "2026-11-24-h200-verdictpin",
                 "2026-11-24-h200-moe1pin", "2026-11-24-h200-verdictpin2",
                 "2026-11-24-h200-moe1pin2", "2026-11-24-h200-verdictwarm", "2026-11-24-h200-learnlr",
                 "2026-11-25-h200-verdictwarm2", "2026-11-25-h200-learnentropy", "2026-11-25-h200-hffused",
                 "2026-11-25-h200-hfrounds", "2026-11-25-h200-moerounds", "2026-11-25-h200-moepermute",
                 "2026-11-25-h200-moegathers", "2026-11-25-h200-moeexport", "2026-11-25-h200-syncfree",
                 "2026-11-25-h200-syncfree2", "2026-11-25-h200-hfexport", "2026-11-25-h200-asyncstate",
                 "2026-11-25-h200-exportprofile", "2026-11-25-h200-exportstage", "2026-11-25-h200-overlap1",
                 "2026-11-24-h200-timingcost2", "2026-11-25-h200-placement1",
                 "2026-11-25-h200-placement1v", "2026-11-27-2xh200-tp2residual"):
        assert marked[f"results/reference/{name}/README.md"] >= 5, name
    for name in ("2026-11-24-h200-faults", "2026-11-24-h200-trainermoe"):
        assert marked[f"results/reference/{name}/README.md"] >= 2, name


def test_a_span_in_decimals_and_a_whole_configuration_id_that_starts_another() -> None:
    study = "results/reference/2026-11-25-h200-overlap1"
    # sglang-overlap-<hash> is the start of sglang-overlap-fault-... and -megatron-...: the whole id names one
    with pytest.raises(ValueError, match="matches 3 configurations"):
        figures.evaluate(f"median {study} sglang-overlap timing_s/step")
    assert figures.evaluate(f"span {study} sglang-overlap-fault-c90a03d3 mem/kv_capacity_tokens 1 6 d0") == \
        "486028–631573"  # the restart's smaller cache, then the resumed engine's
    # one number where both ends print alike, not "0.0–0.0"
    assert figures.evaluate(f"span {study} sglang-overlap-cc905499 timing_s/overlap 6 6 d1") == "0.0"
    assert figures.evaluate(f"span {study} sglang-overlap-cc905499 timing_s/overlap 2 5 d1") == "1.8–2.2"


def test_a_figure_that_disagrees_with_the_data_fails() -> None:
    study = "results/reference/2026-11-22-4xh200-moe"
    right = figures.evaluate(f"span {study} vllm-colocate perf/throughput 1 6")
    assert right.startswith("3.1k")  # the README once said 3.9k
    text = f"went <!--fig span {study} vllm-colocate perf/throughput 1 6-->3.9k–6.8k<!--/fig--> in steps 1-6"
    [(expr, written, want)] = figures.check(text)
    assert (written, want) == ("3.9k–6.8k", right)
    assert figures.check(figures.fill(text)) == []
    with pytest.raises(ValueError, match="matches 2 configurations"):
        figures.evaluate(f"median {study} sglang perf/throughput")


def test_a_json_figure_is_read_from_the_committed_result_and_a_wrong_one_fails() -> None:
    path = "results/reference/2026-11-23-h200-trainer/trainer-qwen3-0.6b-mb8.json"
    assert figures.evaluate(f"value {path} micro_batch 1 0") == "8"
    written = f"<!--fig value {path} hf.update_s_median-->9.99<!--/fig-->"
    [(_, text, want)] = figures.check(written)
    assert text == "9.99" and want != "9.99"
    with pytest.raises(ValueError, match="no field 'hf.nope'"):
        figures.evaluate(f"value {path} hf.nope")


def test_a_json_figure_indexes_a_list_by_number_and_refuses_one_past_its_end() -> None:
    path = "results/reference/2026-11-23-h200-client/bench/client-ceiling.json"

    settings = json.loads((figures.REPO / path).read_text())["settings"]
    assert figures.evaluate(f"value {path} settings.0.concurrency 1 0") == f"{settings[0]['concurrency']:,}"
    with pytest.raises(ValueError, match="no field"):
        figures.evaluate(f"value {path} settings.{len(settings)}.concurrency")


def test_the_cli_answers_a_figure_that_names_a_missing_field_in_one_line(tmp_path, capsys) -> None:
    from hybridrl.cli import main

    doc = tmp_path / "README.md"
    doc.write_text("<!--fig value results/reference/2026-11-23-h200-trainer/trainer-qwen3-0.6b-mb8.json "
                   "hf.nope-->1<!--/fig-->\n")
    with pytest.raises(SystemExit) as exc:
        main(["figures", str(doc)])
    assert str(exc.value) == (f"hybridrl figures: {doc}:1: figure 'value results/reference/2026-11-23-h200-trainer/"
                              "trainer-qwen3-0.6b-mb8.json hf.nope': results/reference/2026-11-23-h200-trainer/"
                              "trainer-qwen3-0.6b-mb8.json has no field 'hf.nope'")


_STUDY = "results/reference/2026-11-22-4xh200-moe"
_STALE = f"<!--fig span {_STUDY} vllm-colocate perf/throughput 1 6-->3.9k–6.8k<!--/fig-->"  # the data give 3.1k–...


def _figures_cli(*argv: str) -> str:
    from hybridrl.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["figures", *argv])
    return str(exc.value)


def test_fix_on_a_full_disk_leaves_the_file_as_it_was(tmp_path, monkeypatch) -> None:
    import errno

    doc = tmp_path / "README.md"
    before = "# notes\n" + f"throughput went {_STALE} in steps 1-6\n" + "a long tail the fix must not cut\n" * 100
    doc.write_text(before)
    real = Path.write_text

    def full_disk(self, data, *args, **kwargs):  # the disk fills half-way through the write
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    said = _figures_cli("--fix", str(doc))
    monkeypatch.undo()
    assert doc.read_text() == before and sorted(tmp_path.iterdir()) == [doc]  # intact, no temp file left
    assert said == f"hybridrl figures: [Errno 28] No space left on device: {doc} is left as it was"
    assert figures.main([doc], fix=True) == 0 and figures.check(doc.read_text()) == []


def test_an_unclosed_figure_marker_is_refused_with_its_file_and_line(tmp_path) -> None:
    doc = tmp_path / "README.md"
    doc.write_text(f"# title\n\nfast: <!--fig median {_STUDY} vllm-colocate perf/throughput-->3.1k and more\n")
    said = _figures_cli(str(doc))
    assert said.startswith(f"hybridrl figures: {doc}:3: figure marker '<!--fig median ")
    assert said.endswith("has no closing <!--/fig-->") and "\n" not in said
    # one left open before a closed one: the regex would swallow the second into the first's text
    doc.write_text(f"<!--fig median {_STUDY} vllm-colocate perf/throughput-->3.1k\nthen\n{_STALE}\n")
    assert _figures_cli("--fix", str(doc)).startswith(f"hybridrl figures: {doc}:1: figure '<!--fig median ")
    assert "has no closing <!--/fig--> before the next figure" in _figures_cli(str(doc))


def test_a_figure_with_too_few_arguments_names_the_file_the_figure_and_what_it_needs(tmp_path) -> None:
    doc = tmp_path / "README.md"
    doc.write_text(f"x\n<!--fig ratio {_STUDY} vllm-colocate-->1x<!--/fig-->\n")
    assert _figures_cli(str(doc)) == (f"hybridrl figures: {doc}:2: figure 'ratio {_STUDY} vllm-colocate': ratio takes "
                                      "STUDY A B COLUMN, got 2 arguments")
    assert _figures_cli("--fix", str(doc)).endswith("ratio takes STUDY A B COLUMN, got 2 arguments")
    with pytest.raises(ValueError, match=r"verdict takes STUDY A B COLUMN \[MODE\], got 6 arguments"):
        figures.evaluate("verdict a b c d e f")


def test_a_file_that_is_not_utf8_is_named(tmp_path) -> None:
    doc = tmp_path / "README.md"
    doc.write_bytes(b"# ok\ncaf\xe9\n")
    assert _figures_cli(str(doc)) == f"hybridrl figures: {doc}:2: not UTF-8 text (byte 0xe9)"


def test_a_bench_figure_spans_one_paths_repeats_and_names_a_path_it_lacks() -> None:
    path = "results/reference/2026-11-23-h200-client/bench/vllm-inprocess-new.json"
    import json

    rows = json.loads((figures.REPO / path).read_text())["repeats"]
    cpu = [r["controller_cpu_pct"] for r in rows if r["path"] == "raw"]
    assert figures.evaluate(f"repeats {path} raw controller_cpu_pct 1") == f"{min(cpu):.0f}–{max(cpu):.0f}"
    with pytest.raises(ValueError, match="no repeats of path 'old_client'"):  # in process: no HTTP client
        figures.evaluate(f"repeats {path} old_client perf/throughput")


def test_series_and_logged_figures_read_the_committed_data_and_fail_on_what_is_not_there() -> None:
    study = "results/reference/2026-11-24-h200-learning"
    evals = figures.evaluate(f"series {study} vllm-colocate eval/accuracy 100 1")
    assert evals.startswith("step 5: 44.5, step 10: ") and evals.count("step ") == 6  # every 5th of 30 steps
    with pytest.raises(ValueError, match="has no 'eval/accuracy' at any step"):
        figures.evaluate(f"series {study} vllm-vocab-qwen eval/accuracy")  # the rollout-only runs never evaluate
    log = f"{study}/logs/prepare-gpu-h200-learning.log"
    assert figures.evaluate(rf"logged {log} base\saccuracy\s(\S+)\son") == "0.441"
    with pytest.raises(ValueError, match="nothing matches"):
        figures.evaluate(rf"logged {log} accuracy\s(\S+)\sof\s1,000,000")


def test_at_and_slope_figures_read_one_step_and_the_steady_trend() -> None:
    study = "results/reference/2026-11-24-h200-soak"
    # warm-up's rise (step 1 to 3) is in `at`, and out of `slope`, which is fitted over the steps after warm-up
    assert figures.evaluate(f"at {study} vllm-soak mem/engine_asleep_gb 1") == "2.54"
    assert figures.evaluate(f"at {study} vllm-soak mem/engine_asleep_gb 3") == "3.02"
    assert figures.evaluate(f"slope {study} vllm-soak mem/engine_asleep_gb GB").startswith("no trend shown: ")
    assert figures.evaluate(f"slope {study} sglang-soak mem/engine_asleep_gb GB").startswith("grows +0.00016 GB")
    with pytest.raises(ValueError, match="has 0 readings of 'mem/engine_asleep_gb' at step 51"):
        figures.evaluate(f"at {study} vllm-soak mem/engine_asleep_gb 51")  # the run has 50 steps
    with pytest.raises(ValueError, match=r"steps.csv has no column 'mem/engine_asleep_GB'"):
        figures.evaluate(f"slope {study} vllm-soak mem/engine_asleep_GB GB")
    with pytest.raises(ValueError, match="step 'three' is not a step number"):
        figures.evaluate(f"at {study} vllm-soak mem/engine_asleep_gb three")


def test_run_names_one_replicate_where_a_configuration_has_several() -> None:
    study = "results/reference/2026-11-28-4xh200-writeupdrawn"
    with pytest.raises(ValueError, match="has 3 readings"):  # three leases' runs of one configuration
        figures.evaluate(f"at {study} vllm-inprocess-writeup check/adapter_logprob_shift 1 3")
    first = figures.evaluate(f"at {study} run=vllm-inprocess-writeup-67c3b8ec check/adapter_logprob_shift 1 3")
    second = figures.evaluate(f"at {study} run=vllm-inprocess-writeup-67c3b8ec-r2 check/adapter_logprob_shift 1 3")
    assert first == "0.063" and second != ""
    with pytest.raises(ValueError, match="no run 'vllm-inprocess-writeup-67c3b8ec-r9'"):
        figures.evaluate(f"at {study} run=vllm-inprocess-writeup-67c3b8ec-r9 check/adapter_logprob_shift 1 3")
    one = figures.evaluate(f"verdict {study} run=vllm-inprocess-writeup-67c3b8ec run=vllm-inprocess-writeup-67c3b8ec-r2"
                           " timing_s/step_compared time")
    assert "vllm-inprocess-writeup-67c3b8ec / vllm-inprocess-writeup-67c3b8ec-r2" in one and "run=" not in one


def test_replayed_counts_the_requests_every_replicate_answered_at_the_same_length() -> None:
    warm = "results/reference/2026-11-24-h200-verdictwarm"
    assert figures.evaluate(f"replayed {warm} vllm-verdict 10") == "128 of 128"  # the vLLM server repeats itself
    assert figures.evaluate(f"replayed {warm} sglang-verdict-795e3683 10") != "128 of 128"
    with pytest.raises(ValueError, match="has 1 run; replayed compares"):
        figures.evaluate("replayed results/reference/2026-11-24-h200-learning sglang-colocate 10")
    with pytest.raises(ValueError, match="is not a step number"):
        figures.evaluate(f"replayed {warm} vllm-verdict ten")


def test_alike_counts_same_length_answers_of_replicates_that_drew_their_own_seeds() -> None:
    draws = "results/reference/2026-11-27-h200-verdictdraws"
    said = figures.evaluate(f"alike {draws} vllm-verdict-draws 10")
    alike, total = (int(n) for n in said.split(" of "))
    assert total == 128 and 0 < alike < 128  # own seeds: the vLLM server no longer repeats every answer
    with pytest.raises(ValueError, match="drew different requests"):  # replayed refuses runs of other seeds
        figures.evaluate(f"replayed {draws} vllm-verdict-draws 10")
    with pytest.raises(ValueError, match="share sampling seeds at step 10; replayed compares those"):
        figures.evaluate("alike results/reference/2026-11-24-h200-verdictwarm vllm-verdict 10")


def test_run_medians_lists_each_replicate_in_the_order_it_ran() -> None:
    study = "results/reference/2026-11-24-h200-verdictpin"
    df = pd.read_csv(REPO / study / "steps.csv")
    steady = df[(df["step"] > 2) & df["run_id"].str.startswith("vllm-server-")]
    order = steady.groupby("run_id")["time_unix"].min().sort_values().index
    expected = ", ".join(f"{steady[steady['run_id'] == r]['timing_s/step'].median():.2f}" for r in order)
    assert figures.evaluate(f"run_medians {study} vllm-server timing_s/step 1 2") == expected
    assert figures.evaluate(f"run_medians {study} vllm-server perf/throughput 0.001 1") == "10.7, 13.4, 14.6"
    with pytest.raises(ValueError, match="steps.csv has no column 'perf/tput'"):
        figures.evaluate(f"run_medians {study} vllm-server perf/tput")


def test_a_figure_naming_a_column_the_table_lacks_says_so_instead_of_writing_a_dash() -> None:
    study = "results/reference/2026-11-24-h200-verdictwarm"
    for expr in (f"median {study} sglang-verdict perf/tput", f"interval {study} sglang-verdict perf/tput",
                 f"ratio {study} sglang-verdict vllm-verdict perf/tput",
                 f"verdict {study} sglang-verdict vllm-verdict perf/tput time",
                 f"between {study} * finish/eos_frac 0 1", f"span {study} sglang-verdict perf/tput"):
        with pytest.raises(ValueError, match="steps.csv has no column 'perf/tput'|no column 'finish/eos_frac'"):
            figures.evaluate(expr)
    assert figures.evaluate(f"median {study} sglang-verdict response_length/mean") == "81.60"


def test_a_paired_figure_differences_two_runs_step_by_step_and_refuses_unpaired_ones() -> None:
    low, high = "results/reference/2026-11-24-h200-learning", "results/reference/2026-11-24-h200-learnlr"
    a, b = pd.read_csv(REPO / low / "steps.csv"), pd.read_csv(REPO / high / "steps.csv")
    ra = a[a["run_id"].str.startswith("sglang-colocate-")].set_index("step")["reward/accuracy"]
    rb = b[b["run_id"].str.startswith("sglang-learn-")].set_index("step")["reward/accuracy"]
    text = figures.evaluate(f"paired {low} sglang-colocate {high} sglang-learn reward/accuracy 21 30")
    assert text.startswith(f"{(rb - ra).loc[21:30].mean():+.3f} [") and text.endswith("] over 10 steps")
    lo, hi = (float(x) for x in text.split("[")[1].split("]")[0].split(", "))
    assert lo < (rb - ra).loc[21:30].mean() < hi
    with pytest.raises(ValueError, match="steps 'one'..'10' are not step numbers"):
        figures.evaluate(f"paired {low} sglang-colocate {high} sglang-learn reward/accuracy one 10")
    # steps 31-50 exist on one side only: no pairs
    with pytest.raises(ValueError, match="share 0 steps"):
        figures.evaluate(f"paired {low} sglang-colocate {high} sglang-learn reward/accuracy 31 50")
    with pytest.raises(ValueError, match="has 3 runs; a paired figure takes one run a side"):
        figures.evaluate(f"paired results/reference/2026-11-24-h200-verdictwarm sglang-verdict {high} sglang-learn "
                         "reward/accuracy 1 10")
    # the same seed, data and batch shape through another tokenizer (4,096 tokens): prompts of other lengths
    with pytest.raises(ValueError, match="drew different prompts at step 1"):
        figures.evaluate(f"paired {low} sglang-vocab-small {high} sglang-learn reward/mean 1 3")
    with pytest.raises(ValueError, match="requests/step-0001.jsonl is missing: cannot check"):  # recorded none
        figures.evaluate(f"paired results/reference/2026-11-22-h200 sglang-colocate-hf {high} sglang-learn "
                         "reward/mean 1 3")


def test_studies_joined_by_a_plus_pool_their_runs_and_keep_each_leases_replicates_apart() -> None:
    first, second = "results/reference/2026-11-24-h200-verdictpin", "results/reference/2026-11-24-h200-verdictpin2"
    pooled = figures._table(f"{first}+{second}")
    assert len(pooled) == len(figures._table(first)) + len(figures._table(second))
    assert pooled["run_id"].nunique() == 12  # the same run ids in both leases, kept apart by the folder
    assert {r.split("/")[0] for r in pooled["run_id"]} == {Path(first).name, Path(second).name}
    joined = figures.evaluate(f"run_medians {first}+{second} vllm-server perf/throughput 0.001 1")
    assert joined == ", ".join(figures.evaluate(f"run_medians {s} vllm-server perf/throughput 0.001 1")
                               for s in (first, second))
    assert "(6 runs, 48 steps vs 6 runs, 48 steps)" in figures.evaluate(
        f"verdict {first}+{second} sglang-full vllm-server perf/throughput rate")
    assert [figures.evaluate(f"runs {s} sglang-full") for s in (first, f"{first}+{second}")] == ["3", "6"]
    with pytest.raises(ValueError, match="names a study twice"):
        figures.evaluate(f"median {first}+{first} sglang-full perf/throughput")


def test_a_path_ratio_compares_two_paths_of_one_bench_with_an_interval_over_repeats() -> None:
    path = "results/reference/2026-11-24-h200-timed/bench/sglang-timed.json"
    text = figures.evaluate(f"path_ratio {path} stream_all raw")
    assert text.startswith("0.59x [") and f"{figures._json(path)['over_raw']['stream_all']:.2f}x" in text
    with pytest.raises(ValueError, match="has no repeats of path 'old_client'"):
        figures.evaluate(f"path_ratio {path} old_client raw")  # the timed plan measured no old client


def test_an_update_ratio_compares_two_trainer_benchmarks_over_their_updates() -> None:
    bench = "results/reference/2026-11-24-h200-packing/bench"
    packed = f"{bench}/trainer-qwen3-0.6b-hf-mb32-varied.json"
    padded = f"{bench}/trainer-qwen3-0.6b-hf-mb32-varied-no-pack.json"
    text = figures.evaluate(f"update_ratio {packed} hf {padded} hf")
    ratio = figures._json(packed)["hf"]["update_s_median"] / figures._json(padded)["hf"]["update_s_median"]
    assert text.startswith(f"{ratio:.2f}x [")
    with pytest.raises(ValueError, match="has no update_s_all of trainer 'megatron'"):
        figures.evaluate(f"update_ratio {packed} megatron {padded} hf")  # that file holds HF's row only


def test_a_process_ratio_pools_processes_and_names_a_glob_that_matches_nothing() -> None:
    bench = "results/reference/2026-11-25-h200-hffused/bench"
    fused = f"{bench}/trainer-qwen3-0.6b-hf-mb32.json+{bench}/trainer-qwen3-0.6b-hf-mb32-r?.json"
    medians = figures.evaluate(f"process_medians {fused} hf").split(", ")
    assert len(medians) == 4  # rounds 1, 2, 4 and 5: the glob takes neither the varied nor the PEFT files
    assert medians[0] == f"{figures._json(bench + '/trainer-qwen3-0.6b-hf-mb32.json')['hf']['update_s_median']:.2f}"
    a, b = f"{bench}/trainer-qwen3-0.6b-hf-mb128.json", f"{bench}/trainer-qwen3-0.6b-hf-mb32.json"
    pooled, alone = figures.evaluate(f"process_ratio {a} {b} hf"), figures.evaluate(f"update_ratio {a} hf {b} hf")
    assert pooled.split(" [")[0] == alone.split(" [")[0]  # one process a side: the same ratio of medians
    with pytest.raises(ValueError, match="no trainer-bench result matches"):
        figures.evaluate(f"process_medians {bench}/trainer-nope-*.json hf")
    rounds = "results/reference/2026-11-25-h200-hfrounds/bench"
    mega, hf = f"{rounds}/trainer-qwen3-0.6b-megatron-mb64-r?.json", f"{rounds}/trainer-qwen3-0.6b-hf-mb64-r?.json"
    assert figures.evaluate(f"process_ratio {mega} {hf} megatron hf").endswith("]")  # each side its own trainer
    with pytest.raises(ValueError, match="has no update_s_all of trainer 'megatron'"):
        figures.evaluate(f"process_ratio {mega} {hf} megatron")  # HF's files hold no Megatron row


def test_a_profile_op_reads_one_operators_gpu_time() -> None:
    path = "results/reference/2026-11-25-h200-moerounds/bench/profile-qwen3-30b-a3b-megatron-mb16.txt"
    assert figures.evaluate(f"profile_op {path} aten::index_add_") == "0.156"  # '155.553ms' in its Self CUDA cell
    with pytest.raises(ValueError, match="no row for operator 'aten::nope'"):
        figures.evaluate(f"profile_op {path} aten::nope")


def test_a_profile_total_reads_the_trainer_profile_table() -> None:
    path = "results/reference/2026-11-24-h200-packing/bench/profile-qwen3-0.6b-megatron-mb32.txt"
    assert figures.evaluate(f"profile_total {path} cuda") == "1.27"  # 'Self CUDA time total: 1.268s'
    assert figures.evaluate(f"profile_total {path} cpu") == "1.61"
    with pytest.raises(ValueError, match="cuda or cpu"):
        figures.evaluate(f"profile_total {path} gpu")


def test_a_profile_wall_reads_the_tables_first_line(tmp_path: Path) -> None:
    path = "results/reference/2026-11-25-h200-moegathers/bench/profile-qwen3-30b-a3b-megatron-mb16.txt"
    assert figures.evaluate(f"profile_wall {path}") == "1.72"  # '...: profiled update 1.715 s'
    headless = tmp_path / "p.txt"
    headless.write_text("Self CUDA time total: 1.0s\n")
    with pytest.raises(ValueError, match="no first line"):
        figures.evaluate(f"profile_wall {headless}")


def test_a_profile_range_reads_the_labelled_ranges_table() -> None:
    path = "results/reference/2026-11-25-h200-exportprofile/bench/profile-qwen3-30b-a3b-megatron-mb16-export.txt"
    assert figures.evaluate(f"profile_range {path} export.to_host 4") == "0.1185"  # 'export.to_host  3  0.1185 ...'
    assert figures.evaluate(f"profile_range {path} hybridrl.export 2") == "0.23"
    with pytest.raises(ValueError, match="no labelled range 'export.nope'"):
        figures.evaluate(f"profile_range {path} export.nope")


def test_process_ratio_sums_per_update_lists() -> None:
    d = "results/reference/2026-11-25-h200-asyncstate/bench"
    a, b = f"{d}/trainer-qwen3-0.6b-hf-mb32-r1.json", f"{d}/trainer-qwen3-0.6b-hf-mb32-src-5173bee-r1.json"
    new, old = json.loads((REPO / a).read_text())["hf"], json.loads((REPO / b).read_text())["hf"]
    summed = [u + s for u, s in zip(new["update_s_all"], new["state_s_all"], strict=True)]
    want = statistics.median(summed) / statistics.median(old["update_s_all"])
    text = figures.evaluate(f"process_ratio {a} {b} hf hf update_s_all+state_s_all update_s_all")
    assert text.startswith(f"{want:.2f}x [")
    with pytest.raises(ValueError, match="has no state_s_all of trainer 'hf'"):  # a commit from before the field
        figures.evaluate(f"process_ratio {b} {a} hf hf update_s_all+state_s_all")


def test_process_medians_read_any_per_update_list() -> None:
    paths = "results/reference/2026-11-25-h200-syncfree2/bench/trainer-qwen3-0.6b-hf-mb32-r?.json"
    data = [json.loads(p.read_text())["hf"] for p in sorted(REPO.glob(paths))]
    for field in ("update_s_all", "save_s_all"):
        want = ", ".join(f"{statistics.median(d[field]):.3f}" for d in data)
        assert figures.evaluate(f"process_medians {paths} hf 3 {field}") == want
    with pytest.raises(ValueError, match="has no nope_s_all of trainer 'hf'"):
        figures.evaluate(f"process_medians {paths} hf 3 nope_s_all")


def test_profile_waits_count_the_hosts_waits_in_all_or_at_some_lines() -> None:
    path = "results/reference/2026-11-25-h200-syncfree/bench/profile-qwen3-30b-a3b-megatron-mb16.txt"
    assert figures.evaluate(f"profile_waits {path}") == "51"  # 'host waits for the GPU in one update: 51 (...'
    assert figures.evaluate(f"profile_waits {path} packing.py:") == "24"  # two rows of 12
    assert figures.evaluate(f"profile_waits {path} nowhere.py") == "0"
    older = "results/reference/2026-11-25-h200-moegathers/bench/profile-qwen3-30b-a3b-megatron-mb16.txt"
    with pytest.raises(ValueError, match="no list of the host's waits"):
        figures.evaluate(f"profile_waits {older}")


def test_share_and_unattributed_figures_split_a_step_into_its_phases(tmp_path: Path) -> None:
    study = "results/reference/2026-11-24-h200-moe1full"
    df = pd.read_csv(REPO / study / "steps.csv")
    run = df[df["config_id"].str.startswith("sglang-colocate-megatron-")]
    steady = run[run["step"] > 2]
    share = 100 * steady["timing_s/update_actor"] / steady["timing_s/step"]
    assert figures.evaluate(f"share {study} sglang-colocate-megatron timing_s/update_actor").startswith(
        f"{share.median():.1f}% [")
    assert figures.evaluate(f"unattributed {study} sglang-colocate-megatron") == "0.00"  # every second is a phase's
    # three seconds no phase names, in one step, show up; and a table without the step's time is named
    df.loc[run.index[4], "timing_s/step"] += 3.0
    (tmp_path / "steps.csv").write_text(df.to_csv(index=False))
    assert figures.evaluate(f"unattributed {tmp_path} sglang-colocate-megatron") == "3.00"
    bare = tmp_path / "bare"
    bare.mkdir()
    df.drop(columns=["timing_s/step"]).to_csv(bare / "steps.csv", index=False)
    with pytest.raises(ValueError, match="no steady-state step with both timing_s/update_actor and timing_s/step"):
        figures.evaluate(f"share {bare} sglang-colocate-megatron timing_s/update_actor")
    with pytest.raises(ValueError, match="has no step with its timing_s/step"):
        figures.evaluate(f"unattributed {bare} sglang-colocate-megatron")


def test_a_total_is_the_steady_median_of_columns_summed_step_by_step() -> None:
    study = "results/reference/2026-11-22-h200"
    df = pd.read_csv(REPO / study / "steps.csv")
    steady = df[df["config_id"].str.startswith("vllm-colocate-hf-") & (df["step"] > 2)]
    phases = ["timing_s/sleep", "timing_s/wake", "timing_s/update_weights"]
    summed = steady[phases].sum(axis=1)
    assert summed.median() != sum(steady[c].median() for c in phases)  # not the sum of the medians
    assert figures.evaluate(f"total {study} vllm-colocate-hf {'+'.join(phases)}") == f"{summed.median():#.3g}"
    # one column is its median; a step that lacks a part is left out, and none left is named
    assert figures.evaluate(f"total {study} vllm-colocate-hf perf/throughput") == \
        figures.evaluate(f"median {study} vllm-colocate-hf perf/throughput")
    with pytest.raises(ValueError, match="no steady-state step with all of timing_s/sleep"):
        figures.evaluate(f"total {study} sglang-split-hf timing_s/sleep+timing_s/update_weights")
    with pytest.raises(ValueError, match="has no column 'timing_s/nap'"):
        figures.evaluate(f"total {study} vllm-colocate-hf timing_s/sleep+timing_s/nap")


def test_the_verdicts_count_of_intervals_is_the_number_it_quotes() -> None:
    """The verdict section says how many 95% intervals it quotes (the note on multiple comparisons): every verdict
    and ratio figure in it is one."""
    import re

    section = (REPO / "docs" / "results.md").read_text().split("## The verdict so far")[1].split("\n## ")[0]
    quoted = len(re.findall(r"<!--fig (?:verdict|ratio|change) ", section))
    said = re.search(r"This section quotes (\d+) intervals", section)
    assert said, "the verdict section no longer says how many intervals it quotes"
    assert int(said.group(1)) == quoted, f"it says {said.group(1)}, it quotes {quoted}"


def test_the_write_up_table_phase_table_and_memory_table_quote_the_reports_tables() -> None:
    moe = "results/reference/2026-11-27-2xh200-moe2new"
    text = figures.evaluate(f"writeup_table {moe}")
    assert "**colocate: SGLang (kv-only) vs vLLM server** (trainer megatron" in text
    throughput = next(line for line in text.splitlines() if line.startswith("| Rollout throughput"))
    assert "| 3.9x |" in throughput and "[1.03x, 1.26x]" in throughput and "1 × 8 / 1 × 8" in throughput
    phases = figures.evaluate("phase_table results/reference/2026-11-28-h100-peer")
    assert "| Step time, checks excluded (s) | 4.01 [3.78, 4.32] | 3.95 [3.75, 4.26] |" in phases
    # the write-up's mechanism at its own shape: in-process vLLM beside Megatron woke with its memory each time
    memory = figures.evaluate("memory_table results/reference/2026-11-23-2xh200-moe-full")
    inprocess = next(line for line in memory.splitlines() if line.startswith("| vllm-inprocess"))
    assert "| 79.34 / 79.33 |" in inprocess
    with pytest.raises(ValueError, match="no pair of SGLang and a vLLM arm"):
        figures.evaluate("writeup_table results/reference/2026-11-27-h200-verdictvllm")


def test_the_write_up_summary_sets_each_pairs_ratio_beside_the_claim() -> None:
    study = "results/reference/2026-11-28-4xh200-writeupdrawn"
    text = figures.evaluate(f"writeup_summary {study}")
    header = next(line for line in text.splitlines() if line.startswith("| metric"))
    assert header.endswith("| colocate: SGLang (full release) vs vLLM server | colocate: SGLang (full release) vs "
                           "vLLM in-process |")
    # the same ratios and intervals as the full tables, one column a pair
    full = figures.evaluate(f"writeup_table {study}")
    measured = [line.split(" | ")[4:6] for line in full.splitlines() if line.startswith("| Rollout throughput")]
    summary = next(line for line in text.splitlines() if line.startswith("| Rollout throughput"))
    assert summary == "| Rollout throughput (SGLang / vLLM) | 3.9x | " + " | ".join(
        f"{value} {ci}" for value, ci in measured) + " |"
    assert "| runs (SGLang / vLLM) | – | 2 / 2 | 2 / 3 |" in text
    with pytest.raises(ValueError, match="no pair of SGLang and a vLLM arm"):
        figures.evaluate("writeup_summary results/reference/2026-11-27-h200-verdictvllm")
