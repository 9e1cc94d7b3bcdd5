"""The trainer benchmark runs end to end on CPU for tiny models (functional: no figure is checked for speed)."""

import json
import math
import re
import statistics
from pathlib import Path

import pytest

from hybridrl.cli import main
from hybridrl.study.run_config import RunConfig
from hybridrl.trainers.base import Sample
from hybridrl.trainers.grpo import micro_batches


def test_trainer_bench_cli_reports_both_trainers_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = main(["trainer-bench", "--shape", "tiny", "--device", "cpu", "--updates", "2",
               "--workdir", str(tmp_path / "w"), "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    printed = capsys.readouterr()
    assert json.loads(printed.out) == rep  # stdout holds the JSON alone; the table goes to stderr
    assert "trainer-bench tiny" in printed.err and "export s" in printed.err
    for kind in ("hf", "megatron"):  # each trainer's row: its median update, as in the JSON
        row = next(line for line in printed.err.splitlines() if f" {kind} " in line)
        assert f"{statistics.median(rep[kind]['update_s_all']):.3f}" in row
    assert rep["device"] == "cpu" and rep["samples"] == 4
    # which host and code ran it: updates bound by launches vary with the host
    assert rep["host"]["cpu_count"] >= 1 and rep["host"]["boot_id"] and "commit" in rep["git"]
    for kind in ("hf", "megatron"):
        r = rep[kind]
        assert len(r["update_s_all"]) == 2
        assert r["update_s_best"] <= r["update_s_median"]
        assert r["compute_s_best"] <= r["update_s_best"]  # the adapter export is outside compute
        # each update splits into compute, the export and the rest, every part timed inside the update's own time
        assert len(r["compute_s_all"]) == len(r["save_s_all"]) == len(r["other_s_all"]) == 2
        assert all(s > 0 for s in r["save_s_all"]) and all(o >= 0 for o in r["other_s_all"])
        # the optimizer state is waited for after each update, outside its time
        assert len(r["state_s_all"]) == 2 and all(s >= 0 for s in r["state_s_all"])
        assert r["completion_tok_s_best"] > 0 and r["update_flops"] > 0
        assert r["mfu_median"] is None and r["peak_gb"] is None  # no GPU: no peak FLOP/s, no NVML
        assert r["experts_impl"] is None  # a dense model
        assert len(r["loadavg_1_5_15_before"]) == len(r["loadavg_1_5_15_after"]) == 3
    assert rep["megatron"]["moe_permute"] is None  # no MoE layer, no token permutation
    # the same batch, model and seed: both trainers take the same loss
    assert rep["hf"]["last_loss"] == pytest.approx(rep["megatron"]["last_loss"], abs=1e-4)


def test_trainer_bench_hf_moe_shape(tmp_path: Path) -> None:
    from hybridrl.tools.trainer_bench import main as bench

    rep = bench("tiny-moe", ["hf", "megatron"], 1, "cpu", tmp_path, None)
    assert math.isfinite(rep["hf"]["last_loss"])
    # both trainers ran the experts as grouped GEMMs, and on the same batch took the same loss
    assert rep["hf"]["experts_impl"] == rep["megatron"]["experts_impl"] == "grouped_mm"
    assert rep["hf"]["last_loss"] == pytest.approx(rep["megatron"]["last_loss"], abs=1e-4)
    assert rep["megatron"]["moe_permute"] == "gathers" and rep["megatron_permute"] is False


def test_trainer_bench_vocab_builds_a_model_of_its_own_with_that_many_rows(tmp_path: Path) -> None:
    import json

    from hybridrl.tools.trainer_bench import main as bench

    rep = bench("tiny", ["hf"], 1, "cpu", tmp_path, None, vocab=300)
    assert rep["vocab"] == 300 and math.isfinite(rep["hf"]["last_loss"])
    assert json.loads((tmp_path / "model-tiny-v300" / "config.json").read_text())["vocab_size"] == 300
    # the output head's FLOPs grow with it: the same batch shape, more work per token than at the shape's own 64
    base = bench("tiny", ["hf"], 1, "cpu", tmp_path, None)
    assert base["vocab"] == 64 and (tmp_path / "model-tiny" / "config.json").exists()
    assert rep["hf"]["update_flops"] > base["hf"]["update_flops"]


def test_chunked_head_runs_both_trainers_to_the_full_logits_loss(tmp_path: Path) -> None:
    from hybridrl.tools.trainer_bench import main as bench

    full = bench("tiny", ["hf", "megatron"], 1, "cpu", tmp_path, None)
    out = tmp_path / "chunked.json"
    assert main(["trainer-bench", "--shape", "tiny", "--device", "cpu", "--updates", "1", "--chunked-head",
                 "--workdir", str(tmp_path), "--out", str(out)]) == 0
    chunked = json.loads(out.read_text())
    assert chunked["chunked_head"] is True and full["chunked_head"] is False
    for kind in ("hf", "megatron"):  # what each trainer ran, as its update reported it
        assert chunked[kind]["chunked_head"] is True and full[kind]["chunked_head"] is False
        assert full[kind]["last_loss"] == pytest.approx(chunked[kind]["last_loss"], abs=1e-6)


def test_trainer_bench_megatron_permute_is_the_same_update_through_megatrons_dispatcher(tmp_path: Path) -> None:
    from hybridrl.tools.trainer_bench import main as bench

    ours = bench("tiny-moe", ["megatron"], 2, "cpu", tmp_path, None)
    theirs = bench("tiny-moe", ["megatron"], 2, "cpu", tmp_path, None, megatron_permute=True)
    assert theirs["megatron_permute"] is True and theirs["megatron"]["moe_permute"] == "megatron"
    assert ours["megatron"]["moe_permute"] == "gathers"
    # the same routing and the same sums in another order: two updates later the same loss
    assert theirs["megatron"]["last_loss"] == pytest.approx(ours["megatron"]["last_loss"], abs=1e-5)


@pytest.mark.slow
def test_trainer_bench_ep_shards_the_megatron_update_over_that_many_ranks(tmp_path: Path) -> None:
    from hybridrl.tools.trainer_bench import main as bench

    one = bench("tiny-moe", ["megatron"], 1, "cpu", tmp_path, None)
    two = bench("tiny-moe", ["megatron"], 1, "cpu", tmp_path, None, ep=2)
    assert (one["train_ep"], one["megatron"]["ranks"]) == (1, 1)
    assert (two["train_ep"], two["megatron"]["ranks"]) == (2, 2)  # two worker processes, half the experts each
    assert two["megatron"]["completion_tok_s_per_gpu_median"] == pytest.approx(
        two["megatron"]["completion_tok_s_median"] / 2)
    # the same update, the experts' sums split over two ranks
    assert two["megatron"]["last_loss"] == pytest.approx(one["megatron"]["last_loss"], abs=1e-5)
    # each rank keeping every token's rows and masking the other's: the same update again
    masked = bench("tiny-moe", ["megatron"], 1, "cpu", tmp_path, None, ep=2, ep_dispatch="masked")
    assert (masked["train_ep"], masked["ep_dispatch"], two["ep_dispatch"]) == (2, "masked", "host_read")
    assert masked["megatron"]["last_loss"] == pytest.approx(one["megatron"]["last_loss"], abs=1e-5)
    # each rank running half the batch, the MoE layers exchanging tokens: the same update once more
    split = bench("tiny-moe", ["megatron"], 1, "cpu", tmp_path, None, ep=2, ep_batch="split")
    assert (split["ep_batch"], two["ep_batch"]) == ("split", "replicated")
    assert split["megatron"]["last_loss"] == pytest.approx(one["megatron"]["last_loss"], abs=1e-5)


@pytest.mark.slow
def test_trainer_bench_profiles_one_more_update_in_every_megatron_worker(tmp_path: Path) -> None:
    from hybridrl.tools.trainer_bench import main as bench

    out = tmp_path / "bench" / "trainer-tiny-moe.json"
    report = bench("tiny-moe", ["megatron"], 2, "cpu", tmp_path / "w", out, ep=2, ep_batch="split", profile=True)
    tables = ["trainer-tiny-moe.profile-rank0.txt", "trainer-tiny-moe.profile-rank1.txt"]
    assert report["megatron"]["profile"] == tables
    assert len(report["megatron"]["update_s_all"]) == 2  # the profiled update is none of the timed ones
    for rank, name in enumerate(tables):
        text = (out.parent / name).read_text()
        assert text.startswith(f"megatron update (step 4), rank {rank} of 2, tp 1, ep 2, ")
        assert "wall " in text and "Self CPU" in text and "the same, by input shapes:" in text
    plain = bench("tiny-moe", ["megatron"], 1, "cpu", tmp_path / "w", tmp_path / "plain.json")
    assert plain["megatron"]["profile"] is None and not list(tmp_path.glob("plain.profile*"))
    assert plain["megatron"]["profile_error"] is None


def test_a_profile_that_fails_leaves_the_timed_figures_and_says_why(tmp_path: Path) -> None:
    from hybridrl.tools.trainer_bench import bench_run, bench_trainer, fixed_batch, shape_model, shape_of

    shape = shape_of("tiny-moe")
    model = shape_model(tmp_path / "w", "tiny-moe", shape, "cpu")
    batch = fixed_batch(shape.config["vocab_size"], 4, shape.prompt, shape.completion)
    (tmp_path / "a-file").write_text("not a folder")  # the workers cannot write their tables under it
    got = bench_trainer("megatron", model, bench_run(shape, "megatron", "cpu", 4, None), batch, 1, tmp_path / "w",
                        profile_to=tmp_path / "a-file" / "p")
    assert len(got["update_s_all"]) == 1 and got["profile"] == []
    assert re.match(r"megatron worker failed during job \d+ \(step\): .*a-file", got["profile_error"])


def _s(n: int) -> Sample:
    return Sample(prompt_ids=[1] * 2, completion_ids=[1] * (n - 2), engine_logprobs=[0.0] * (n - 2), advantage=0.0)


def test_micro_batches_by_tokens_keep_the_padded_size_within_the_budget() -> None:
    samples = [_s(n) for n in (4, 4, 6, 10, 3, 3)]
    run = RunConfig(model="m", micro_batch_tokens=12, pack_sequences=False)
    got = [[len(s.prompt_ids) + len(s.completion_ids) for s in mb] for mb in micro_batches(samples, run)]
    assert got == [[4, 4], [6], [10], [3, 3]]  # 3 x 6 = 18 > 12; a 10 alone; 2 x 3 fits
    assert sum(got, []) == [4, 4, 6, 10, 3, 3]  # the order is kept
    by_count = micro_batches(samples, RunConfig(model="m", micro_batch=4))
    assert [len(mb) for mb in by_count] == [4, 2]


def test_a_sample_longer_than_the_budget_gets_a_micro_batch_of_its_own() -> None:
    for pack in (True, False):
        run = RunConfig(model="m", micro_batch_tokens=5, pack_sequences=pack)
        assert [len(mb) for mb in micro_batches([_s(9), _s(3), _s(9)], run)] == [1, 1, 1]


def test_trainer_bench_packs_by_default_and_pads_with_no_pack(tmp_path: Path) -> None:
    from hybridrl.tools.trainer_bench import main as bench

    packed = bench("tiny", ["hf"], 1, "cpu", tmp_path, None, varied=True)
    padded = bench("tiny", ["hf"], 1, "cpu", tmp_path, None, varied=True, pack=False)
    assert packed["pack_sequences"] is True and padded["pack_sequences"] is False
    assert packed["lengths"] == "varied" and packed["completion_tokens"] == padded["completion_tokens"]
    # the same samples and weights: packing changes the layout, not the update
    assert packed["hf"]["last_loss"] == pytest.approx(padded["hf"]["last_loss"], abs=1e-5)


def test_trainer_bench_peft_lora_is_the_same_update_through_peft_forward(tmp_path: Path) -> None:
    from hybridrl.tools.trainer_bench import main as bench

    fused = bench("tiny", ["hf"], 1, "cpu", tmp_path, None)
    plain = bench("tiny", ["hf"], 1, "cpu", tmp_path, None, peft_lora=True)
    assert fused["peft_lora"] is False and plain["peft_lora"] is True
    assert plain["hf"]["last_loss"] == pytest.approx(fused["hf"]["last_loss"], abs=1e-5)
    from peft.tuners.lora import Linear as LoraLinear

    from hybridrl.tools.trainer_bench import SHAPES, bench_run, random_model
    from hybridrl.trainers.hf import HFTrainer

    model = random_model(tmp_path / "model-tiny", SHAPES["tiny"], "float32")
    run = bench_run(SHAPES["tiny"], "hf", "cpu", 4, None)
    for fuse in (True, False):  # the fused forward is set on each adapted linear, or PEFT's class forward kept
        layers = [m for m in HFTrainer(model, run, fuse_lora=fuse).model.modules() if isinstance(m, LoraLinear)]
        assert layers and all(("forward" in m.__dict__) is fuse for m in layers)


@pytest.mark.parametrize("trainer", ["hf", "megatron"])
def test_trainer_profile_writes_the_operator_table(trainer: str, tmp_path: Path) -> None:
    out = tmp_path / "profile.txt"
    rc = main(["trainer-profile", "--shape", "tiny", "--trainer", trainer, "--device", "cpu",
               "--workdir", str(tmp_path / "w"), "--out", str(out)])
    assert rc == 0
    text = out.read_text()
    assert text.startswith(f"trainer-profile tiny {trainer} micro_batch 8 pack True lengths fixed device cpu")
    assert "Self CPU" in text and "aten::mm" in text


@pytest.mark.parametrize("trainer", ["hf", "megatron"])
def test_trainer_profile_export_times_the_exports_parts(trainer: str, tmp_path: Path) -> None:
    from hybridrl.tools.trainer_profile import main as profile

    text = profile("tiny", trainer, "cpu", tmp_path / "w", tmp_path / "p.txt", export=True)
    assert ": profiled update " in text.splitlines()[0] and " with its export" in text.splitlines()[0]
    ranges = text[text.index("labelled ranges (host time):"):].splitlines()[2:]
    calls = {r.split()[0]: int(r.split()[1]) for r in ranges}
    # one update, one export: the weights and the optimizer's state to the host (HF: one copy for the state dict's
    # tensors; Megatron: one for each AdamW moment), the engine's files written, the B norm
    to_host = 3 if trainer == "megatron" else 2
    assert calls == {"hybridrl.update": 1, "hybridrl.export": 1, "export.to_host": to_host, "export.write": 1,
                     "export.norm": 1}
    assert (tmp_path / "w" / f"export-{trainer}" / "adapter-3" / "optimizer.pt").exists()  # after the 2 warm-ups
    without = profile("tiny", trainer, "cpu", tmp_path / "w", tmp_path / "q.txt")
    assert "labelled ranges" not in without


def test_the_host_waits_table_names_the_lines_most_frequent_first() -> None:
    from collections import Counter

    from hybridrl.tools.trainer_profile import waits_table

    text = waits_table(Counter({"grpo.py:120": 2, "rl.py:7": 9}))
    first, *rows = text.splitlines()
    assert first.startswith("host waits for the GPU in one update: 11 ")
    assert [r.split() for r in rows] == [["9", "rl.py:7"], ["2", "grpo.py:120"]]
    assert waits_table(Counter()).startswith("host waits for the GPU in one update: 0 ")


def test_trainer_profile_megatron_permute_brings_back_megatrons_scatters(tmp_path: Path) -> None:
    from hybridrl.tools.trainer_profile import main as profile

    ours = profile("tiny-moe", "megatron", "cpu", tmp_path / "w", tmp_path / "a.txt", rows=400)
    theirs = profile("tiny-moe", "megatron", "cpu", tmp_path / "w", tmp_path / "b.txt", rows=400,
                     megatron_permute=True)
    assert "device cpu megatron-permute:" in theirs.splitlines()[0]

    def calls(text: str, op: str) -> int:  # the '# of Calls' column of the op's row in the first table
        return next((int(line.split()[-1]) for line in text.splitlines() if line.split()[:1] == [op]), 0)

    for op in ("aten::scatter_add_", "aten::index_add_"):  # unpermute, and permute's backward
        assert calls(theirs, op) > calls(ours, op), op


def test_a_checkpoint_write_that_fails_leaves_nothing_to_reuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from hybridrl.tools import trainer_bench

    real = transformers.PreTrainedModel.save_pretrained

    def disk_full(self, path, *a, **k):  # config.json is written, then the weights fail
        self.config.save_pretrained(path)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", disk_full)
    target = tmp_path / "model-tiny"
    with pytest.raises(OSError, match="No space left"):
        trainer_bench.random_model(target, trainer_bench.SHAPES["tiny"], "float32")
    assert not target.exists() and not list(tmp_path.iterdir())  # no half checkpoint, no temp dir left
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", real)
    trainer_bench.random_model(target, trainer_bench.SHAPES["tiny"], "float32")
    assert (target / "config.json").exists() and list(target.glob("*.safetensors"))


def test_an_isolated_build_runs_in_a_child_process_and_names_its_failure(tmp_path: Path) -> None:
    from hybridrl.tools import trainer_bench

    shape = trainer_bench.SHAPES["tiny"]
    built = trainer_bench.random_model(tmp_path / "m", shape, "float32", isolate=True)
    assert (built / "config.json").exists() and list(built.glob("*.safetensors"))
    # a dtype torch lacks fails inside the child: one message with its exit code, and no checkpoint
    with pytest.raises(RuntimeError, match=r"failed in its own process \(exit code 1"):
        trainer_bench.random_model(tmp_path / "bad", shape, "float99", isolate=True)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("argv,said", [
    (["trainer-bench", "--shape", "nope"], "hybridrl trainer-bench: unknown shape 'nope' (known: qwen3-0.6b"),
    (["trainer-profile", "--shape", "nope", "--trainer", "hf", "--out", "p.txt"], "unknown shape 'nope'"),
    (["trainer-bench", "--shape", "tiny", "--updates", "0"], "argument --updates: must be at least 1, got 0"),
    (["trainer-bench", "--shape", "tiny", "--micro-batch", "x"], "argument --micro-batch: 'x' is not a whole"),
    (["trainer-bench", "--shape", "tiny", "--peft-lora"], "--peft-lora changes the hf trainer only"),
    (["trainer-bench", "--shape", "tiny", "--megatron-permute"], "--megatron-permute changes the megatron trainer"),
    (["trainer-profile", "--shape", "tiny-moe", "--trainer", "hf", "--megatron-permute", "--out", "p.txt"],
     "--megatron-permute changes the megatron trainer only"),
    (["trainer-bench", "--shape", "tiny", "--trainer", "megatron", "--megatron-permute"],
     "--megatron-permute changes MoE layers only, and tiny has none (MoE shapes: qwen3-30b-a3b, tiny-moe)"),
    (["trainer-profile", "--shape", "qwen3-0.6b", "--trainer", "megatron", "--megatron-permute", "--out", "p.txt"],
     "and qwen3-0.6b has none"),
    (["trainer-bench", "--shape", "tiny", "--vocab", "2"], "hybridrl trainer-bench: --vocab must be at least 3, got 2"),
    (["trainer-bench", "--shape", "tiny-moe", "--ep", "2"], "--ep shards the megatron trainer only"),
    (["trainer-bench", "--shape", "tiny", "--trainer", "megatron", "--ep", "2"],
     "--ep splits the experts of a MoE shape, and tiny has none"),
    (["trainer-bench", "--shape", "tiny-moe", "--trainer", "megatron", "--ep", "3"],
     "--ep 3 does not divide tiny-moe's 4 experts"),
    (["trainer-bench", "--shape", "tiny-moe", "--trainer", "megatron", "--ep-dispatch", "masked"],
     "--ep-dispatch masked changes how hybridrl's gathers pick an expert-parallel rank's rows: give --ep 2"),
    (["trainer-bench", "--shape", "tiny-moe", "--trainer", "megatron", "--ep", "2", "--megatron-permute",
      "--ep-dispatch", "masked"], "without --megatron-permute"),
    (["trainer-bench", "--shape", "tiny-moe", "--ep-dispatch", "none"], "argument --ep-dispatch: invalid choice"),
    (["trainer-bench", "--shape", "tiny-moe", "--trainer", "megatron", "--ep-batch", "split"],
     "--ep-batch split splits the batch over expert-parallel ranks: give --ep 2 or more"),
    (["trainer-bench", "--shape", "tiny", "--profile"],
     "--profile profiles an update in the megatron trainer's workers: give --trainer megatron"),
])
def test_trainer_tools_refuse_bad_arguments_in_one_line(argv: list[str], said: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--workdir", str(tmp_path / "w")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    assert not (tmp_path / "w").exists()  # refused before anything was built


@pytest.mark.parametrize("command", ["trainer-bench", "trainer-profile"])
def test_a_gpu_asked_for_where_there_is_none_is_one_line_before_any_build(tmp_path, capsys, command):
    import torch

    from hybridrl import cli

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    extra = ["--out", str(tmp_path / "p.txt"), "--trainer", "hf"] if command == "trainer-profile" else []
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--shape", "tiny", "--device", "cuda", "--workdir", str(tmp_path / "w"), *extra])
    assert stop.value.code == 2
    said = f"hybridrl {command}: --device cuda: torch {torch.__version__} sees no CUDA GPU on this machine\n"
    assert capsys.readouterr().err == said
    assert not (tmp_path / "w").exists()  # refused before any model was built
