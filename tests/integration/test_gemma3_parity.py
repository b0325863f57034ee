"""Gemma 3 270M (the second real model, `gemma-3-270m`: SentencePiece tokenizer, K-quant tensors, sliding-window
layers) against HF transformers loading the same GGUF file (test-only reference, loaded once for the module).

Slow: the file is fetched once per machine (253 MB) and HF's model load takes about 90 s here.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from tokenizers.decoders import DecodeStream

from asyncllm.model.loading.resolve import resolve_model_path
from asyncllm.model.loading.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

TOKENIZER_CORPUS = [
    "The capital of France is",
    "Hello, world!",
    "  leading spaces, runs   of    spaces and trailing   ",
    "tabs\tand\t\ttabs, newlines\n\n\nand CRLF\r\n",
    "digits 0 7 42 2024 1234567890 3.14159 1,000,000 -17 1e-6",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "Привет, как дела? Größe, naïve café — «ça va?» مرحبا بالعالم नमस्ते",
    "emoji 🎉🚀 family 👩‍👩‍👧 flags 🇫🇷 🙂🤖",
    "rare symbols ℵ₀ ∑ ∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𪚥 \U000f0000 \u2581 and a control \x01 char",
    "<bos>glued<eos>tokens<start_of_turn>user\nhi<end_of_turn>\n<mask>",
    "def f(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    'fn main() { println!("{}", 1 << 3); } // rust\n<div class="x">&amp;</div>',
    "byte fallback 𪚥\U000f0000\u0378 streamed",
    "I'm sure they'll do it; we've seen what you'd do.",
    " ",
    "",
]


@pytest.fixture(scope="module")
def gemma_path() -> str:
    return str(resolve_model_path("gemma-3-270m"))


@pytest.fixture(scope="module")
def tokenizer(gemma_path: str) -> Tokenizer:
    return Tokenizer.load(gemma_path)


@pytest.fixture(scope="module")
def hf_tokenizer(gemma_path: str) -> Any:
    path = pathlib.Path(gemma_path)
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_tokenizer_ids_match_transformers(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    assert tokenizer.vocab_size == len(hf_tokenizer) == 262_144
    for text in TOKENIZER_CORPUS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert ids[0] == 2  # BOS added (tokenizer.ggml.add_bos_token)
        assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids), text


def test_decode_round_trips_and_streams(tokenizer: Tokenizer) -> None:
    for text in TOKENIZER_CORPUS:
        if "<" in text or "\u2581" in text:  # special tokens are dropped; a written "▁" is SentencePiece's space
            continue
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        stream = DecodeStream(skip_special_tokens=True)
        pieces = [stream.step(tokenizer.hf, token) for token in ids]
        assert "".join(p for p in pieces if p) == text, text


def test_special_tokens_and_byte_fallback(tokenizer: Tokenizer) -> None:
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.add_bos_token) == ("<bos>", "<eos>", True)
    assert tokenizer.encode("<start_of_turn><end_of_turn>", add_special_tokens=False) == [105, 106]
    ids = tokenizer.encode("\U000f0000", add_special_tokens=False)  # a private-use character no token spells
    assert [tokenizer.hf.id_to_token(i) for i in ids] == ["<0xF3>", "<0xB0>", "<0x80>", "<0x80>"]  # its UTF-8 bytes
    assert tokenizer.decode(ids) == "\U000f0000"
    assert tokenizer.chat_template is None  # a base model
