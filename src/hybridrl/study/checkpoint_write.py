"""Write a Hugging Face checkpoint as save_pretrained does, its shards written in parallel.

save_pretrained writes its shards one after the other, and by default in 50 GB shards: the 48-layer Qwen3-30B-A3B
(61 GB in bf16) took 76 s to write, nearly all of it in one thread. Here the state dict is built and split by the
same functions save_pretrained calls, so names, shapes, dtypes, values, the safetensors metadata, the index and
config files are what it writes, and smaller shards are written by a pool of threads: safetensors (>= 0.8) releases
the GIL while it writes a file, and torch while it copies a CUDA tensor to the host.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

SHARD_GB = 4.0  # as published checkpoints do (Qwen3-30B-A3B: 16 shards of ~4 GB)
WORKERS = min(8, os.cpu_count() or 1)  # each holds one shard on the host while it writes it: 8 x 4 GB at most


def write_checkpoint(model: Any, out_dir: Path, shard_gb: float = SHARD_GB, workers: int = WORKERS) -> None:
    """Save `model` (a transformers PreTrainedModel) to `out_dir` as `model.save_pretrained(out_dir,
    max_shard_size=shard_gb GB)` would, writing up to `workers` shards at once. A quantized, PEFT, tensor-parallel
    or offloaded model, which save_pretrained treats specially, is left to save_pretrained itself."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors import torch as safetensors_torch
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, logging

    max_shard_size = int(shard_gb * 10**9)
    if _special(model):
        model.save_pretrained(out_dir, max_shard_size=max_shard_size)
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("model*.safetensors*"):  # a stale shard would still be read by a loader that globs
        old.unlink()

    # config.json and generation_config.json: save_pretrained records the dtype and class first
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    if model.can_generate():
        model.generation_config.save_pretrained(out_dir)

    # the tensors save_pretrained writes: tied copies dropped, and the on-disk layout restored (e.g. MoE experts
    # that transformers 5 fuses into 3-D tensors in memory split back into one tensor per expert)
    state_dict = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state_dict.pop(key, None)
    state_dict = remove_tied_weights_from_state_dict(state_dict, model)
    state_dict = revert_weight_conversion(model, state_dict)
    split = split_torch_state_dict_into_shards(
        state_dict, filename_pattern=SAFE_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=max_shard_size,
    )

    def write(filename: str, names: list[str]) -> None:
        # popped, so that a written shard's host copies and converted tensors are freed as save_pretrained does
        shard = {name: state_dict.pop(name).contiguous() for name in names}
        safetensors_torch.save_file(shard, out_dir / filename, metadata={"format": "pt"})

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="shard-writer") as pool:
        futures = [pool.submit(write, f, names) for f, names in split.filename_to_tensors.items()]
        try:
            for future in logging.tqdm(as_completed(futures), total=len(futures), desc="Writing model shards"):
                future.result()
        except BaseException:
            for future in futures:  # the first failure (a full disk) ends the write; running shards finish
                future.cancel()
            raise

    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (out_dir / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n",
                                                          encoding="utf-8")


def _special(model: Any) -> bool:
    """A model whose save_pretrained takes another path than a plain state dict's."""
    device_map = getattr(model, "hf_device_map", None) or {}
    return (getattr(model, "hf_quantizer", None) is not None or getattr(model, "_hf_peft_config_loaded", False)
            or getattr(model, "_tp_size", None) is not None or bool({"cpu", "disk"} & set(device_map.values())))
