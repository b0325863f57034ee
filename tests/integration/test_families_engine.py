"""Each new family served by a real engine (issue 28): an HF directory of the family's shapes and random weights
(`tests/family_checkpoints.py`, with a word-level tokenizer), `AsyncLLM` in thread mode with the worker's packed
float32 kernels, a batch of greedy requests: each request's ids equal HF `transformers`' greedy ids on the same
weights over the prefix where HF's choices are clear (top-2 margin >= 0.01), and a request alone equals it in the
batch."""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import pytest
import torch

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from tests.family_checkpoints import write_family_checkpoint
from tests.integration.conftest import EngineFactory

PROMPTS = [[5, 17, 42, 8, 8, 90, 1, 33, 150, 64, 7, 120], [9, 99, 3, 140, 12, 12, 60], [77, 3, 3, 101]]
MAX_TOKENS = 16
MARGIN = 1e-2


def hf_greedy_with_margins(ref: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids = list(prompt)
    margins = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = ref(torch.tensor([ids])).logits[0, -1]
            top2 = logits.topk(2).values
            margins.append(float(top2[0] - top2[1]))
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :], margins


async def engine_ids(llm: AsyncLLM) -> tuple[list[list[int]], list[int]]:
    """Greedy ids of every prompt in one batch, then of the first prompt alone."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        final = await llm.generate({"prompt_token_ids": PROMPTS[i]}, params).collect()
        results[i] = list(final.outputs[0].token_ids)

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    alone = await llm.generate({"prompt_token_ids": PROMPTS[0]}, params).collect()
    return results, list(alone.outputs[0].token_ids)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "phi4mini"])
async def test_engine_greedy_ids_equal_hf(family: str, tmp_path: pathlib.Path, make_llm: EngineFactory) -> None:
    pytest.importorskip("transformers")
    ref = write_family_checkpoint(family, tmp_path, tokenizer=True)
    # the KV cache sized from memory (num_kv_blocks=None), as EngineArgs does by default
    llm = make_llm(model=str(tmp_path), engine_process=False, num_kv_blocks=None)
    batch, alone = await engine_ids(llm)
    assert alone == batch[0], f"{family}: a request alone differs from itself in a batch"
    for prompt, ours in zip(PROMPTS, batch, strict=True):
        expected, margins = hf_greedy_with_margins(ref, prompt)
        clear = next((i for i, m in enumerate(margins) if m < MARGIN), MAX_TOKENS)
        assert clear >= 4, f"{family}: HF's greedy choices are unclear from token {clear}"
        assert ours[:clear] == expected[:clear], f"{family}: ours {ours}, HF {expected} (clear for {clear} tokens)"


def hf_cached_greedy_with_margins(ref: Any, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """HF's greedy ids as its `generate` computes them (the prompt in one call, then one token per call on its KV
    cache: HF's LongRoPE switches to the long factors per call), with each choice's top-2 margin."""
    ids: list[int] = []
    margins = []
    with torch.no_grad():
        out = ref(torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            logits = out.logits[0, -1]
            top2 = logits.topk(2).values
            margins.append(float(top2[0] - top2[1]))
            ids.append(int(logits.argmax()))
            out = ref(torch.tensor([ids[-1:]]), cache=out.cache, use_cache=True)
    return ids, margins


async def longrope_engine(path: pathlib.Path, prompt: list[int], steps: int) -> list[int]:
    """Greedy ids of `prompt` from the engine at the checkpoint's whole context; a prompt one token longer than the
    original context must be refused at submission."""
    from asyncllm.errors import InvalidRequestError

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    async with AsyncLLM.from_engine_args(EngineArgs(model=str(path), engine_process=False, quantization=None)) as llm:
        with pytest.raises(InvalidRequestError, match="at most 64"):
            await llm.generate({"prompt_token_ids": [5] * 65}, params).collect()
        final = await llm.generate({"prompt_token_ids": prompt}, params).collect()
        return list(final.outputs[0].token_ids)


def test_engine_longrope_decodes_past_the_original_context_as_hf_generate(tmp_path: pathlib.Path) -> None:
    """Phi-4-mini's LongRoPE (long factors from position 64 of 128) served by the engine: a 56-token prompt decoded
    for 24 tokens crosses the switch; ids equal HF's cached greedy ids where its choices are clear."""
    pytest.importorskip("transformers")
    ref = write_family_checkpoint("phi4mini", tmp_path, tokenizer=True)
    prompt = [(37 * i + 11) % 160 for i in range(56)]
    ours = anyio.run(longrope_engine, tmp_path, prompt, 24)
    expected, margins = hf_cached_greedy_with_margins(ref, prompt, 24)
    clear = next((i for i, m in enumerate(margins) if m < MARGIN), 24)
    assert clear > 64 - len(prompt), f"HF's greedy choices are unclear from token {clear}, before the switch"
    assert ours[:clear] == expected[:clear], f"ours {ours}, HF {expected} (clear for {clear} tokens)"
