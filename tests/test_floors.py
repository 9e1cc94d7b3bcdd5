"""The floor table: floors computed from a known shape and bandwidth, a GPU with no entry, a run without a copy
bandwidth measurement, and the committed studies' tables."""

from pathlib import Path

import pandas as pd
import pytest

from hybridrl import gpu_specs
from hybridrl.report import figures, floor_model, floors
from hybridrl.report.aggregate import read_table
from hybridrl.run import copy_bandwidth

REPO = Path(__file__).resolve().parents[1]
TINY = {"vocab_size": 100, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "tie_word_embeddings": True}
MOE = {**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6}


def test_a_dense_decode_floor_is_its_bytes_over_the_bandwidth() -> None:
    shape = floor_model.shape_of(TINY)
    # per layer: q, o 2 x 8 x 8, k, v 2 x 8 x 4; MLP 3 x 8 x 16; one 100 x 8 matrix (tied)
    assert shape.weight_params == 2 * (128 + 64 + 384) + 800
    assert shape.kv_bytes_per_token(1) == 2 * 2 * 1 * 4 * 2
    hbm = 1e9
    gen = floor_model.gen_floor(shape, [3], [3], group_size=1, tp=1, hbm=hbm, peak=1e30)
    # two decode steps (the prefill gives the first token), each reading the weights and 3 + t tokens of KV
    want = sum(shape.weight_params * 2 + (3 + t) * 32 for t in (1, 2)) / hbm
    assert gen.decode_steps == 2 and gen.decode_s == pytest.approx(want)
    assert gen.prefill_s == pytest.approx(shape.weight_params * 2 / hbm)  # memory-bound: one read of the weights
    # at TP 2 a GPU reads half the weights, and its own KV head (one head cannot split)
    half = floor_model.gen_floor(shape, [3], [3], group_size=1, tp=2, hbm=hbm, peak=1e30)
    assert half.decode_s == pytest.approx(sum(shape.weight_params + (3 + t) * 32 for t in (1, 2)) / hbm)


def test_a_compute_bound_step_takes_its_flops_over_the_peak() -> None:
    shape = floor_model.shape_of(TINY)
    gen = floor_model.gen_floor(shape, [0], [2], group_size=1, tp=1, hbm=1e30, peak=1e6)
    context = 1  # one decode step, its query over its one generated token
    assert gen.decode_s == pytest.approx((2.0 * shape.active_params + 4 * 2 * 2 * 4 * context) / 1e6)


def test_a_moe_step_reads_the_experts_its_batch_routes_to() -> None:
    shape = floor_model.shape_of(MOE)
    assert shape.experts_read(1) == pytest.approx(2)  # one token: its top-k
    assert shape.experts_read(1000) == pytest.approx(4)  # a large batch: every expert
    assert shape.experts_read(2) == pytest.approx(4 * (1 - 0.5**2))
    one = shape.decode_params(1)
    assert shape.decode_params(1000) - one == pytest.approx(2 * 2 * 3 * 8 * 6)  # two more experts in two layers


def test_the_gpu_table_knows_the_leased_cards_and_nothing_else() -> None:
    assert gpu_specs.spec("NVIDIA H100 80GB HBM3").hbm_bytes_per_s == 3.35e12
    assert gpu_specs.spec("NVIDIA H200").hbm_bytes_per_s == 4.8e12
    assert gpu_specs.spec("NVIDIA A100-SXM4-80GB").peak_bf16_flops == 312e12
    assert gpu_specs.spec("NVIDIA H100 PCIe").hbm_bytes_per_s is None  # not entered: no decode floor
    assert gpu_specs.spec("NVIDIA GeForce RTX 4090") is None and gpu_specs.spec(None) is None


def _inputs(gpu: str | None, bandwidth: dict | None, **run) -> floors.RunInputs:
    config = {"tp": 1, "train_tp": 1, "train_gpus": 1, "group_size": 1, "engine": "vllm", "vllm_sleep_level": 1,
              "lora": {"rank": 2, "target_modules": ["q_proj"]}, **run}
    return floors.RunInputs("r", config, gpu, gpu_specs.spec(gpu), floor_model.shape_of(TINY), "test", bandwidth,
                            Path("/nonexistent"))


def test_a_gpu_without_an_entry_has_no_floor_and_says_which() -> None:
    row = pd.Series({"step": 1, "perf/update_flops": 1e12})
    floor = floors.phase_floor(_inputs("NVIDIA GeForce RTX 4090", None), "timing_s/update_actor", row)
    assert floor.seconds is None and "RTX 4090 is not in the GPU table" in floor.basis
    assert floors.phase_floor(_inputs(None, None), "timing_s/gen", row).basis == "no GPU"


def test_a_copy_floor_needs_the_measured_bandwidth() -> None:
    row = pd.Series({"step": 1})
    weights = floor_model.shape_of(TINY).weight_params * 2
    unmeasured = floors.phase_floor(_inputs("NVIDIA H200", None), "timing_s/wake", row)
    assert unmeasured.seconds is None and "not measured" in unmeasured.basis
    measured = _inputs("NVIDIA H200", {"h2d_gb_s": 20.0, "d2h_gb_s": 10.0})
    assert floors.phase_floor(measured, "timing_s/wake", row).seconds == pytest.approx(weights / 20e9)
    assert floors.phase_floor(measured, "timing_s/sleep", row).seconds == pytest.approx(weights / 10e9)
    # LoRA q_proj, rank 2: 2 layers x 2 x (8 + 8); offload moves its fp32 weights and AdamW's two moments
    lora = 2 * 2 * 16
    offload = floors.phase_floor(measured, "timing_s/trainer_offload", row)
    assert offload.seconds == pytest.approx(lora * 12 / 10e9)
    kv_only = _inputs("NVIDIA H200", {"h2d_gb_s": 20.0, "d2h_gb_s": 10.0}, engine="sglang", sglang_release="kv_cache")
    assert floors.phase_floor(kv_only, "timing_s/sleep", row).seconds == 0.0


def test_megatrons_ranks_share_the_updates_flops_and_each_loads_its_share_of_the_base() -> None:
    row = pd.Series({"step": 1, "perf/update_flops": 4e12})
    bw = {"h2d_gb_s": 20.0, "d2h_gb_s": 10.0}
    weights = floor_model.shape_of(TINY).weight_params * 2
    one = _inputs("NVIDIA H200", bw, trainer="megatron")
    ep2 = _inputs("NVIDIA H200", bw, trainer="megatron", train_ep=2)  # each GPU: half the experts, over its link
    update = [floors.phase_floor(x, "timing_s/update_actor", row) for x in (one, ep2)]
    assert update[1].seconds == pytest.approx(update[0].seconds / 2) and "× 2 GPU" in update[1].basis
    onload = [floors.phase_floor(x, "timing_s/trainer_onload", row) for x in (one, ep2)]
    lora = 2 * 2 * 16 * 12  # LoRA on attention is on every rank
    assert onload[0].seconds == pytest.approx((weights + lora) / 20e9)
    assert onload[1].seconds == pytest.approx((weights / 2 + lora) / 20e9) and "a GPU (of 2)" in onload[1].basis
    hf = _inputs("NVIDIA H200", bw, trainer="hf", train_ep=2)  # the HF trainer has no expert parallelism
    assert floors.phase_floor(hf, "timing_s/update_actor", row).seconds == pytest.approx(update[0].seconds)


def test_the_copy_bandwidth_is_not_measured_on_cpu() -> None:
    assert copy_bandwidth.measure("cpu") is None


def test_the_h100_study_floors_its_update_by_its_flops_and_leaves_its_copies_unmeasured() -> None:
    study = "results/reference/2026-11-28-h100-verdict"
    text = figures.evaluate(f"floors {study}")
    rows = [line.split(" | ") for line in text.strip().splitlines()[2:]]
    assert {r[1] for r in rows} >= {"rollout: prefill + decode", "update", "trainer onload", "engine sleep"}
    for r in rows:
        if r[1] in ("trainer onload", "trainer offload", "engine sleep", "engine wake", "adapter sync"):
            assert r[3] == "–" and "not measured" in r[5], r
        else:
            assert float(r[3]) > 0 and r[4].endswith("x"), r
    # the update's floor is its FLOPs over the peak: its ratio is about 1 / MFU
    df = read_table(REPO / study / "steps.csv")
    mfu = pd.to_numeric(df["perf/mfu"], errors="coerce").median()
    ratio = next(float(r[4].rstrip("x")) for r in rows if r[1] == "update" and r[0].startswith("| sglang"))
    assert ratio == pytest.approx(1 / mfu, rel=0.2)


def test_a_cpu_study_has_no_floor() -> None:
    text = figures.evaluate("floors results/reference/2026-11-28-cpu-smoke")
    rows = text.strip().splitlines()[2:]
    assert rows and all(r.endswith("| – | – | no GPU |") for r in rows)


def test_provenance_keeps_the_model_shape_and_the_measured_bandwidth() -> None:
    from hybridrl.run import provenance
    from hybridrl.study.run_config import RunConfig

    config = {**MOE, "architectures": ["Qwen3MoeForCausalLM"], "rope_theta": 1e6}
    data = provenance.collect(RunConfig(model="m"), None, None, config, {"h2d_gb_s": 25.0})
    assert data["model_shape"] == MOE  # the shape keys only, not the rest of config.json
    assert data["copy_bandwidth"] == {"h2d_gb_s": 25.0}
    assert provenance.collect(RunConfig(model="m"), None)["model_shape"] is None
