"""HF <-> Megatron weight layout and the Megatron trainer's input checks (no process group needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrl.tools.megatron_parity import ARCHS, tiny_checkpoint
from hybridrl.trainers.megatron import mapping
from hybridrl.trainers.megatron.spec import (
    MegatronSetupError,
    check_parallel,
    effective_targets,
    read_spec,
)

SRC = Path(__file__).resolve().parents[1] / "src"
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class DictSource(dict):
    def get(self, name: str) -> torch.Tensor:  # type: ignore[override]
        return self[name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {a: tiny_checkpoint(a, root / a) for a in ARCHS}


def _hf_state(model_dir: Path) -> DictSource:
    from safetensors.torch import load_file

    return DictSource(load_file(str(model_dir / "model.safetensors")))


def test_qkv_layout_is_per_query_group() -> None:
    # 4 query heads, 2 groups, head dim 1: rows named by value
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = mapping.qkv_to_megatron(q, k, v, num_heads=4, num_groups=2)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    # TP=2: each rank holds whole groups
    assert mapping.qkv_to_megatron(q, k, v, 4, 2, tp_size=2, tp_rank=1).flatten().tolist() == [12, 13, 21, 31]


@pytest.mark.parametrize("heads,groups,tp", [(4, 2, 1), (4, 2, 2), (8, 8, 4), (8, 1, 1)])
def test_qkv_round_trip(heads: int, groups: int, tp: int) -> None:
    d, hidden = 3, 5
    q, k, v = torch.randn(heads * d, hidden), torch.randn(groups * d, hidden), torch.randn(groups * d, hidden)
    shards = [mapping.qkv_to_megatron(q, k, v, heads, groups, tp, r) for r in range(tp)]
    q2, k2, v2 = mapping.qkv_from_megatron(shards, heads, groups, d)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    # biases (1-D) go through the same path
    qb, kb, vb = torch.randn(heads * d), torch.randn(groups * d), torch.randn(groups * d)
    shards = [mapping.qkv_to_megatron(qb, kb, vb, heads, groups, tp, r) for r in range(tp)]
    assert all(torch.equal(a, b) for a, b in zip((qb, kb, vb), mapping.qkv_from_megatron(shards, heads, groups, d),
                                                  strict=True))


def test_gate_up_interleaved_per_tp_rank() -> None:
    gate = torch.arange(4.0).unsqueeze(1)  # rows 0..3
    up = torch.arange(10.0, 14.0).unsqueeze(1)
    shards = [mapping.gate_up_to_megatron(gate, up, 2, r) for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 10, 11]
    assert shards[1].flatten().tolist() == [2, 3, 12, 13]
    g, u = mapping.gate_up_from_megatron(shards)
    assert torch.equal(g, gate) and torch.equal(u, up)


def test_vocab_and_row_sharding(checkpoints: dict[str, Path]) -> None:
    d = checkpoints["llama"]
    spec, src = read_spec(d), _hf_state(d)
    shards = [mapping.hf_to_megatron(spec, src, r, 2) for r in range(2)]
    emb = src["model.embed_tokens.weight"]
    assert torch.equal(shards[1]["embedding.word_embeddings.weight"], emb[64:])
    assert torch.equal(shards[0]["output_layer.weight"], src["lm_head.weight"][:64])
    o = src["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(shards[1]["decoder.layers.0.self_attention.linear_proj.weight"], o[:, 32:])
    with pytest.raises(ValueError, match="does not split"):
        mapping.shard(emb, 0, 3, 0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [1, 2])
def test_full_mapping_round_trip(checkpoints: dict[str, Path], arch: str, tp: int) -> None:
    spec, src = read_spec(checkpoints[arch]), _hf_state(checkpoints[arch])
    shards = [mapping.hf_to_megatron(spec, src, r, tp) for r in range(tp)]
    back = mapping.megatron_to_hf(spec, shards)
    assert set(back) == set(src), set(back) ^ set(src)
    for k, t in src.items():
        assert torch.equal(back[k], t), k


def test_moe_fused_expert_tensors(checkpoints: dict[str, Path]) -> None:
    """transformers 5.x stores Qwen3-MoE experts as 3-D gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""
    d = checkpoints["qwen3_moe"]
    spec, src = read_spec(d), _hf_state(d)
    fused = DictSource({k: v for k, v in src.items() if ".mlp.experts." not in k})
    for i in range(spec.num_layers):
        if not spec.layer_is_moe(i):
            continue
        p = f"model.layers.{i}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([
            torch.cat([src[f"{p}.{e}.gate_proj.weight"], src[f"{p}.{e}.up_proj.weight"]])
            for e in range(spec.num_experts)])
        fused[f"{p}.down_proj"] = torch.stack([src[f"{p}.{e}.down_proj.weight"] for e in range(spec.num_experts)])
    a, b = mapping.hf_to_megatron(spec, src), mapping.hf_to_megatron(spec, fused)
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert spec.moe_layers == (True, False)  # mlp_only_layers=[1]
    assert a["decoder.layers.0.mlp.experts.fc1_weight"].shape == (4, 2 * 32, 64)  # stacked for GroupedExperts
    assert "decoder.layers.1.mlp.linear_fc1.weight" in a


def test_peft_key_names_match_peft(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors import safe_open

    from hybridrl.tools.megatron_parity import default_run, random_adapter

    random_adapter(checkpoints["llama"], tmp_path / "ad", default_run())
    with safe_open(str(tmp_path / "ad" / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    ours = {mapping.peft_key(layer, proj, w) for layer in range(2) for proj in ALL_TARGETS for w in "AB"}
    assert ours == keys


def test_spec_reads_configs(checkpoints: dict[str, Path]) -> None:
    q3 = read_spec(checkpoints["qwen3"])
    assert (q3.head_dim, q3.qk_norm, q3.tie_embeddings, q3.qkv_bias) == (24, True, True, False)
    assert read_spec(checkpoints["qwen2"]).qkv_bias
    moe = read_spec(checkpoints["qwen3_moe"])
    assert (moe.num_experts, moe.moe_topk, moe.moe_ffn_hidden_size) == (4, 2, 32)
    assert effective_targets(moe, ALL_TARGETS) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert effective_targets(q3, ALL_TARGETS) == ALL_TARGETS


# -- bad input: one clear message each --------------------------------------------------------------------
def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(MegatronSetupError, match=r"model_type 'gpt2' \(GPT2LMHeadModel\) is not supported.*llama"):
        read_spec(tmp_path)
    with pytest.raises(MegatronSetupError, match="no config.json"):
        read_spec(tmp_path / "nowhere")


def test_tp_must_divide_heads_and_vocab(checkpoints: dict[str, Path]) -> None:
    spec = read_spec(checkpoints["llama"])
    with pytest.raises(MegatronSetupError, match="train_tp=3 does not divide num_attention_heads=4"):
        check_parallel(spec, 3, 6, ALL_TARGETS)
    odd_vocab = dataclasses.replace(spec, vocab_size=129)
    with pytest.raises(MegatronSetupError, match="train_tp=2 does not divide vocab_size=129"):
        check_parallel(odd_vocab, 2, 4, ALL_TARGETS)


def test_lora_rank_divisible_by_tp(checkpoints: dict[str, Path]) -> None:
    spec = read_spec(checkpoints["llama"])
    with pytest.raises(MegatronSetupError, match="lora.rank=3 is not divisible by train_tp=2"):
        check_parallel(spec, 2, 3, ALL_TARGETS)
    with pytest.raises(MegatronSetupError, match="adapts only"):
        check_parallel(spec, 1, 4, ["c_attn"])


def test_moe_needs_tp1(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(MegatronSetupError, match="train_tp=1 only"):
        check_parallel(read_spec(checkpoints["qwen3_moe"]), 2, 4, ALL_TARGETS)


def test_expert_parallel_splits_experts_only_of_moe_models(checkpoints: dict[str, Path]) -> None:
    check_parallel(read_spec(checkpoints["qwen3_moe"]), 1, 4, ALL_TARGETS, ep=2)  # 4 experts over 2 ranks
    with pytest.raises(MegatronSetupError, match="train_ep=3 does not divide num_experts=4"):
        check_parallel(read_spec(checkpoints["qwen3_moe"]), 1, 4, ALL_TARGETS, ep=3)
    with pytest.raises(MegatronSetupError, match="train_ep=2: .* llama has none"):
        check_parallel(read_spec(checkpoints["llama"]), 1, 4, ALL_TARGETS, ep=2)


def test_expert_parallel_ranks_load_their_own_contiguous_experts(checkpoints: dict[str, Path]) -> None:
    """EP rank r holds experts r*E/ep .. (r+1)*E/ep - 1 of every MoE layer (megatron's local_expert_indices), and
    the same replica of every other tensor."""
    spec, src = read_spec(checkpoints["qwen3_moe"]), _hf_state(checkpoints["qwen3_moe"])
    whole = mapping.hf_to_megatron(spec, src)
    ranks = [mapping.hf_to_megatron(spec, src, ep_rank=r, ep_size=2) for r in range(2)]
    for name, full in whole.items():
        if ".mlp.experts." in name:
            assert [tuple(r[name].shape)[0] for r in ranks] == [2, 2], name
            assert torch.equal(torch.cat([r[name] for r in ranks]), full), name
            assert not torch.equal(ranks[0][name], ranks[1][name]), name
        else:
            assert all(torch.equal(r[name], full) for r in ranks), name
    assert list(mapping.local_experts(128, 1, 2)) == list(range(64, 128))


def test_trainer_rejects_bad_input_before_starting(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from hybridrl.tools.megatron_parity import default_run
    from hybridrl.trainers.megatron import MegatronTrainer

    lora = default_run().lora.model_dump()
    with pytest.raises(MegatronSetupError, match="not divisible by train_tp"):
        MegatronTrainer(checkpoints["llama"], default_run(2, lora={**lora, "rank": 3}), tmp_path)
    with pytest.raises(MegatronSetupError, match="dropout must be 0"):
        MegatronTrainer(checkpoints["llama"], default_run(1, lora={**lora, "dropout": 0.1}), tmp_path)
    with pytest.raises(MegatronSetupError, match="train_ep=2: expert parallelism"):
        MegatronTrainer(checkpoints["llama"], default_run(1, 2), tmp_path)
    assert not (tmp_path / "megatron").exists()  # nothing started, nothing written


def test_worker_without_torchrun_env(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                              "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(SRC)
    res = subprocess.run([sys.executable, "-m", "hybridrl.trainers.megatron.worker", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set" in res.stderr
    assert "torchrun" in res.stderr
