"""`AsyncLLM.encode` and `{"prompt_embeds": ...}` prompts on the real SmolLM2, in both engine modes.

The engine runs with a 64-token step budget, so prompts over 64 tokens are prefilled in chunks (the pooler
accumulates over them) and share steps with whatever else runs. Reference: HF transformers' `AutoModel` loaded
from the same GGUF file (final-norm `last_hidden_state`, pooled here by hand); its input embeddings give the
prompt-embeddings rows.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch

from asyncllm import (
    AsyncLLM,
    InvalidRequestError,
    PoolingParams,
    SamplingParams,
    StreamIncompleteError,
)
from tests.integration.conftest import greedy, wait_until_idle
from tests.state_probes import tracked_ids

transformers = pytest.importorskip("transformers")

STEP_BUDGET = 64  # max_num_batched_tokens: longer prompts are chunked
SENTENCE = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jugglers near old mills"
WORDS = SENTENCE.split(" ")
PROMPTS = [" ".join(WORDS[(i * 3) % len(WORDS) :] + WORDS * (i % 4)) for i in range(16)]  # 3 to ~75 tokens
REFERENCE_PROMPTS = (0, 3, 11)  # indexes compared with HF (3 and 11 are chunked: 75 and 66 tokens)
BATCH_TOLERANCE = 1e-5  # normalized vectors: batched vs alone (float32 summation order; measured <= 6.1e-7)
REFERENCE_TOLERANCE = 1e-4  # normalized vectors vs HF (other kernels; measured <= 8.6e-7 for mean/last/cls)


@pytest.fixture(scope="module")
def llm_overrides() -> dict[str, Any]:
    """The shared `llm` (both modes) with a 64-token step budget."""
    return {"max_num_batched_tokens": STEP_BUDGET}


@pytest.fixture(scope="module")
def reference(hf_reference: tuple[Any, Any]) -> Any:
    """HF's base `LlamaModel` (what `AutoModel` loads): the session's causal LM without its head."""
    return hf_reference[1].model


_REFERENCE_CACHE: dict[tuple[int, ...], torch.Tensor] = {}  # both engine modes compare with the same forwards


def _reference_hidden(reference: Any, token_ids: list[int]) -> torch.Tensor:
    """[num_tokens, hidden_size] final-norm hidden states of one prompt."""
    key = tuple(token_ids)
    if key not in _REFERENCE_CACHE:
        with torch.no_grad():
            _REFERENCE_CACHE[key] = reference(torch.tensor([token_ids])).last_hidden_state[0]
    return _REFERENCE_CACHE[key]


@pytest.mark.slow
async def test_batch_of_16_equals_each_alone_and_the_reference(llm: AsyncLLM, reference: Any) -> None:
    params = PoolingParams(pooling="mean")
    batch = await llm.encode(PROMPTS, params)
    assert [len(o.prompt_token_ids) for o in batch] == [len(llm.get_tokenizer().encode(p)) for p in PROMPTS]
    assert max(len(o.prompt_token_ids) for o in batch) > STEP_BUDGET  # some prompts were chunked
    for index, (prompt, out) in enumerate(zip(PROMPTS, batch, strict=True)):
        alone = await llm.encode(prompt, params)
        assert out.prompt_token_ids == alone.prompt_token_ids
        assert len(out.embedding) == 576
        assert np.linalg.norm(out.embedding) == pytest.approx(1.0, abs=1e-6)
        np.testing.assert_allclose(out.embedding, alone.embedding, rtol=0, atol=BATCH_TOLERANCE)
        if index in REFERENCE_PROMPTS:  # HF's forward is slow on a shared CPU: a few prompts, one chunked
            expected = torch.nn.functional.normalize(_reference_hidden(reference, out.prompt_token_ids).mean(0), dim=0)
            np.testing.assert_allclose(out.embedding, expected.numpy(), rtol=0, atol=REFERENCE_TOLERANCE)


@pytest.mark.parametrize("pooling", ["last", "cls"])
async def test_last_and_cls_pooling_unnormalized_and_truncated_match_the_reference(
    llm: AsyncLLM, reference: Any, pooling: str
) -> None:
    prompts = [PROMPTS[3], PROMPTS[11]]  # the second is chunked
    outs = await llm.encode(prompts, PoolingParams(pooling=pooling, normalize=False, dimensions=100))
    for out in outs:
        hidden = _reference_hidden(reference, out.prompt_token_ids)
        expected = (hidden[-1] if pooling == "last" else hidden[0])[:100]
        assert len(out.embedding) == 100
        scale = float(expected.abs().max())
        np.testing.assert_allclose(out.embedding, expected.numpy(), rtol=0, atol=REFERENCE_TOLERANCE * scale)


async def test_generation_in_the_same_steps_is_unchanged_and_nothing_is_held(llm: AsyncLLM) -> None:
    gen_prompts = ["Write a short poem about the sea.", PROMPTS[10]]
    params = greedy(12)
    solo = [(await llm.generate(p, params).collect()).outputs[0].token_ids for p in gen_prompts]
    streams = [llm.generate(p, params) for p in gen_prompts]  # submitted first: they share the encode steps
    embeddings = await llm.encode(PROMPTS[:8], PoolingParams())
    together = [(await s.collect()).outputs[0].token_ids for s in streams]
    assert together == solo
    assert len(embeddings) == 8
    await wait_until_idle(llm)  # no KV block is held once the encodes finished


async def test_prefix_cached_prompt_still_pools_every_position(llm: AsyncLLM) -> None:
    prompt = PROMPTS[11]  # several full blocks
    first = await llm.encode(prompt, PoolingParams(pooling="mean"))
    await llm.generate(prompt, greedy(1)).collect()  # its prompt blocks are now in the prefix cache
    again = await llm.encode(prompt, PoolingParams(pooling="mean"))
    assert again.num_cached_tokens == 0  # pooling skips the prefix cache
    np.testing.assert_allclose(again.embedding, first.embedding, rtol=0, atol=BATCH_TOLERANCE)


async def test_encode_refuses_bad_input_and_keeps_serving(llm: AsyncLLM) -> None:
    with pytest.raises(InvalidRequestError, match="dimensions=577"):
        await llm.encode("hi", PoolingParams(dimensions=577))
    with pytest.raises(InvalidRequestError, match="pooling='sum'"):
        await llm.encode(["hi", "there"], PoolingParams(pooling="sum"))
    with pytest.raises(InvalidRequestError, match="empty list"):
        await llm.encode([])
    out = await llm.encode("still serving", PoolingParams(dimensions=3))
    assert len(out.embedding) == 3


async def test_abort_and_cancel_of_an_encode_leave_nothing_behind(llm: AsyncLLM) -> None:
    async def aborted() -> None:
        with pytest.raises(StreamIncompleteError, match="without a vector"):
            await llm.encode(PROMPTS[7], request_id="to-abort")

    async def cancelled() -> None:
        await llm.encode(PROMPTS[:4], request_id="to-cancel")
        pytest.fail("the encode was cancelled; it cannot finish")

    async with anyio.create_task_group() as tg:
        tg.start_soon(aborted)
        await anyio.wait_all_tasks_blocked()  # submitted; it waits for the engine
        await llm.abort("to-abort")
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancelled)
            await anyio.wait_all_tasks_blocked()
            scope.cancel()
    assert tracked_ids(llm._output_processor) == (0, 0, 0)
    await wait_until_idle(llm)  # the engine freed every block of the aborted requests
    assert len((await llm.encode("after", PoolingParams(dimensions=4))).embedding) == 4


async def test_prompt_embeds_equal_to_the_embedding_rows_give_the_ids_greedy_output(
    llm: AsyncLLM, reference: Any
) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = ["The capital of France is", PROMPTS[15]]  # the second is chunked
    ids = [tokenizer.encode(p) for p in prompts]
    table = reference.get_input_embeddings().weight.detach()
    params = greedy(10)
    by_ids = [llm.generate({"prompt_token_ids": i}, params) for i in ids]
    by_embeds = [llm.generate({"prompt_embeds": table[torch.tensor(i)].clone()}, params) for i in ids]
    outs_ids = [(await s.collect()) for s in by_ids]
    outs_embeds = [(await s.collect()) for s in by_embeds]
    for out, i in zip(outs_embeds, ids, strict=True):
        assert out.prompt_token_ids == [0] * len(i)  # placeholders of the prompt's length
        assert out.num_cached_tokens == 0
    from_ids, from_embeds = [o.outputs[0].token_ids for o in outs_ids], [o.outputs[0].token_ids for o in outs_embeds]
    assert from_embeds == from_ids
    assert all(len(t) == 10 for t in from_ids)
    await wait_until_idle(llm)


def test_prompt_embeds_of_the_wrong_width_are_refused(llm: AsyncLLM) -> None:
    with pytest.raises(InvalidRequestError, match="hidden size 576"):
        llm.generate({"prompt_embeds": torch.zeros(3, 512)}, SamplingParams(max_tokens=2))
