"""write_checkpoint writes what save_pretrained writes (tensors, safetensors metadata, index, config files), byte
for byte, in shards written at once by several threads; transformers loads it back to the same model."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from hybridrl.study import checkpoint_write, models
from hybridrl.study.checkpoint_write import write_checkpoint
from hybridrl.task import data

SMALL_GB = 2e-5  # 20 kB: the tiny models below then take 3 (dense) to 8 (MoE) shards
SHAPE = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64}


def _model(arch: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A tiny random model as build_random makes one: a Qwen3-MoE whose experts transformers 5 fuses in memory
    (and not on disk) with its own lm_head, or a dense Qwen3 whose lm_head is the embedding (not on disk)."""
    import transformers

    if arch == "moe":
        config = transformers.Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                             tie_word_embeddings=False)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = [1, 2]  # as build_random sets them
    model.generation_config.pad_token_id = 3
    return model


def _tensors(path: Path) -> tuple[dict[str, str] | None, dict[str, torch.Tensor]]:
    with safe_open(path, framework="pt") as f:
        return f.metadata(), {name: f.get_tensor(name) for name in f.keys()}


def _expected_names(model: Any) -> set[str]:
    """The names on disk, spelt out independently of transformers: one tensor per expert and projection."""
    cfg = model.config
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        layer = f"model.layers.{i}"
        names |= {f"{layer}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
        names |= {f"{layer}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        projections = {f"{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        if getattr(cfg, "num_experts", None):
            names.add(f"{layer}.mlp.gate.weight")
            names |= {f"{layer}.mlp.experts.{e}.{p}" for e in range(cfg.num_experts) for p in projections}
        else:
            names |= {f"{layer}.mlp.{p}" for p in projections}
    return names


@pytest.mark.parametrize("shard_gb", [SMALL_GB, checkpoint_write.SHARD_GB], ids=["sharded", "one-file"])
@pytest.mark.parametrize("arch", ["moe", "dense"])
def test_the_files_are_those_save_pretrained_writes(arch: str, shard_gb: float, tmp_path: Path) -> None:
    model = _model(arch)  # each its own: save_pretrained also sets the config's dtype and architectures
    write_checkpoint(model, tmp_path / "ours", shard_gb=shard_gb, workers=4)
    _model(arch).save_pretrained(tmp_path / "theirs", max_shard_size=int(shard_gb * 10**9))
    theirs, ours = (sorted(p.name for p in (tmp_path / side).iterdir()) for side in ("theirs", "ours"))
    assert ours == theirs
    shards = [name for name in ours if name.endswith(".safetensors")]
    assert (len(shards) > 2) == (shard_gb == SMALL_GB)
    names: set[str] = set()
    for name in shards:
        (meta, mine), (their_meta, their) = _tensors(tmp_path / "ours" / name), _tensors(tmp_path / "theirs" / name)
        assert meta == their_meta == {"format": "pt"}
        assert mine.keys() == their.keys(), name
        for key, tensor in mine.items():
            assert tensor.dtype == their[key].dtype == torch.bfloat16 and tensor.shape == their[key].shape, key
            assert torch.equal(tensor, their[key]), key
        names |= mine.keys()
    assert names == _expected_names(model)  # experts one by one, a tied lm_head left out
    for name in ours:  # index (total_size, weight_map), config.json, generation_config.json; and the shards
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name
    if shard_gb == SMALL_GB:
        index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == names and set(index["weight_map"].values()) == set(shards)
        on_disk = {k: t for k, t in model.state_dict().items() if k != "lm_head.weight" or arch == "moe"}
        assert index["metadata"]["total_size"] == sum(2 * t.numel() for t in on_disk.values())


@pytest.mark.parametrize("arch", ["moe", "dense"])
def test_the_checkpoint_loads_back_to_the_same_model(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    # float32: .to(bfloat16) would also cast the rotary embedding's inv_freq, a buffer that is not in the file,
    # and the model loaded back (inv_freq float32) would differ from the source by that, not by its weights
    model = _model(arch, torch.float32)
    write_checkpoint(model, tmp_path, shard_gb=SMALL_GB / 2, workers=3)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    assert type(loaded) is type(model)
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)


def test_shards_are_written_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first two shards' writes wait for each other: written one after the other, the barrier breaks."""
    from safetensors import torch as safetensors_torch

    real = safetensors_torch.save_file
    barrier, calls, lock = threading.Barrier(2, timeout=10), [], threading.Lock()

    def meeting(tensors: dict[str, torch.Tensor], filename: Path, metadata: dict[str, str]) -> None:
        with lock:
            calls.append(threading.current_thread().name)
        if len(calls) <= 2:
            barrier.wait()
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors_torch, "save_file", meeting)
    write_checkpoint(_model("moe"), tmp_path, shard_gb=SMALL_GB, workers=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(calls) == len(set(index["weight_map"].values())) > 3
    assert len(set(calls)) == 2


def test_a_failed_shard_fails_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import torch as safetensors_torch

    def disk_full(tensors: dict[str, torch.Tensor], filename: Path, metadata: dict[str, str]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_checkpoint(_model("dense"), tmp_path, shard_gb=SMALL_GB, workers=2)
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_build_random_writes_its_checkpoint_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import transformers

    written: list[Path] = []

    def spy(model: Any, out_dir: Path, **kwargs: Any) -> None:
        written.append(out_dir)
        write_checkpoint(model, out_dir, **kwargs)

    monkeypatch.setattr(models, "write_checkpoint", spy)
    spec = {"init": "random", "arch": "qwen3_moe", "dtype": "bfloat16", **SHAPE, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "seed": 5}
    data.write_synthetic(tmp_path / "data", 32, 4, seed=0)
    models.build_random(spec, tmp_path / "data" / "train.jsonl", tmp_path / "model")
    assert len(written) == 1 and "written in" in capsys.readouterr().out
    config = transformers.AutoConfig.from_pretrained(tmp_path / "model")
    torch.manual_seed(5)  # the build's draw: float32 under the seed, cast to bf16
    drawn = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).state_dict()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.bfloat16,
                                                                     output_loading_info=True)
    assert not any(info.values()), info
    loaded = loaded.state_dict()
    assert drawn.keys() == loaded.keys()
    for key in drawn:
        assert torch.equal(drawn[key], loaded[key]), key
