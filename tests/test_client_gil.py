"""The client-gil benchmark: every mode measured with the client really running beside the loop, its table read
from its rows, and the committed figures in the README and the study's README equal to the committed JSON.
No speed is asserted: the figures are the benchmark's output."""

import json
from pathlib import Path

import pytest

from hybridrl import cli
from hybridrl.tools.client_gil import launch_loop, markdown_table, measure

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "results/reference/2026-11-26-cpu-client-gil"


def test_every_mode_is_timed_while_one_batch_is_in_flight():
    # each answer takes 200 x 10 ms at the fake engine: the 50 rounds of the loop fit inside one batch even on a
    # busy machine
    row = measure("sglang", 0.5, requests=4, tokens=200, event_interval_s=0.01, ops=50, repeats=2, settle_s=0.1)
    assert row["streamed_requests"] == 2
    assert row["alone_s"] > 0 and row["thread_s"] > 0 and row["process_s"] > 0
    assert row["thread_covered"] == 2 and row["process_covered"] == 2
    assert row["thread_x_min"] <= row["thread_x"] <= row["thread_x_max"]  # the median of the rounds' ratios
    assert "| sglang | 2/4 |" in markdown_table([row])


def test_the_loop_does_what_it_is_told():
    assert launch_loop(10) > 0


def test_the_cli_refuses_a_bad_fraction_and_a_missing_gpu_and_writes_json(tmp_path, capsys, monkeypatch):
    import torch

    with pytest.raises(SystemExit):
        cli.main(["client-gil", "--stream-fraction", "2"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as no_gpu:
        cli.main(["client-gil", "--device", "cuda"])
    assert no_gpu.value.code == 2 and "--device cuda: torch" in capsys.readouterr().err
    out = tmp_path / "gil.json"
    cli.main(["client-gil", "--format", "vllm", "--stream-fraction", "0", "--requests", "2", "--tokens", "4",
              "--event-interval", "0.001", "--ops", "50", "--repeats", "1", "--out", str(out)])
    settings = json.loads(out.read_text())["settings"]
    assert [(s["format"], s["streamed_requests"]) for s in settings] == [("vllm", 0)]
    assert "| vllm | 0/2 |" in capsys.readouterr().out


ON_GPU_HOST = REPO / "results/reference/2026-11-26-h200-client-gil"
GIL_RESULTS = [COMMITTED / "client-gil.json", *sorted(ON_GPU_HOST.glob("*.json"))]


@pytest.mark.parametrize("path", GIL_RESULTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_committed_table_is_the_committed_json(path):
    rows = json.loads(path.read_text())["settings"]
    assert markdown_table(rows) in (path.parent / "README.md").read_text()


@pytest.mark.parametrize("path", [p for p in GIL_RESULTS if "update" not in p.name], ids=lambda p: p.name)
def test_the_committed_reading_holds_for_the_committed_rounds(path):
    """The READMEs' reading of the loop, checked against their JSON: streamed rounds all slower beside the thread,
    none of the other ranges excluding 1."""
    rows = json.loads(path.read_text())["settings"]
    for r in rows:
        assert r["thread_covered"] == r["process_covered"] == r["repeats"]
        assert r["process_x_min"] <= 1 <= r["process_x_max"]
        if r["streamed_requests"]:
            assert r["thread_x_min"] > 1
        else:
            assert r["thread_x_min"] <= 1 <= r["thread_x_max"]


def test_the_committed_reading_of_the_update_holds():
    """vLLM-format answers: every round slower beside the thread; SGLang-format: the range holds 1; beside the
    process both ranges hold 1 (results/reference/2026-11-26-h200-client-gil/README.md, *Reading*)."""
    path = ON_GPU_HOST / "client-gil-hf-update.json"
    rows = {r["format"]: r for r in json.loads(path.read_text())["settings"]}
    assert all(r["thread_covered"] == r["process_covered"] == r["repeats"] for r in rows.values())
    assert rows["vllm"]["thread_x_min"] > 1
    assert rows["sglang"]["thread_x_min"] <= 1 <= rows["sglang"]["thread_x_max"]
    assert all(r["process_x_min"] <= 1 <= r["process_x_max"] for r in rows.values())
    # "the medians above are smaller than both" overlapped / split update ratios of the placement study
    from hybridrl.report import figures

    study = "results/reference/2026-11-26-2xh200-placement"
    overlapped = [float(figures.evaluate(f"ratio {study} {a} {b} timing_s/update_actor").split("x")[0])
                  for a, b in (("sglang-overlap-df5dd4e9", "sglang-split-bf601ec8"),
                               ("vllm-overlap-9eca5c6f", "vllm-split-9aee0e98"))]
    assert max(r["thread_x"] for r in rows.values()) < min(overlapped)


def test_the_update_variant_times_a_real_trainers_update_beside_the_client(tmp_path, capsys):
    out = tmp_path / "update.json"
    cli.main(["client-gil", "--trainer", "hf", "--shape", "tiny", "--device", "cpu", "--workdir", str(tmp_path / "w"),
              "--format", "sglang", "--stream-fraction", "0.5", "--requests", "4", "--tokens", "200",
              "--event-interval", "0.01", "--repeats", "1", "--out", str(out)])
    [row] = json.loads(out.read_text())["settings"]
    assert row["work"] == "hf update" and row["shape"] == "tiny" and row["streamed_requests"] == 2
    assert row["alone_s"] > 0 and row["thread_covered"] == row["process_covered"] == 1
    assert "| sglang | 2/4 |" in capsys.readouterr().out
    assert (tmp_path / "w" / "hf" / "adapter-4").is_dir()  # warm-up, then one update per mode


@pytest.mark.parametrize("argv, message", [
    (["--trainer", "hf"], "--trainer needs --workdir"),
    (["--trainer", "hf", "--shape", "nope", "--workdir", "w"], "unknown shape 'nope'"),
])
def test_the_update_variant_refuses_missing_options_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["client-gil", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
