"""GGUF byte-level BPE tokenizers of the model families (`tokenizer.ggml.pre`) against the family's own tokenizer.json.

No real Qwen, Llama 3 or Phi-4-mini tokenizer is on this machine (and the HF hub is out of reach), so each family's
tokenizer.json is rebuilt the way its published file is made (normalizer, pre-tokenizer, `ignore_merges`, byte-level
decoder, special tokens) around a byte-level BPE vocabulary trained here with `tokenizers`; written as an HF
directory and, with `gguf`'s writer and `gguf.SpecialVocab` (what llama.cpp's `convert_hf_to_gguf.py` uses), as a
GGUF file naming the family's `pre`. The ids our GGUF tokenizer gives on a multilingual, code and emoji corpus must
equal HF's (`tokenizers` on the tokenizer.json), and decoding must give the text back.
"""

from __future__ import annotations

import json
import pathlib
import unicodedata
from typing import Any

import pytest
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from asyncllm.errors import ConfigError
from asyncllm.model.loading.tokenizer import PRE_TOKENIZATIONS, Tokenizer

gguf = pytest.importorskip("gguf")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "Hello, world! HELLO WORLD. hello",
    "I'm sure they'll do it; we've seen what you'd do. I'M SURE THEY'LL. DON'T, Can'T",
    "digits 0 7 42 2024 1234567890 3.14159 1,000,000 -17 ٣٤٥ ４２",
    "  leading spaces, runs   of    spaces and trailing   ",
    "tabs\tand\t\ttabs, newlines\n\n\nand CRLF\r\n\r\nend",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "Русский текст, Ελληνικά, עברית, العربية, हिन्दी में लिखा, ภาษาไทย",
    "café naïve résumé Ünïcödé Ångström",
    "cafe\u0301 decomposed: A\u030angstro\u0308m",  # not NFC: Qwen's normalizer composes it
    "emoji 🎉🚀 family 👩‍👩‍👧 flags 🇫🇷🇯🇵 skin 👋🏽 keycap 1️⃣",
    "def f(x):\n    return x ** 2  # comment\n\nclass A:\n\tpass\n",
    'if (a && b) { printf("%d\\n", a[i]); } // C\nx = {"k": [1, 2.5e-3, null]}',
    "path/to/file.py:42 https://example.com/a?b=c&d=e#frag <tag attr='v'/>",
    "CamelCaseWords and snake_case_words, HTTPServerError, iPhone",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "glued<|im_end|>tokens<|endoftext|>here",
    "an unmergeable word, Unmergeable",
    "",
]
# A vocabulary token no merge sequence reaches (real vocabularies have them): with `ignore_merges` (Llama 3) the
# pre-token " unmergeable" is that one token, without it the merges' pieces.
UNREACHABLE = "Ġunmergeable"
# What the vocabulary is trained on: the corpus and more of the same kinds of text, so merges span words, numbers,
# scripts and emoji (a trained vocabulary, not a toy alphabet).
TRAINING = CORPUS * 3 + [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "import numpy as np\nfor i in range(10):\n    print(i, np.sqrt(i))\n" * 3,
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다. " * 3,
    "Привет, мир! Γειά σου κόσμε! مرحبا بالعالم! नमस्ते दुनिया! " * 3,
    "🎉🎉🚀🚀👩‍👩‍👧 🇫🇷 👋🏽 ❤️ 😀😃😄 " * 3,
    "0123456789 2024 1999 3.14 1,000 " * 3,
]


def _family_tokenizer(pre: str, vocab_size: int = 1200) -> HFTokenizer:
    """A byte-level BPE tokenizer laid out as the family's published tokenizer.json, its vocabulary trained here."""
    spec = PRE_TOKENIZATIONS[pre]
    tok = HFTokenizer(models.BPE(ignore_merges=spec.ignore_merges))
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    if spec.split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(spec.split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([t for t in TRAINING if "mergeable" not in t], trainer)
    data = json.loads(tok.to_str())
    data["model"]["vocab"][UNREACHABLE] = tok.get_vocab_size(with_added_tokens=True)
    return HFTokenizer.from_str(json.dumps(data))


def _write_hf_dir(tok: HFTokenizer, path: pathlib.Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False, "add_eos_token": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _write_gguf(hf_dir: pathlib.Path, pre: str, path: pathlib.Path) -> pathlib.Path:
    """The tokenizer metadata llama.cpp's converter writes for a byte-level BPE model (`get_vocab_base`: tokens by
    id, added special tokens CONTROL, other added ones USER_DEFINED; merges and special ids by `gguf.SpecialVocab`)."""
    tok = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    added = {t.content: t for t in tok.get_added_tokens_decoder().values()}
    tokens, types = [], []
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        tokens.append(token)
        if token in added:
            kind = gguf.TokenType.CONTROL if added[token].special else gguf.TokenType.USER_DEFINED
        else:
            kind = gguf.TokenType.NORMAL
        types.append(kind)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens))
    assert special.merges, "gguf.SpecialVocab found no merges"
    special.add_to_gguf(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=["qwen2", "llama-bpe", "gpt-4o", "gpt-2"])
def family(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, HFTokenizer, Tokenizer]:
    pre = request.param
    root = tmp_path_factory.mktemp(f"tok-{pre}")
    hf = _family_tokenizer(pre)
    _write_hf_dir(hf, root / "hf")
    ours = Tokenizer.load(str(_write_gguf(root / "hf", pre, root / "tok.gguf")))
    return pre, HFTokenizer.from_file(str(root / "hf" / "tokenizer.json")), ours


def test_gguf_ids_equal_the_family_tokenizer_json(family: tuple[str, HFTokenizer, Tokenizer]) -> None:
    pre, ref, ours = family
    multi_token = 0
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == ref.encode(text).ids, (pre, text)
        multi_token += any(len(ref.decode([i])) > 1 for i in ids)
        expected = unicodedata.normalize("NFC", text) if PRE_TOKENIZATIONS[pre].nfc else text
        assert ours.decode(ids, skip_special_tokens=False) == expected, (pre, text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), (pre, text)
    assert multi_token >= len(CORPUS) // 2  # the merges were exercised, not only single bytes
    unreachable = ref.token_to_id(UNREACHABLE)
    assert (unreachable in ours.encode("an unmergeable word")) == PRE_TOKENIZATIONS[pre].ignore_merges


def test_the_split_each_pre_names(family: tuple[str, HFTokenizer, Tokenizer]) -> None:
    """The split itself, independent of the vocabulary: digits (Qwen one by one, Llama 3 and o200k in threes, GPT-2
    in runs), case-insensitive contractions (not in GPT-2), o200k's split of cased words."""
    pre, _, ours = family
    assert ours.hf.pre_tokenizer is not None
    pieces = [p for p, _ in ours.hf.pre_tokenizer.pre_tokenize_str("x 12345 DON'T camelCase")]
    digits = {"qwen2": ["1", "2", "3", "4", "5"], "llama-bpe": ["123", "45"], "gpt-4o": ["123", "45"]}
    expected = {
        "qwen2": ["x", "Ġ", *digits["qwen2"], "ĠDON", "'T", "ĠcamelCase"],
        "llama-bpe": ["x", "Ġ", *digits["llama-bpe"], "ĠDON", "'T", "ĠcamelCase"],
        "gpt-4o": ["x", "Ġ", *digits["gpt-4o"], "ĠDON'T", "Ġcamel", "Case"],
        "gpt-2": ["x", "Ġ12345", "ĠDON", "'", "T", "ĠcamelCase"],
    }
    assert pieces == expected[pre]


@pytest.mark.parametrize("pre", [None, "", "default", "tekken", "qwen35", "Qwen2"])
def test_an_unknown_or_missing_pre_is_refused(pre: str | None, tmp_path: pathlib.Path) -> None:
    hf = _family_tokenizer("gpt-2", vocab_size=300)
    _write_hf_dir(hf, tmp_path / "hf")
    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    tokens = [t for t, _ in sorted(hf.get_vocab().items(), key=lambda kv: kv[1])]
    writer.add_token_list(tokens)
    gguf.SpecialVocab(tmp_path / "hf", load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"tokenizer\.ggml\.pre"):
        Tokenizer.load(str(path))
