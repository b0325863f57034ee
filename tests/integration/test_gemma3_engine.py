"""Gemma 3 270M served by the engine (`EngineArgs(model="gemma-3-270m")`, engine core in a thread): greedy text as
HF's, a prompt past the 512-token sliding window through chunked prefill, the prefix cache and a batch, and chat
with a user-given template on a base model (none of its own).

Expected texts are HF transformers' greedy continuations of the same GGUF file (measured once, top-2 margins of
6 logits or more at every step; `test_gemma3_parity.py` checks the logits themselves).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio

from asyncllm import AsyncLLM, EngineArgs, InvalidRequestError, PoolingParams
from asyncllm.structured_outputs import StructuredOutputsParams
from tests.integration.conftest import greedy, wait_until_idle
from tests.integration.test_gemma3_parity import LONG_TEXT

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

FRANCE = "The capital of France is"
FRANCE_CONTINUATION = " the capital of the country of France."
LONG_CONTINUATION = " split into many channels and build a delta of fertile land."  # HF, 12 tokens
# A Gemma-style turn template, given by the user (the base model has none).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def llm() -> AsyncIterator[AsyncLLM]:
    args = EngineArgs(
        model="gemma-3-270m",
        engine_process=False,
        max_model_len=1024,
        num_kv_blocks=70,  # small enough for the preemption test, enough for every other test's batch
        max_num_batched_tokens=64,  # a 700-token prompt is prefilled in 11 chunks
        chat_template=TEMPLATE,
        quantization=None,  # float32 weights: compared with transformers' float32 below
    )
    async with AsyncLLM.from_engine_args(args) as engine:
        yield engine


async def test_greedy_text_matches_transformers(llm: AsyncLLM) -> None:
    out = await llm.generate(FRANCE, greedy(9)).collect()
    assert out.outputs[0].text.startswith(FRANCE_CONTINUATION)
    assert out.prompt_token_ids[0] == 2  # <bos>


async def test_long_prompt_chunked_cached_and_batched(llm: AsyncLLM) -> None:
    ids = llm.get_tokenizer().encode(LONG_TEXT * 12)[:700]
    prompt = {"prompt_token_ids": ids}
    first = await llm.generate(prompt, greedy(12)).collect()
    assert first.outputs[0].text == LONG_CONTINUATION
    again = await llm.generate(prompt, greedy(12)).collect()  # the prompt's full blocks come from the prefix cache
    assert again.num_cached_tokens >= 640
    assert again.outputs[0].text == LONG_CONTINUATION
    streams = [llm.generate(p, greedy(12)) for p in ({"prompt_token_ids": ids[:650] + ids[:50]}, FRANCE, prompt)]
    batched = [await s.collect() for s in streams]
    assert batched[1].outputs[0].text.startswith(FRANCE_CONTINUATION)
    assert batched[2].outputs[0].text == LONG_CONTINUATION
    await wait_until_idle(llm)


async def test_chat_uses_the_given_template(llm: AsyncLLM) -> None:
    out = await llm.chat([{"role": "user", "content": "Say hello."}], greedy(8))
    assert out.prompt.startswith("<bos><start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n")
    assert len(out.outputs[0].token_ids) >= 1


async def test_chat_without_a_template_is_refused(llm: AsyncLLM) -> None:
    tokenizer = llm.get_tokenizer()
    given, tokenizer.chat_template = tokenizer.chat_template, None  # as the model ships: a base model
    try:
        with pytest.raises(InvalidRequestError, match=r"no chat template.*chat_template"):
            await llm.chat([{"role": "user", "content": "Hi"}], greedy(4))
    finally:
        tokenizer.chat_template = given


async def test_preemption_recomputes_windowed_layers_exactly(llm: AsyncLLM) -> None:
    """Two 540-token prompts (past the window) decoding 60 tokens each in the 70-block cache (the two need 76):
    one is preempted and recomputed, and both answers equal the ones computed alone. The batched run carries a
    cache salt, so its prompts are computed afresh rather than read from the blocks the solo runs cached."""
    ids = llm.get_tokenizer().encode(LONG_TEXT * 12)
    params = greedy(60, ignore_eos=True)
    alone = []
    for part in (ids[:540], ids[100:640]):
        out = await llm.generate({"prompt_token_ids": part}, params).collect()
        alone.append(out.outputs[0].token_ids)
    before = (await llm.get_scheduler_stats()).num_preemptions
    salted = [{"prompt_token_ids": p, "cache_salt": "batched"} for p in (ids[:540], ids[100:640])]
    streams = [llm.generate(p, params) for p in salted]
    together = [(await s.collect()).outputs[0].token_ids for s in streams]
    assert (await llm.get_scheduler_stats()).num_preemptions >= before + 1
    assert together == alone


async def test_encode_pools_normalized_vectors_batched_as_alone(llm: AsyncLLM) -> None:
    """`encode()` on Gemma (hidden states checked against HF in `test_gemma3_parity.py`): 640-wide unit vectors, a
    batch equal to each prompt alone (a 700-token prompt is pooled over 11 chunks)."""
    ids = llm.get_tokenizer().encode(LONG_TEXT * 12)[:700]
    prompts = [FRANCE, {"prompt_token_ids": ids}, "Der schnelle braune Fuchs"]
    batch = await llm.encode(prompts, PoolingParams(pooling="mean"))
    assert isinstance(batch, list)
    for prompt, out in zip(prompts, batch, strict=True):
        vector = np.asarray(out.embedding)
        assert vector.shape == (640,)
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
        alone = await llm.encode(prompt, PoolingParams(pooling="mean"))
        assert not isinstance(alone, list)
        np.testing.assert_allclose(alone.embedding, vector, atol=1e-5)
    assert float(np.dot(batch[0].embedding, batch[2].embedding)) < 0.999  # different texts, different vectors


async def test_structured_outputs_with_the_sentencepiece_vocabulary(llm: AsyncLLM) -> None:
    """xgrammar reads Gemma's vocabulary as byte fallback ("▁" is a space, `<0xNN>` are bytes): a choice and a regex
    with spaces, and a JSON schema, are followed exactly."""
    choice = greedy(12, structured_outputs=StructuredOutputsParams(choice=["New York City", "Paris, France"]))
    out = await llm.generate("Q: Which city is the capital of France?\nA:", choice).collect()
    assert out.outputs[0].text in ("New York City", "Paris, France")
    regex = greedy(24, structured_outputs=StructuredOutputsParams(regex=r"The capital is [A-Z][a-z]+ \(\d{4}\)\."))
    out = await llm.generate(FRANCE, regex).collect()
    assert re.fullmatch(r"The capital is [A-Z][a-z]+ \(\d{4}\)\.", out.outputs[0].text), out.outputs[0].text
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    params = greedy(48, structured_outputs=StructuredOutputsParams(json=schema))
    out = await llm.generate("A JSON record of the capital of France: ", params).collect()
    record = json.loads(out.outputs[0].text)
    assert set(record) == {"city", "country"}
    assert all(isinstance(v, str) and len(v) <= 20 for v in record.values())
