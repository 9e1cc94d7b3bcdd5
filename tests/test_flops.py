"""The FLOP count behind perf/mfu, on known shapes."""

import math

import pytest

from hybridrl.trainers.flops import flop_shape, peak_flops, perf_metrics, update_flops

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936)
QWEN3_30B_A3B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, vocab_size=151936, decoder_sparse_step=1, mlp_only_layers=[])


def test_dense_active_parameters_by_hand():
    s = flop_shape(QWEN3_06B)
    attn = 1024 * (16 * 128) * 2 + 1024 * (8 * 128) * 2
    mlp = 3 * 1024 * 3072
    assert s.active_params == 28 * (attn + mlp) + 151936 * 1024
    # Qwen3-0.6B: 0.44 B non-embedding parameters (norms aside) plus the 0.16 B output head
    assert s.active_params == pytest.approx(0.596e9, rel=0.01)


def test_moe_counts_the_routed_top_k_experts_and_the_router_only():
    s = flop_shape(QWEN3_30B_A3B)
    attn = 2048 * 4096 * 2 + 2048 * 512 * 2
    moe = 3 * 2048 * 768 * 8 + 2048 * 128
    assert s.active_params == 48 * (attn + moe) + 151936 * 2048
    # "A3B": about 3.3 B active with the input embedding, which the count leaves out (no matmul)
    assert s.active_params + 151936 * 2048 == pytest.approx(3.35e9, rel=0.02)


def test_dense_layers_of_a_moe_model_count_their_full_mlp():
    cfg = {**QWEN3_30B_A3B, "num_hidden_layers": 2, "mlp_only_layers": [0]}
    s = flop_shape(cfg)
    assert s.mlp_params_per_layer == (3 * 2048 * 6144, 3 * 2048 * 768 * 8 + 2048 * 128)


def test_update_flops_are_three_forward_passes_plus_causal_attention():
    s = flop_shape(QWEN3_06B)
    lens = [384] * 4
    fwd = 2 * s.active_params * 1536 + 2 * 28 * 16 * 128 * 4 * 384 ** 2
    assert update_flops(s, lens) == pytest.approx(3 * fwd)
    assert update_flops(s, lens, kl=True) == pytest.approx(4 * fwd)


def test_peak_table_and_mfu():
    assert peak_flops("NVIDIA H200") == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756.0e12
    assert peak_flops(None) is None and peak_flops("cpu") is None
    m = perf_metrics(989.4e12, 1000, 2.0, 2, "NVIDIA H200")
    assert m["perf/mfu"] == pytest.approx(0.25)
    assert m["perf/train_tok_s"] == 500 and m["perf/train_tok_s_per_gpu"] == 250
    assert math.isnan(perf_metrics(1e12, 10, 1.0, 1, None)["perf/mfu"])  # the record holds null
