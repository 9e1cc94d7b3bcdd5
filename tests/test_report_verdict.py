"""The report opens with its verdict (comparisons.verdict_lines): one plain sentence for each pair it compares."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from test_report import headline_run, headline_study, write_run
from test_report_placements import _study as placement_study

from hybridrl.report import aggregate_main, report_main
from hybridrl.report.aggregate import gather
from hybridrl.report.render import render
from hybridrl.report.wording import violations


def _render(df: pd.DataFrame, tmp_path: Path) -> tuple[str, str]:
    md, html = tmp_path / "report.md", tmp_path / "report.html"
    render(df, md, html, {}, "study", tmp_path / "runs")
    return md.read_text(), html.read_text()


def verdict_section(md: str) -> str:
    """The section after the title; it must be the verdict."""
    title, first = md.split("\n## ", 2)[:2]
    assert title.startswith("# ") and first.startswith("Verdict\n"), md[:300]
    return first


def bullets(section: str) -> list[str]:
    return [line[2:] for line in section.splitlines() if line.startswith("- ")]


def test_a_placement_only_study_opens_with_its_verdict_ranked_in_these_runs(tmp_path: Path) -> None:
    results = tmp_path / "results"
    runs = [write_run(results, "vllm-split-aaaa1111", "vllm", "split", speed=1.0, seed=1),
            write_run(results, "vllm-restart-bbbb2222", "vllm", "restart", speed=0.5, seed=2)]
    aggregate_main(runs, results / "steps.csv", results / "steps.parquet")
    report_main(results / "steps.parquet", results / "report.md", results / "report.html", results / "plots", "t")
    md, html = (results / "report.md").read_text(), (results / "report.html").read_text()
    section = verdict_section(md)
    # no colocated arm, so no placement group: the ratio table's pair, restart first, on the compared step
    [line] = bullets(section)
    assert line.startswith("**split vs restart.** Step time, checks excluded: split was faster than restart in these "
                           "runs, split / restart 0.")
    assert "[n/a]" not in section and not violations(section)
    assert html.index('<section id="verdict">') < html.index("<h2>Study summary</h2>")
    assert "Step time, checks excluded: split was faster than restart in these runs" in html.split("</section>")[0]


def test_without_an_interval_the_verdict_says_so_in_words_and_ranks_nothing(tmp_path: Path) -> None:
    # three steps: two of warm-up, so one steady step a side and no interval
    df = gather([write_run(tmp_path, "vllm-split-aaaa1111", "vllm", "split", steps=3, seed=1),
                 write_run(tmp_path, "vllm-restart-bbbb2222", "vllm", "restart", steps=3, speed=0.5, seed=2)])
    section = verdict_section(_render(df, tmp_path)[0])
    [line] = bullets(section)
    assert "split / restart 0." in line and "with no interval: a single value on a side is too few for one" in line
    assert "(1 run, 1 step vs 1 run, 1 step), so this ranks neither." in line
    assert "[n/a]" not in section and "faster" not in line and "slower" not in line


def test_an_engine_study_opens_with_each_pairs_rollout_sentence(tmp_path: Path) -> None:
    df = headline_study(headline_run("sglang-colocate-aaaa", "sglang", speed=2.0),
                        headline_run("vllm-colocate-bbbb", "vllm"))
    md, html = _render(df, tmp_path)
    section = verdict_section(md)
    [line] = bullets(section)
    assert line.startswith("**colocate: SGLang vs vLLM server.** Rollout throughput: SGLang was faster than vLLM "
                           "server in these runs, SGLang / vLLM server 2.")
    assert "[n/a]" not in section and not violations(section)
    # the metric-by-metric sentences stay with the headline further down
    assert md.index("## SGLang vs vLLM, metric by metric") > md.index("## Study summary")
    assert html.index('<section id="verdict">') < html.index("<h2>Study summary</h2>")


def test_placements_of_one_engine_get_a_sentence_each_and_arms_not_told_apart_are_not_ranked(tmp_path: Path) -> None:
    df = placement_study(overlap_s=10.0, split_s=6.0)
    section = verdict_section(_render(df, tmp_path)[0])
    pairs = [line.split(".**")[0] for line in bullets(section)]
    # the engine pairs first (SGLang against vLLM per placement), then each engine's placements
    assert pairs[-6:] == ["**SGLang: overlapped split (1 step stale) vs colocate", "**SGLang: split vs colocate",
                          "**SGLang: overlapped split vs split", "**vLLM server: overlapped split (1 step stale) vs "
                          "colocate", "**vLLM server: split vs colocate", "**vLLM server: overlapped split vs split"]
    said = dict(line.split(".** ", 1) for line in bullets(section))
    assert "could not be told apart" in said["**SGLang: overlapped split (1 step stale) vs colocate"]
    assert said["**SGLang: split vs colocate"].startswith(
        "Step time, checks excluded: split is faster than colocate")  # two runs a side: no "in these runs"
    assert "[n/a]" not in section and not violations(section)


def test_a_study_of_one_configuration_says_nothing_is_compared(tmp_path: Path) -> None:
    df = gather([write_run(tmp_path, "vllm-split-aaaa1111", "vllm", "split")])
    section = verdict_section(_render(df, tmp_path)[0])
    assert section.strip().endswith("One configuration, so nothing is compared: the tables below describe its runs.")
    assert not bullets(section)


def test_a_ratio_without_an_interval_says_why_and_ranks_neither() -> None:
    from hybridrl.report.stats import Estimate
    from hybridrl.report.wording import conclusion

    nan = float("nan")
    said = {n: conclusion("Step time", "split", "restart", Estimate(v, nan, nan, n, min(n, 1)), (1, n), (1, 3), False)
            for n, v in ((0, nan), (1, 0.5))}
    assert said[0] == ("Step time: split / restart has no value: a side has nothing to compare (1 run, 0 steps vs "
                       "1 run, 3 steps), so this ranks neither.")
    assert said[1] == ("Step time: split / restart 0.5x, with no interval: a single value on a side is too few for "
                       "one (1 run, 1 step vs 1 run, 3 steps), so this ranks neither.")
    zero = conclusion("Step time", "split", "restart", Estimate(nan, nan, nan, 4, 1), (1, 4), (1, 4), False)
    assert "split / restart has no value: restart's median is zero" in zero
