"""Gemma 3 270M (the second real model, `gemma-3-270m`: SentencePiece tokenizer, K-quant tensors, sliding-window
layers) against HF transformers loading the same GGUF file (test-only reference, loaded once for the module).

Slow: the file is fetched once per machine (253 MB) and HF's model load takes about 90 s here.

Tolerance: max |logit difference| <= 1e-3 * max |reference logit| per step, as for the default model; both sides
dequantize the same tensors, so only float32 summation order differs (the measured error is in the failure message
and printed with `-s`). A missing window changes the logits past position 512 by far more
(`test_long_prompt_beyond_the_window_matches`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tokenizers.decoders import DecodeStream

from asyncllm.config import ModelConfig
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.loading.loader import load_model
from asyncllm.model.loading.tokenizer import Tokenizer
from tests.conftest import load_hf_reference

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


BLOCK_SIZE = 16
RELATIVE_TOLERANCE = 1e-3
CLEAR_MARGIN = 0.5  # logits; greedy choices are compared only where the reference's top-2 gap exceeds it
DECODE_STEPS = 32
PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Der schnelle braune Fuchs springt über den faulen Hund, und dann",
]
LONG_TEXT = (
    "Rivers begin as rain and melted snow gathered in high ground. Small streams join into larger ones, carving "
    "valleys over thousands of years, carrying sand and silt that settle where the water slows. Near the sea a "
    "river may split into many channels and build a delta of fertile land. People have settled beside rivers since "
    "the first farms, for water, for fish, and for the easy travel a current offers to boats. "
)


@pytest.fixture(scope="module")
def tokenizer(gemma_path: str) -> Tokenizer:
    return Tokenizer.load(gemma_path)


@pytest.fixture(scope="module")
def hf_reference_gemma(gemma_path: str) -> tuple[Any, Any]:
    """HF transformers' Gemma 3 tokenizer and fp32 model from the same GGUF file, loaded together (one parse)."""
    return load_hf_reference(gemma_path)


@pytest.fixture(scope="module")
def hf_tokenizer(hf_reference_gemma: tuple[Any, Any]) -> Any:
    return hf_reference_gemma[0]


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


@pytest.fixture(scope="module")
def hf_model(hf_reference_gemma: tuple[Any, Any]) -> Any:
    ref = hf_reference_gemma[1]
    assert type(ref).__name__ == "Gemma3ForCausalLM"
    return ref


@pytest.fixture(scope="module")
def model(gemma_model: Any) -> Any:
    """The session's fp32 Gemma 3 (`gemma_model`, read-only)."""
    return gemma_model


class _Runner:
    """A fresh paged KV cache; sequence i owns a contiguous run of block ids."""

    def __init__(self, model: Any, num_seqs: int, max_len: int) -> None:
        arch = model.arch
        self.model = model
        self.blocks = -(-max_len // BLOCK_SIZE)
        shape = (num_seqs * self.blocks, 2, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]
        self.seq_lens = [0] * num_seqs

    def step(self, chunks: list[list[int]], rows: list[list[int]] | None = None) -> list[torch.Tensor]:
        """One step with `chunks[i]` new tokens for sequence i; returns sequence i's logits at the chunk offsets
        `rows[i]` (default: its last token), [len(rows[i]), vocab] each."""
        query_lens = [len(c) for c in chunks]
        positions = [p for i, c in enumerate(chunks) for p in range(self.seq_lens[i], self.seq_lens[i] + len(c))]
        self.seq_lens = [s + q for s, q in zip(self.seq_lens, query_lens, strict=True)]
        tables = [list(range(i * self.blocks, (i + 1) * self.blocks)) for i in range(len(chunks))]
        meta = build_attention_metadata(query_lens, self.seq_lens, tables, BLOCK_SIZE)
        hidden = self.model(torch.tensor([t for c in chunks for t in c]), torch.tensor(positions), self.kv_caches, meta)
        starts = [sum(query_lens[:i]) for i in range(len(chunks))]
        rows = rows or [[q - 1] for q in query_lens]
        return [
            self.model.compute_logits(hidden[[start + r for r in rs]]) for start, rs in zip(starts, rows, strict=True)
        ]


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def _hf_logits_at(ref: Any, ids: list[int], rows: list[int]) -> torch.Tensor:
    """HF's logits at positions `rows` of one forward over `ids` (the LM head only on those rows)."""
    with torch.no_grad():
        hidden = ref.model(torch.tensor([ids])).last_hidden_state[0, rows]
        return ref.lm_head(hidden).float()


def test_prefill_and_greedy_decode_logits_match_transformers(model: Any, hf_model: Any, tokenizer: Tokenizer) -> None:
    """Three prompts prefilled in one batched step, then 32 decode steps batched, following HF's greedy tokens."""
    prompts = [tokenizer.encode(p) for p in PARITY_PROMPTS]
    expected: list[tuple[list[int], list[torch.Tensor]]] = []
    for ids in prompts:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=DECODE_STEPS,
                min_new_tokens=DECODE_STEPS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        expected.append((out.sequences[0, len(ids) :].tolist(), [x[0].float() for x in out.logits]))
    runner = _Runner(model, len(prompts), max(map(len, prompts)) + DECODE_STEPS)
    logits = [row[0] for row in runner.step(prompts)]
    errors, checked = [], 0
    for step in range(DECODE_STEPS):
        for ours, (tokens, ref_logits) in zip(logits, expected, strict=True):
            ref = ref_logits[step]
            errors.append(_relative_error(ours, ref))
            top2 = ref.topk(2).values
            if top2[0] - top2[1] > CLEAR_MARGIN:
                checked += 1
                assert int(ours.argmax()) == tokens[step], f"step {step}"
        logits = [row[0] for row in runner.step([[tokens[step]] for tokens, _ in expected])]
    print(f"gemma-3-270m vs HF: max relative logit error {max(errors):.2e} over {len(errors)} rows")
    assert max(errors) <= RELATIVE_TOLERANCE, f"max relative error {max(errors):.2e}"
    assert checked > len(errors) // 2
    assert tokenizer.decode(expected[0][0]).startswith(" the capital of the country of France.")


def test_france_greedy_text(model: Any, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The capital of France is")
    runner = _Runner(model, 1, len(ids) + 10)
    logits, out = runner.step([ids])[0][0], []
    for _ in range(9):
        out.append(int(logits.argmax()))
        logits = runner.step([[out[-1]]])[0][0]
    assert tokenizer.decode(out).startswith(" the capital of the country of France.")


def test_long_prompt_beyond_the_window_matches(model: Any, hf_model: Any, tokenizer: Tokenizer) -> None:
    """A 700-token prompt (past the 512-token window of the local layers), in one prefill and in chunks of 64,
    then 4 decode steps, against HF; the same prompt without the window differs far beyond the tolerance."""
    ids = tokenizer.encode(LONG_TEXT * 12)[:700]
    rows = [0, 300, 511, 512, 513, 600, 699]
    expected = _hf_logits_at(hf_model, ids, rows)
    whole = _Runner(model, 1, 704).step([ids], [rows])[0]
    error = _relative_error(whole, expected)
    chunked = _Runner(model, 1, 704)
    got = []
    for start in range(0, 640, 64):
        chunk = ids[start : start + 64]
        got += chunked.step([chunk], [[r - start for r in rows if start <= r < start + 64]])
    for k in range(640, 644):
        got += chunked.step([[ids[k]]])
    chunk_rows = [r for r in rows if r < 640] + list(range(640, 644))
    chunk_error = _relative_error(torch.cat(got), _hf_logits_at(hf_model, ids, chunk_rows))
    print(f"700-token prompt vs HF: one prefill {error:.2e}, chunks of 64 + decode {chunk_error:.2e}")
    assert error <= RELATIVE_TOLERANCE
    assert chunk_error <= RELATIVE_TOLERANCE
    windows = [layer.window for layer in model.layers]
    try:
        for layer in model.layers:
            layer.window = None
        unwindowed = _Runner(model, 1, 704).step([ids], [rows])[0]
    finally:
        for layer, window in zip(model.layers, windows, strict=True):
            layer.window = window
    assert _relative_error(unwindowed[:3], expected[:3]) <= RELATIVE_TOLERANCE  # within the window: the same
    assert _relative_error(unwindowed[4:], expected[4:]) > 10 * RELATIVE_TOLERANCE


def test_batch_equals_solo(model: Any, tokenizer: Tokenizer) -> None:
    long, short = tokenizer.encode(LONG_TEXT * 8)[:600], tokenizer.encode("The capital of France is")
    batched = _Runner(model, 2, 608).step([long, short])
    for ids, logits in zip((long, short), batched, strict=True):
        solo = _Runner(model, 1, 608).step([ids])[0]
        torch.testing.assert_close(logits, solo, rtol=0, atol=1e-5 * float(solo.abs().max()))


INT8_TEXTS = [  # teacher-forced corpus for int8: prose, a recipe, code (none of it the calibration text)
    "The capital of France is Paris. It is known for the Eiffel Tower, museums such as the Louvre, and its cafes "
    "along the Seine.",
    "To make a simple tomato sauce, warm olive oil in a pan, add chopped garlic, then crushed tomatoes, salt and "
    "basil, and simmer for twenty minutes.",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n    return quicksort([x for x in "
    "xs[1:] if x < pivot]) + [pivot] + quicksort([x for x in xs[1:] if x >= pivot])\n",
]


def test_int8_is_close_to_fp32(model: Any, gemma_path: str, tokenizer: Tokenizer) -> None:
    """`quantization="int8"` (SmoothQuant, calibrated on plain text: the model has no chat template). Measured per
    prompt position, max |diff| / max |fp32 logit|: mean 0.061-0.082, worst 0.101-0.152, top-1 agreement 83-96%
    (29-71 tokens); the bounds leave ~1.5x. A broken quantizer gives errors > 1."""
    int8 = load_model(ModelConfig(model=gemma_path, model_path=gemma_path, quantization="int8"))
    for text in INT8_TEXTS:
        ids = tokenizer.encode(text)
        rows = [list(range(len(ids)))]
        ours, ref = _Runner(int8, 1, len(ids)).step([ids], rows)[0], _Runner(model, 1, len(ids)).step([ids], rows)[0]
        error = (ours - ref).abs().amax(-1) / ref.abs().amax(-1)
        agree = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
        print(f"int8 vs fp32, {len(ids)} tokens: mean {error.mean():.3f}, worst {error.max():.3f}, top-1 {agree:.2f}")
        assert float(error.mean()) <= 0.13
        assert float(error.max()) <= 0.25
        assert agree >= 0.75
    france = tokenizer.encode("The capital of France is")
    runner = _Runner(int8, 1, len(france) + 10)
    logits, out = runner.step([france])[0][0], []
    for _ in range(9):
        out.append(int(logits.argmax()))
        logits = runner.step([[out[-1]]])[0][0]
    assert tokenizer.decode(out).startswith(" the capital of the country of France.")


def test_final_hidden_states_match_transformers(model: Any, hf_model: Any, tokenizer: Tokenizer) -> None:
    """The final-norm hidden states `encode()` pools equal HF's base model's `last_hidden_state` (700 tokens)."""
    ids = tokenizer.encode(LONG_TEXT * 12)[:700]
    runner = _Runner(model, 1, 704)
    meta = build_attention_metadata([700], [700], [list(range(runner.blocks))], BLOCK_SIZE)
    ours = model(torch.tensor(ids), torch.arange(700), runner.kv_caches, meta)
    with torch.no_grad():
        ref = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    assert _relative_error(ours, ref) <= RELATIVE_TOLERANCE
