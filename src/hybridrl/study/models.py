"""Model preparation: download a Hugging Face checkpoint once, or build a random-init one offline."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from hybridrl.atomic import atomic_dir, check_writable
from hybridrl.study.checkpoint_write import write_checkpoint
from hybridrl.study.config import ConfigError
from hybridrl.task.data import prompt_text, read_jsonl

ARCH_CONFIGS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
_SHAPE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "norm_topk_prob", "tie_word_embeddings",
)
VOCAB_MULTIPLE = 128  # default padding of the model's vocab, as real checkpoints do, so TP 2..128 divides it
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
# Written into every model directory this module builds or downloads: the mark that lets a rebuild replace it.
MARKER = "hybridrl-model.json"


class ModelOutError(RuntimeError):
    """--out holds something hybridrl did not write there; it is left alone."""


def parse_spec(text: str) -> dict[str, Any]:
    """`--spec` as the `model` command takes it: a JSON object, checked by check_spec."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--spec is not JSON ({exc.msg} at column {exc.colno}): {text[:80]!r}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"--spec must be a JSON object (a model's entry under models:), got {type(spec).__name__}")
    check_spec(spec)
    return spec


def check_spec(spec: dict[str, Any]) -> None:
    """A model spec names a local `path`, an `hf_id` to download, or an `arch` to build from random weights."""
    if "path" in spec or "hf_id" in spec:
        return
    known = ", ".join(ARCH_CONFIGS)
    if "arch" not in spec:
        raise ConfigError(f"model spec has none of path, hf_id or arch (arch: one of {known})")
    if spec["arch"] not in ARCH_CONFIGS:
        raise ConfigError(f"model spec: unknown arch {spec['arch']!r} (known: {known})")


def check_out(out_dir: Path) -> None:
    """Refuse an --out that a build would replace but hybridrl did not write.

    The design is "build in a temp directory beside --out, then swap it in" (_publish, link_local), and a swap
    removes what carried the name before. That is safe only for what this module wrote itself: a model directory
    holding MARKER, a symlink (link_local's; unlinking it leaves its target alone) or an empty directory. Anything
    else (a user's directory, a checkpoint from elsewhere, a file) is refused before any work, so a rerun never
    deletes what it did not create.
    """
    if out_dir.is_symlink() or not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ModelOutError(f"--out {out_dir} is a file, not a model directory: refusing to replace it")
    if (out_dir / MARKER).is_file() or not any(out_dir.iterdir()):
        return
    raise ModelOutError(f"--out {out_dir} exists and was not written by hybridrl model (no {MARKER} in it): "
                        "refusing to replace it; move it away or give another --out")


def model_dir(root: Path, name: str) -> Path:
    return root / name


def build_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> None:
    """Train a byte-level BPE on the study's own text and save it as a normal HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[1])
    fast.save_pretrained(out_dir)


def _tokenizer(spec: dict[str, Any], texts: list[str], out_dir: Path) -> tuple[Any, int]:
    """The model's tokenizer, saved to out_dir, and the model's vocab size (its embedding rows).

    `tokenizer: qwen`: Qwen's real one and Qwen3's 151,936 rows. Otherwise (`trained`) a byte-level BPE trained on
    the study's text up to `vocab_size`, padded to a multiple of `vocab_multiple` (default VOCAB_MULTIPLE; e.g.
    729 -> 768), like Qwen3's 151936 for 151669 tokens, so that tensor parallelism can split it; `vocab_multiple: 1`
    keeps the tokenizer's length. The tokenizer never produces the extra ids, but an untrained model may sample
    them; they decode to nothing.
    """
    import transformers

    if spec.get("tokenizer") == "qwen":
        from hybridrl.study.qwen_vocab import MODEL_VOCAB, build_qwen_tokenizer

        build_qwen_tokenizer(out_dir)
        return transformers.AutoTokenizer.from_pretrained(out_dir), MODEL_VOCAB
    build_tokenizer(texts, spec.get("vocab_size", 512), out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    multiple = int(spec.get("vocab_multiple", VOCAB_MULTIPLE))
    return tokenizer, -(-len(tokenizer) // multiple) * multiple


def _special_ids(tokenizer: Any) -> dict[str, Any]:
    """bos/eos/pad of the model config; Qwen's stops at <|im_end|> or <|endoftext|>, as Qwen3-0.6B does."""
    from hybridrl.study.qwen_vocab import EOS_IDS, PAD

    if tokenizer.pad_token == PAD and tokenizer.eos_token_id == EOS_IDS[0]:
        return {"bos_token_id": EOS_IDS[1], "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id, "generation_eos": list(EOS_IDS)}
    return {"bos_token_id": tokenizer.eos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "generation_eos": tokenizer.eos_token_id}


def _draw(model_cls: Any, config: Any, spec: dict[str, Any], dtype: Any) -> Any:
    """The random weights, drawn where the spec says (init_device). On the CPU they are drawn in float32 and cast
    when saved, as every model built before init_device was; on CUDA in the model's dtype, unless a warm start
    will train them, which it does in float32."""
    import torch

    device = spec.get("init_device") or "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model spec has init_device: cuda, but no CUDA device is visible here: give the build a "
                          "GPU, or draw the weights on the CPU (init_device: cpu)")
    draw_dtype = dtype if device == "cuda" and spec.get("warm_start") is None else torch.float32
    torch.manual_seed(spec.get("seed", 0))
    default = torch.get_default_dtype()
    torch.set_default_dtype(draw_dtype)
    try:
        with torch.device(device):
            return model_cls(config)
    finally:
        torch.set_default_dtype(default)


def build_random(spec: dict[str, Any], corpus: Path, out_dir: Path, test: Path | None = None) -> None:
    """A random-init checkpoint of the given architecture with its tokenizer (see _tokenizer), warm-started on
    `corpus` (the train split) when the spec has `warm_start`, its accuracy measured on `test`."""
    import torch
    import transformers

    check_spec(spec)
    check_out(out_dir)
    if spec.get("warm_start") is not None and test is None:
        raise ConfigError("model spec has warm_start: give --test, the test split its base accuracy is measured on")
    config_cls, model_cls = (getattr(transformers, n) for n in ARCH_CONFIGS[spec["arch"]])
    rows = read_jsonl(corpus)  # DataError names the file: missing problems, a torn line
    texts = [prompt_text(r["question"]) + " " + r["answer"] for r in rows]
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
        tmp_dir = Path(tmp)
        tokenizer, vocab_size = _tokenizer(spec, texts, tmp_dir)
        shape = {k: spec[k] for k in _SHAPE_KEYS if k in spec}
        shape["vocab_size"] = vocab_size
        dtype = getattr(torch, spec.get("dtype", "bfloat16"))
        ids = _special_ids(tokenizer)
        generation_eos = ids.pop("generation_eos")
        config = config_cls(**shape, **ids, torch_dtype=dtype)
        t0 = time.perf_counter()
        model = _draw(model_cls, config, spec, dtype)
        drawn_s = time.perf_counter() - t0
        model.generation_config.eos_token_id = generation_eos
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        if spec.get("warm_start") is not None:
            from hybridrl.study.warm_start import warm_start

            warm_start(model, tokenizer, rows, read_jsonl(test), spec["warm_start"], tmp_dir)
        t0 = time.perf_counter()
        write_checkpoint(model.to(dtype), tmp_dir)  # save_pretrained's files, shards written in parallel
        # into the build's log: what a study's set-up pays for its model, part by part
        print(f"model: weights drawn on {spec.get('init_device') or 'cpu'} in {drawn_s:.1f} s, written in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        built = {"init": "random", **spec, "warm_started": "warm_start" in spec}
        (tmp_dir / MARKER).write_text(json.dumps(built, indent=2))
        _publish(tmp_dir, out_dir)


def download(spec: dict[str, Any], out_dir: Path) -> None:
    from huggingface_hub import snapshot_download

    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
        try:
            snapshot_download(spec["hf_id"], revision=spec.get("revision"), local_dir=tmp,
                              allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.py"])
        except Exception as exc:  # the hub raises many types; one message names the model
            raise RuntimeError(f"model {spec['hf_id']}: download failed ({type(exc).__name__}: {exc})") from exc
        (Path(tmp) / MARKER).write_text(json.dumps({"init": "download", **spec}, indent=2))
        _publish(Path(tmp), out_dir)


def link_local(spec: dict[str, Any], out_dir: Path) -> None:
    src = Path(spec["path"]).expanduser().resolve()
    if not src.exists():
        raise FileNotFoundError(f"model path {src} does not exist")
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"model path {src} has no config.json: not a Hugging Face checkpoint")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    check_out(out_dir)
    if out_dir.is_symlink() or out_dir.exists():
        out_dir.unlink() if out_dir.is_symlink() else shutil.rmtree(out_dir)
    out_dir.symlink_to(src, target_is_directory=True)


def _publish(tmp_dir: Path, out_dir: Path) -> None:
    """Move a finished checkpoint into place, so a half-written one never carries the final name. Moved, not
    copied: the temporary directory is a sibling (a rename), and a 61 GB checkpoint copied needs its size twice."""
    check_out(out_dir)  # atomic_dir removes what carries the name: only ever what hybridrl wrote
    with atomic_dir(out_dir) as staging:
        for entry in tmp_dir.iterdir():
            shutil.move(entry, staging / entry.name)
        staging.chmod(0o755)  # mkdtemp makes 0700; others (containers, colleagues) must read it


def prepare(spec: dict[str, Any], corpus: Path, out_dir: Path, test: Path | None = None) -> None:
    check_spec(spec)
    check_out(out_dir)  # before a download or a warm start, not after hours of one
    check_writable(out_dir)  # likewise; an error names --out, not a temp folder beside it
    if "path" in spec:
        link_local(spec, out_dir)
    elif "hf_id" in spec:
        download(spec, out_dir)
    else:
        build_random(spec, corpus, out_dir, test)
