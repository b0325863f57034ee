"""N-gram speculative decoding and repetition detection on the real SmolLM2 engine.

Greedy outputs with speculation equal those without, token for token, on 20 prompts (extractive ones among them)
run concurrently with chunked prefill (64-token budget), prefix caching and preemption (a small KV cache), in
thread and process mode; stop token, stop string and max_tokens cut the same token as without speculation;
every KV block is free afterwards; the sampled distribution of the first drafted position matches plain decoding;
a looping prompt finishes with "repetition" long before max_tokens while a normal answer is not cut.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from asyncllm import AsyncLLM, RepetitionDetectionParams, RequestOutput, SamplingParams
from tests.integration.conftest import MODES, EngineFactory, wait_until_idle

pytestmark = pytest.mark.slow

# Always k drafts ("adaptive": false): these tests check that verification is exact wherever drafts run, so every
# matching n-gram must really be drafted. The adaptive policy only chooses how many drafts (unit tests:
# tests/unit/test_draft_policy.py); outputs never depend on it, which the greedy test below also checks with it on.
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}
ADAPTIVE_SPEC = {**SPEC, "adaptive": True}
MAX_TOKENS = 32
PROMPTS = [
    "Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Fix the typo in this code and print the fixed code:\ndef add(a, b):\n    retrun a + b\n",
    "Repeat after me: the quick brown fox jumps over the lazy dog.",
    "Copy this sentence: Paris is the capital of France and Berlin is the capital of Germany.",
    "Fix the typo in this code:\nfor i in rnage(10):\n    print(i)\n",
    "Rewrite this list in reverse order: one, two, three, four, five.",
    'Repeat the following JSON: {"name": "Ada", "age": 36, "city": "London"}',
    "Fix the spelling: 'The wether is nice todya.'",
    "Summarize: The cat sat on the mat. The cat was happy. The mat was red.",
    "Extract the numbers from: I have 3 apples, 5 pears and 12 plums.",
    "What is the capital of France?",
    "Tell me a short story about a dragon.",
    "Explain what a CPU does in two sentences.",
    "Give me three tips for learning Python.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Name three colors of the rainbow.",
    "Why is the sky blue?",
    "Write a limerick about a cat.",
    "What are the benefits of exercise?",
]


def _overrides(spec: bool, process: bool = False, adaptive: bool = False) -> dict[str, Any]:
    """Chunked prefill (64-token budget), prefix caching and a KV cache too small for all 20 requests at once."""
    return {
        "engine_process": process,
        "max_model_len": 256,
        "num_kv_blocks": 20,
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": True,
        "speculative_config": (ADAPTIVE_SPEC if adaptive else SPEC) if spec else None,
    }


@pytest.fixture(scope="module")
def engines(model_path: str) -> Iterator[EngineFactory]:
    """The module's engines, each built on first use and shut down at the module's end."""
    factory = EngineFactory(model_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def reference(engines: EngineFactory) -> AsyncLLM:
    return engines(**_overrides(spec=False))


@pytest.fixture(scope="module")
def speculative(engines: EngineFactory) -> AsyncLLM:
    """The speculative engine in thread mode (most tests)."""
    return engines(**_overrides(spec=True))


@pytest.fixture(scope="module")
def speculative_process(engines: EngineFactory) -> AsyncLLM:
    """The speculative engine in its own process, with the adaptive draft length (the default policy)."""
    return engines(**_overrides(spec=True, process=True, adaptive=True))


_REFERENCE_OUTPUTS: list[RequestOutput] = []  # the reference engine's greedy answers, computed once per module


async def _chat_all(llm: AsyncLLM, params: SamplingParams) -> list[RequestOutput]:
    results: list[Any] = [None] * len(PROMPTS)

    async def one(i: int) -> None:
        results[i] = await llm.chat([{"role": "user", "content": PROMPTS[i]}], params)

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return results


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", MODES)
async def test_greedy_outputs_equal_without_speculation(
    reference: AsyncLLM, mode: str, request: pytest.FixtureRequest
) -> None:
    speculative: AsyncLLM = request.getfixturevalue("speculative" if mode == "thread" else "speculative_process")

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    if not _REFERENCE_OUTPUTS:
        _REFERENCE_OUTPUTS.extend(await _chat_all(reference, params))
    expected = _REFERENCE_OUTPUTS
    before = (await speculative.get_scheduler_stats()).num_preemptions
    got = await _chat_all(speculative, params)
    for prompt, want, have in zip(PROMPTS, expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids, prompt
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason
    stats = await speculative.get_scheduler_stats()
    assert stats.num_preemptions > before  # the small KV cache forced preemptions during the run
    assert stats.spec_decode is not None
    assert stats.spec_decode.num_accepted_tokens > 0
    metrics = [out.spec_decode_metrics for out in got]
    assert all(m is not None for m in metrics)
    assert sum(m.num_accepted_tokens for m in metrics if m is not None) > 0
    extractive = got[0].spec_decode_metrics
    assert extractive is not None
    assert extractive.num_accepted_tokens >= len(got[0].outputs[0].token_ids) // 4  # the list is copied
    await wait_until_idle(speculative, within=30.0)


async def test_stop_token_stop_string_and_max_tokens_cut_the_same_token(
    reference: AsyncLLM, speculative: AsyncLLM
) -> None:
    messages = [{"role": "user", "content": PROMPTS[0]}]
    free = await reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    tokens = free.outputs[0].token_ids
    cut = 12  # inside the copied list, where drafts are accepted in runs
    stop_token = tokens[cut]
    stop_text = free.outputs[0].text.split()[4]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_token], logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop_text]),
        SamplingParams(temperature=0.0, max_tokens=cut + 1, logprobs=0),
    ]
    for params in cases:
        want = (await reference.chat(messages, params)).outputs[0]
        have = (await speculative.chat(messages, params)).outputs[0]
        assert have.token_ids == want.token_ids
        assert have.text == want.text
        assert (have.finish_reason, have.stop_reason) == (want.finish_reason, want.stop_reason)
        if params.logprobs is not None:
            assert have.logprobs is not None
            assert want.logprobs is not None
            assert len(have.logprobs) == len(have.token_ids)
            for a, b in zip(have.logprobs, want.logprobs, strict=True):
                assert a.keys() == b.keys()
                for token_id in a:
                    assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=1e-3)
    assert len(have.token_ids) == cut + 1
    await wait_until_idle(speculative, within=30.0)


async def test_penalties_and_min_tokens_apply_per_draft_position(reference: AsyncLLM, speculative: AsyncLLM) -> None:
    """Penalties count the drafts before each verified position, min_tokens masks by position: greedy ids equal."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        repetition_penalty=1.05,
        frequency_penalty=0.1,
        presence_penalty=0.1,
        min_tokens=20,  # the short answer to "What is 12 times 7?" must go on past its EOS
    )

    before = (await speculative.get_scheduler_stats()).spec_decode
    for prompt in [*PROMPTS[:3], PROMPTS[15]]:
        messages = [{"role": "user", "content": prompt}]
        want = await reference.chat(messages, params)
        have = await speculative.chat(messages, params)
        assert have.outputs[0].token_ids == want.outputs[0].token_ids, prompt
    after = (await speculative.get_scheduler_stats()).spec_decode
    assert before is not None
    assert after is not None
    assert after.num_accepted_tokens > before.num_accepted_tokens


async def test_structured_output_requests_get_no_drafts_and_stay_valid(speculative: AsyncLLM) -> None:
    """Drafts are not proposed for structured-output requests (documented); they decode as before, next to a
    free request that is speculated in the same steps."""
    from asyncllm import StructuredOutputsParams

    regex = "(apples, bananas, cherries, )+"
    constrained = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    free = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    messages = [{"role": "user", "content": PROMPTS[0]}]
    results = await _gather(speculative.chat(messages, constrained), speculative.chat(messages, free))
    structured, unconstrained = results
    assert structured.spec_decode_metrics is not None
    assert structured.spec_decode_metrics.num_drafts == 0
    text = structured.outputs[0].text
    assert text.startswith("apples, bananas, cherries, ")
    assert set(text.split(", ")) <= {"apples", "bananas", "cherries", ""}
    assert unconstrained.spec_decode_metrics is not None
    assert unconstrained.spec_decode_metrics.num_drafts > 0


async def _gather(*coroutines: Any) -> list[Any]:
    results: list[Any] = [None] * len(coroutines)

    async def one(i: int) -> None:
        results[i] = await coroutines[i]

    async with anyio.create_task_group() as tg:
        for i in range(len(coroutines)):
            tg.start_soon(one, i)
    return results


def _two_sample_chi_square(a: Counter[int], b: Counter[int], min_expected: float = 5.0) -> tuple[float, int]:
    """Chi-square statistic of two samples over the tokens both saw often enough (rare ones pooled)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    keys = [k for k in set(a) | set(b) if (a[k] + b[k]) * min(total_a, total_b) / (total_a + total_b) >= min_expected]
    cells = [(a[k], b[k]) for k in keys]
    cells.append((total_a - sum(x for x, _ in cells), total_b - sum(y for _, y in cells)))
    cells = [c for c in cells if sum(c) > 0]
    stat = 0.0
    for x, y in cells:
        pooled = (x + y) / (total_a + total_b)
        for observed, total in ((x, total_a), (y, total_b)):
            stat += (observed - pooled * total) ** 2 / (pooled * total)
    return stat, len(cells) - 1


def _chi_square_critical_0_001(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at 1 - 0.001 (z = 3.0902)."""
    return df * (1 - 2 / (9 * df) + 3.0902 * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.timeout(600)
async def test_sampled_distribution_of_a_drafted_position_matches(reference: AsyncLLM, speculative: AsyncLLM) -> None:
    """The second token (the first position verified against drafts) over 400 draws per engine."""
    prompt = "apple banana cherry apple banana cherry apple banana cherry apple"
    params = SamplingParams(n=100, temperature=1.0, max_tokens=2)

    async def second_tokens(llm: AsyncLLM) -> Counter[int]:
        counts: Counter[int] = Counter()
        for _ in range(4):
            out = await llm.generate(prompt, params).collect()
            counts.update(c.token_ids[1] for c in out.outputs if len(c.token_ids) == 2)
        return counts

    before = (await speculative.get_scheduler_stats()).spec_decode
    plain, spec = await second_tokens(reference), await second_tokens(speculative)
    after = (await speculative.get_scheduler_stats()).spec_decode
    assert before is not None
    assert after is not None
    assert after.num_drafts > before.num_drafts  # the position was really verified against drafts
    stat, df = _two_sample_chi_square(plain, spec)
    assert df >= 1
    assert stat < _chi_square_critical_0_001(df), (plain.most_common(5), spec.most_common(5))


async def test_repetition_detection_stops_a_loop_and_never_cuts_a_normal_answer(speculative: AsyncLLM) -> None:
    detection = RepetitionDetectionParams(max_pattern_size=20, min_count=3)

    loop_prompt = "I like cats. I like cats. I like cats."
    looping = await speculative.generate(
        loop_prompt, SamplingParams(temperature=0.0, max_tokens=200, repetition_detection=detection)
    ).collect()
    plain = await speculative.generate(loop_prompt, SamplingParams(temperature=0.0, max_tokens=200)).collect()
    out = looping.outputs[0]
    assert out.finish_reason == "repetition"
    assert out.stop_reason == "repetition_detected"
    assert len(out.token_ids) <= 40
    assert plain.outputs[0].finish_reason == "length"  # without detection the loop burns max_tokens
    assert plain.outputs[0].token_ids[: len(out.token_ids)] == out.token_ids
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    normal = await speculative.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=100, repetition_detection=detection)
    )
    free = await speculative.chat(messages, SamplingParams(temperature=0.0, max_tokens=100))
    assert normal.outputs[0].finish_reason == "stop"
    assert normal.outputs[0].token_ids == free.outputs[0].token_ids
    await wait_until_idle(speculative, within=30.0)


@pytest.mark.mp
async def test_tensor_parallel_mp_workers_verify_the_same_drafts(reference: AsyncLLM, make_llm: EngineFactory) -> None:
    """TP=3 over `mp` worker processes: every rank gets the drafts in the SchedulerOutput; greedy ids unchanged."""
    engine = make_llm(
        engine_process=False,
        max_model_len=256,
        num_kv_blocks=32,
        distributed_executor_backend="mp",
        tensor_parallel_size=3,
        speculative_config=SPEC,
    )

    params = SamplingParams(temperature=0.0, max_tokens=24)
    for prompt in PROMPTS[:2]:
        messages = [{"role": "user", "content": prompt}]
        want = await reference.chat(messages, params)
        have = await engine.chat(messages, params)
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.spec_decode_metrics is not None
        assert have.spec_decode_metrics.num_drafts > 0
