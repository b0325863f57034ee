"""Parity of our tokenizer and model with HF transformers loading the same GGUF file (test-only reference).

Tolerance: max |logit difference| <= 1e-3 * max |reference logit| per prompt (about 0.025 here). Measured on
this file (3 chat prompts, 37-40 tokens): 4.4e-5 to 5.2e-5 for a single prefill and up to 1.2e-4 for chunked
prefill then decode, against logits of magnitude 25-33 (relative <= 5e-6: float32 summation order only). The
bound leaves a 200x margin and still catches any real error (a wrong rotary layout or norm gives > 1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.loading.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16
RELATIVE_TOLERANCE = 1e-3
CLEAR_MARGIN = 0.5  # logits; greedy choices are compared only where the reference's top-2 gap exceeds it

TOKENIZER_CORPUS = [
    "Hello, world!",
    "  leading spaces, runs   of    spaces and trailing   ",
    "tabs\tand\t\ttabs, newlines\n\n\nand CRLF\r\n",
    "digits 0 7 42 2024 1234567890 3.14159 1,000,000 -17",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji 🎉🚀 family 👩‍👩‍👧 flags 🇫🇷",
    "café naïve résumé Ünïcödé Ångström",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "glued<|im_end|>tokens<|endoftext|>here<repo_name>x",
    "def f(x):\n    return x ** 2  # comment\n",
    "I'm sure they'll do it; we've seen what you'd do.",
    "",
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what a CPU cache is.",
]


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer.load(model_path)


@pytest.fixture(scope="module")
def model(reference_model: Any) -> Any:
    return reference_model  # the session's dense model (tests/conftest.py)


@pytest.fixture(scope="module")
def reference(hf_reference: tuple[Any, Any]) -> tuple[Any, Any]:
    return hf_reference  # HF tokenizer and model, loaded once per session (tests/conftest.py)


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}])) for c in CHATS]


def _reference_logits(ref: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0, -1].float()


class _Runner:
    """A minimal stand-in for the model runner: fresh paged KV cache, contiguous block ids per sequence."""

    def __init__(self, model: Any, num_seqs: int, max_len: int) -> None:
        arch = model.arch
        self.model = model
        self.blocks_per_seq = -(-max_len // BLOCK_SIZE)
        shape = (num_seqs * self.blocks_per_seq, 2, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]
        self.seq_lens = [0] * num_seqs

    def step(self, chunks: list[list[int]]) -> torch.Tensor:
        """Run one step with `chunks[i]` new tokens for sequence i; returns each sequence's last logits."""
        query_lens = [len(c) for c in chunks]
        positions = [p for i, c in enumerate(chunks) for p in range(self.seq_lens[i], self.seq_lens[i] + len(c))]
        self.seq_lens = [s + q for s, q in zip(self.seq_lens, query_lens, strict=True)]
        tables = [list(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq)) for i in range(len(chunks))]
        meta = build_attention_metadata(query_lens, self.seq_lens, tables, BLOCK_SIZE)
        ids = torch.tensor([t for c in chunks for t in c])
        hidden = self.model(ids, torch.tensor(positions), self.kv_caches, meta)
        last = torch.tensor(query_lens).cumsum(0) - 1
        return self.model.compute_logits(hidden[last])


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= RELATIVE_TOLERANCE * ref.abs().max().item(), f"max |diff| {diff}"


def test_tokenizer_ids_match_transformers(tokenizer: Tokenizer, reference: tuple[Any, Any]) -> None:
    ref_tok, _ = reference
    for text in TOKENIZER_CORPUS:
        ids = tokenizer.encode(text)
        assert ids == ref_tok.encode(text), text
        assert tokenizer.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == ref_tok.decode(ids), text


def test_special_tokens_and_chat_template(tokenizer: Tokenizer, reference: tuple[Any, Any]) -> None:
    ref_tok, _ = reference
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.add_bos_token) == (1, 2, False)
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for add in (True, False):
        expected = ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_prefill_logits_match_transformers(model: Any, reference: tuple[Any, Any], prompts: list[list[int]]) -> None:
    _, ref = reference
    runner = _Runner(model, len(prompts), max(map(len, prompts)))
    ours = runner.step(prompts)  # all prompts in one batched step
    for row, ids in zip(ours, prompts, strict=True):
        _assert_close(row, _reference_logits(ref, ids))


def test_chunked_prefill_then_decode_matches(model: Any, reference: tuple[Any, Any], prompts: list[list[int]]) -> None:
    _, ref = reference
    cut = [len(p) - 4 for p in prompts]
    runner = _Runner(model, len(prompts), max(map(len, prompts)))
    runner.step([p[: c // 2] for p, c in zip(prompts, cut, strict=True)])  # first chunk
    runner.step([p[c // 2 : c] for p, c in zip(prompts, cut, strict=True)])  # chunk on a cached prefix
    for k in range(4):  # then decode the rest one token per step, all sequences batched
        ours = runner.step([[p[c + k]] for p, c in zip(prompts, cut, strict=True)])
    for row, ids in zip(ours, prompts, strict=True):
        _assert_close(row, _reference_logits(ref, ids))


def test_greedy_matches_where_margin_is_clear(
    model: Any, tokenizer: Tokenizer, reference: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    _, ref = reference
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompts[0]]),
            attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    expected = out.sequences[0, len(prompts[0]) :].tolist()
    runner = _Runner(model, 1, len(prompts[0]) + len(expected))
    logits = runner.step([prompts[0]])[0]
    for token, scores in zip(expected, out.scores, strict=True):  # follow the reference's tokens
        top2 = scores[0].topk(2).values
        if top2[0] - top2[1] > CLEAR_MARGIN:
            assert int(logits.argmax()) == token
        logits = runner.step([[token]])[0]
    assert tokenizer.decode(expected).startswith("The capital of France is Paris.")
