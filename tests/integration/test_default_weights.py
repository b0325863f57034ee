"""The default engine on the default model (`quantization="auto"`: the file's own Q4_1 blocks, "gguf") runs every
feature the float32 engine runs: n-gram speculative decoding (the same greedy tokens as without drafts), prefix
caching with chunked prefill (a cached prompt gives the tokens it gave fresh), structured outputs, embeddings and
prompt embeddings. The float32 tests of these features (`test_speculative.py`, `test_embeddings.py`, ...) pin
`quantization=None` (`ENGINE_DEFAULTS`): their references are float32."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asyncllm import AsyncLLM, PoolingParams, SamplingParams
from asyncllm.structured_outputs import StructuredOutputsParams
from tests.integration.conftest import EngineFactory, wait_until_idle
from tests.kernel_checks import require_kernels

pytestmark = pytest.mark.slow

AUTO = {"quantization": "auto", "engine_process": False, "max_model_len": 256, "max_num_batched_tokens": 64}
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}
PROMPTS = [
    "Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Repeat after me: the quick brown fox jumps over the lazy dog.",
    'Repeat the following JSON: {"name": "Ada", "age": 36, "city": "London"}',
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def engines(model_path: str) -> Iterator[EngineFactory]:
    require_kernels()  # fails under CI where they do not build, skips elsewhere (tests/kernel_checks.py)
    factory = EngineFactory(model_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def default_llm(engines: EngineFactory) -> AsyncLLM:
    return engines(**AUTO)


async def _greedy(llm: AsyncLLM, prompts: list[Any], max_tokens: int = 24) -> list[Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return list(await asyncio.gather(*(llm.generate(p, params).collect() for p in prompts)))


@pytest.mark.timeout(900)
async def test_speculative_decoding_gives_the_same_tokens_up_to_near_ties(
    engines: EngineFactory, default_llm: AsyncLLM
) -> None:
    """Drafts are verified exactly against the block model's logits, but a verify step attends over several query
    rows (SDPA) where a plain decode step attends over one (the paged decode kernel): their float32 attention
    differs in the last bits, and an int8 activation block can round the other way, as batching does in int8 (README
    "Speed"). So a greedy answer may part from the draft-free one, only where the draft-free top two were close."""
    speculative = engines(**AUTO, speculative_config=SPEC)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=5)
    want = await asyncio.gather(*(default_llm.generate(c, params).collect() for c in chats))
    got = await asyncio.gather(*(speculative.generate(c, params).collect() for c in chats))
    margins = _parted_margins(want, got)
    print(f"{len(margins)} of {len(PROMPTS)} answers parted, at draft-free margins {margins}")
    assert all(0 <= m < 1.0 for m in margins), margins  # measured: at most 2 of 4 parted, margins 0.075-0.091
    stats = (await speculative.get_scheduler_stats()).spec_decode
    assert stats is not None
    assert stats.num_accepted_tokens > 0  # drafts ran and were accepted, so verification was exercised
    await wait_until_idle(speculative)


def _parted_margins(want: list[Any], got: list[Any]) -> list[float]:
    """Where each of `got`'s greedy answers first parts from `want`'s (the same prompts, `logprobs=5`): `want`'s
    log-prob margin of its token over `got`'s there (asserting `got`'s token is in `want`'s top 5)."""
    margins = []
    for w, g in zip(want, got, strict=True):
        a, b = w.outputs[0].token_ids, g.outputs[0].token_ids
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None:
            assert len(a) == len(b)
            continue
        step = w.outputs[0].logprobs[first]
        assert b[first] in step, (first, a, b)
        margins.append(step[a[first]].logprob - step[b[first]].logprob)
    return margins


@pytest.mark.timeout(900)
async def test_a_cached_prefix_gives_the_tokens_of_a_fresh_prefill_up_to_near_ties(default_llm: AsyncLLM) -> None:
    """A prompt whose first blocks are cached computes only the rest (attention over the cached prefix merged with
    its own by log-sum-exp), which differs from one whole prefill in the last bits: as above, a greedy answer may
    part from the fresh one only at a near-tie."""
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5)
    chats = [[{"role": "user", "content": PROMPTS[0] + " " + p}] for p in PROMPTS]  # a shared prefix of > 2 blocks
    fresh = [await default_llm.generate(c, params).collect() for c in chats[:1]]
    cached = list(await asyncio.gather(*(default_llm.generate(c, params).collect() for c in chats)))
    assert all(o.num_cached_tokens >= 32 for o in cached)  # every one reused the first prompt's blocks
    margins = _parted_margins(fresh, cached[:1])
    print(f"cached against fresh: parted at margins {margins}")
    assert all(0 <= m < 1.0 for m in margins), margins  # measured: parted at 0.005
    await wait_until_idle(default_llm)


async def test_structured_output_follows_its_schema(default_llm: AsyncLLM) -> None:
    # The integer is bounded: greedy, this small model writes digits on ("3233232..."), and only a maximum makes the
    # grammar close the number within max_tokens whatever near-tie a kernel's summation order tips.
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "population": {"type": "integer", "minimum": 0, "maximum": 999_999_999},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    messages = [{"role": "user", "content": "Give the largest city of Japan and its population as JSON."}]
    out = await default_llm.generate(messages, params).collect()
    value = json.loads(out.outputs[0].text)
    assert set(value) == {"city", "population"}
    assert isinstance(value["city"], str)
    assert isinstance(value["population"], int)
    assert 0 <= value["population"] <= 999_999_999


async def test_embeddings_and_prompt_embeddings(default_llm: AsyncLLM, reference_model: Any) -> None:
    out = await default_llm.encode(PROMPTS[:2], PoolingParams(pooling="mean"))
    assert [len(o.embedding) for o in out] == [576, 576]
    for o in out:
        assert math.isclose(math.fsum(x * x for x in o.embedding), 1.0, rel_tol=1e-4)  # normalized by default
    tokenizer = default_llm.get_tokenizer()
    ids = tokenizer.encode("The capital of France is")
    # The file's Q8_0 token embedding: the float32 model's rows equal the block head's (test_block_quant_model.py).
    embeds = reference_model.embed(torch.tensor(ids)).clone()
    by_ids, by_embeds = await _greedy(default_llm, [{"prompt_token_ids": ids}, {"prompt_embeds": embeds}], 8)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
    await wait_until_idle(default_llm)
