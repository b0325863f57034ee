"""Validation at submission and sampling edge cases on the real SmolLM2 engine, in both modes (issue 12):
numeric ranges (the same InvalidRequestError in thread and process mode, never an encoder OverflowError),
tiny temperatures are greedy, the text of a stop token is not in the output, a request that can never fit
the KV cache is refused at submission."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from asyncllm import AsyncLLM, InvalidRequestError, RequestOutputKind, SamplingParams
from tests.integration.conftest import EngineFactory, collect, greedy, wait_until_idle

DOGS = [{"role": "user", "content": "Tell me one short fact about dogs."}]
PARIS = [{"role": "user", "content": "What is the capital of France?"}]  # a short answer, then EOS
HUGE = 2**64 + 5


@pytest.mark.parametrize(
    ("field", "value"),
    [("seed", HUGE), ("max_tokens", HUGE), ("top_k", HUGE), ("temperature", HUGE), ("stop_token_ids", [HUGE])],
)
async def test_a_number_out_of_range_is_an_invalid_request_in_both_modes(llm: AsyncLLM, field: str, value: Any) -> None:
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)  # set after construction: the check at submission must catch it

    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field}="):
        llm.generate("Hello", params)
    out = await llm.generate("Hello", greedy(3)).collect()  # the engine keeps serving
    assert len(out.outputs[0].token_ids) == 3
    await wait_until_idle(llm)


async def test_a_seed_in_range_is_served_and_reproducible(llm: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=6, seed=2**63 - 1, temperature=1.0)
    first = await llm.generate(DOGS, params).collect()
    again = await llm.generate(DOGS, params).collect()
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    assert len(first.outputs[0].token_ids) == 6


@pytest.mark.parametrize("temperature", [1e-44, 1e-38, 1e-6])
async def test_a_tiny_temperature_gives_the_greedy_answer(llm: AsyncLLM, temperature: float) -> None:
    expected = await llm.generate(DOGS, greedy(12)).collect()
    got = await llm.generate(DOGS, SamplingParams(max_tokens=12, temperature=temperature)).collect()
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.outputs[0].text == expected.outputs[0].text
    assert got.outputs[0].text.strip()  # the failing input gave "" (EOS at every step)


async def test_the_text_of_a_stop_token_id_is_not_in_the_output(llm: AsyncLLM) -> None:
    tokenizer = llm.get_tokenizer()
    free = await llm.generate(DOGS, greedy(24)).collect()
    answer = free.outputs[0].token_ids
    (are,) = tokenizer.hf.encode(" are", add_special_tokens=False).ids
    stop_id = are if are in answer else answer[3]
    k = answer.index(stop_id)
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        outs = await collect(llm.generate(DOGS, greedy(24, kind, stop_token_ids=[stop_id])))
        text = "".join(c.text for o in outs for c in o.outputs)
        ids = [t for o in outs for c in o.outputs for t in c.token_ids]
        if kind == RequestOutputKind.CUMULATIVE:
            text, ids = outs[-1].outputs[0].text, outs[-1].outputs[0].token_ids
        assert ids == answer[: k + 1]  # the stop token's id stays
        assert text == tokenizer.hf.decode(answer[:k]), text  # its text does not
        assert outs[-1].outputs[0].finish_reason == "stop"
        assert outs[-1].outputs[0].stop_reason == stop_id
    kept = await llm.generate(DOGS, greedy(24, stop_token_ids=[stop_id], include_stop_str_in_output=True)).collect()
    assert kept.outputs[0].text == tokenizer.hf.decode(answer[: k + 1])


async def test_an_eos_stopped_answer_does_not_end_in_the_eos_text(llm: AsyncLLM) -> None:
    eos = llm.get_tokenizer().eos_token_id
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        params = greedy(200, kind, skip_special_tokens=False)
        outs = await collect(llm.generate(PARIS, params))
        last = outs[-1].outputs[0]
        assert last.finish_reason == "stop"
        assert last.stop_reason is None
        text = "".join(c.text for o in outs for c in o.outputs) if kind == RequestOutputKind.DELTA else last.text
        delta = kind == RequestOutputKind.DELTA
        ids = [t for o in outs for c in o.outputs for t in c.token_ids] if delta else last.token_ids
        assert ids[-1] == eos
        assert text.strip(), text
        assert "<|im_end|>" not in text, text


@pytest.fixture(scope="module")
def small_llm(mode: str, model_path: str) -> Iterator[AsyncLLM]:
    """An engine whose KV cache holds 4 blocks of 16 tokens (max_model_len 8192 asked, 64 fit)."""
    factory = EngineFactory(model_path)
    yield factory(engine_process=mode == "process", num_kv_blocks=4, max_model_len=8192)
    factory.close()


@pytest.mark.parametrize(
    ("num_prompt_tokens", "max_tokens"),
    [(100, 4), (64, 1), (40, 40), (63, 2)],
)
async def test_a_request_that_can_never_fit_the_kv_cache_is_refused_at_submission(
    small_llm: AsyncLLM, num_prompt_tokens: int, max_tokens: int
) -> None:
    prompt = {"prompt_token_ids": [1000 + i for i in range(num_prompt_tokens)]}
    with pytest.raises(InvalidRequestError, match=r"KV cache holds 64 tokens \(4 blocks of 16\)"):
        small_llm.generate(prompt, greedy(max_tokens, ignore_eos=True))
    stats = await small_llm.get_scheduler_stats()
    assert stats.num_waiting_reqs == stats.num_running_reqs == 0  # nothing reached the engine


@pytest.mark.slow
async def test_requests_that_fill_the_whole_kv_cache_all_finish(small_llm: AsyncLLM) -> None:
    """The largest requests that fit (prompt + max_tokens = 64 tokens = every block) finish, also three at once
    (n=3: they take turns through preemption), never waiting forever."""

    prompt = {"prompt_token_ids": [1000 + i for i in range(40)]}
    with anyio.fail_after(600):
        out = await small_llm.generate(prompt, SamplingParams(n=3, max_tokens=24, ignore_eos=True)).collect()
    assert [len(c.token_ids) for c in out.outputs] == [24, 24, 24]
    await wait_until_idle(small_llm, within=30.0)
