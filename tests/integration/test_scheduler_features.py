"""Scheduler features on the real SmolLM2-135M-Instruct: chunked prefill, prefix caching and preemption leave
greedy outputs unchanged; priority scheduling; every block is free after finished, aborted and preempted
requests; request metrics and Prometheus counters.

Outputs are compared with a baseline engine (one large step budget, no prefix caching) token by token: they
must be identical, except that from a position where the baseline's greedy choice was a near-tie (top-1 minus
top-2 logit < MARGIN in a dense reference pass) they may differ, because a different batch shape changes fp32
summation order. Most tokens must be compared before any such divergence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from asyncllm import AsyncLLM, SamplingParams
from tests.integration.conftest import EngineFactory, greedy, wait_until_idle
from tests.reference import greedy_margins

pytestmark = pytest.mark.asyncio(loop_scope="module")

MARGIN = 0.05
SYSTEM = (
    "You are a patient geography tutor for a class of curious twelve-year-old students. Always answer in one "
    "or two short sentences, use simple words, and never invent facts. When a question is about a country, "
    "name its capital city first and then add one interesting fact about that city, such as a famous "
    "building, a river that flows through it, or a food people like to eat there."
)
QUESTIONS = ["What is the capital of France?", "What is the capital of Japan?", "What is the capital of Egypt?"]
SHORT_PROMPTS = [
    "The three primary colors are",
    "A list of fruits: apple, banana,",
    "Once upon a time, in a small village by the sea,",
    "The quick brown fox",
    "Water boils at a temperature of",
]


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def run_one(llm: AsyncLLM, prompt, params: SamplingParams):
    out = None
    async for out in llm.generate(prompt, params):  # noqa: B007 (the last output is the result)
        pass
    assert out is not None
    assert out.finished
    return out


async def run_all(llm: AsyncLLM, prompts: list, params: SamplingParams) -> list:
    return await asyncio.gather(*(run_one(llm, p, params) for p in prompts))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def baseline(model_path: str) -> AsyncIterator[dict]:
    """Greedy outputs of every prompt used here, from a big-budget engine without prefix caching."""
    factory = EngineFactory(model_path)
    llm = factory(engine_process=False, max_num_batched_tokens=4096, enable_prefix_caching=False)
    chats = await run_all(llm, [chat(q) for q in QUESTIONS], greedy(12))
    shorts = await run_all(llm, SHORT_PROMPTS, greedy(40, ignore_eos=True))
    yield {"chat": chats, "short": shorts, "llm_stats": await llm.get_scheduler_stats()}
    await asyncio.to_thread(factory.close)  # off the loop: `close` stops the engines synchronously


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_greedy(reference_model, expected: list, got: list) -> None:
    """Token ids identical to the baseline up to the end, or up to a near-tie where they may part."""
    compared = total = 0
    for want, have in zip(expected, got, strict=True):
        ref_ids, got_ids = want.outputs[0].token_ids, have.outputs[0].token_ids
        total += len(ref_ids)
        index = first_difference(ref_ids, got_ids)
        if index is None:
            compared += len(ref_ids)
            continue
        margin = greedy_margins(reference_model, want.prompt_token_ids, ref_ids)[index]
        assert margin < MARGIN, f"diverged at token {index} with a clear margin {margin:.3f}: {have.prompt!r}"
        compared += index
    assert compared >= 0.5 * total, f"only {compared}/{total} tokens compared before near-tie divergences"


async def test_chunked_prefill_budget_16_gives_same_greedy_outputs(make_llm, reference_model, baseline) -> None:
    llm = make_llm(engine_process=False, max_num_batched_tokens=16, enable_prefix_caching=False)
    got = await run_all(llm, [chat(q) for q in QUESTIONS], greedy(12))
    assert all(len(out.prompt_token_ids) > 3 * 16 for out in got)  # prompts really were chunked
    assert_same_greedy(reference_model, baseline["chat"], got)
    await wait_until_idle(llm)


async def test_prefix_caching_reuses_blocks_and_gives_same_greedy_outputs(make_llm, reference_model, baseline) -> None:
    llm = make_llm(engine_process=False, max_num_batched_tokens=4096)  # prefix caching is on by default
    got = [await run_one(llm, chat(q), greedy(12)) for q in QUESTIONS]  # one after another: later ones hit
    assert got[0].num_cached_tokens == 0
    shared = len(got[0].prompt_token_ids) - 12  # the questions differ only in their last tokens
    for out in got[1:]:
        assert out.num_cached_tokens > 0
        assert out.num_cached_tokens % 16 == 0
        assert shared - 16 <= out.num_cached_tokens <= shared
    again = await run_one(llm, chat(QUESTIONS[0]), greedy(12))  # the whole prompt is cached but the last token
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16
    assert_same_greedy(reference_model, baseline["chat"], got)
    assert_same_greedy(reference_model, baseline["chat"][:1], [again])
    stats = await wait_until_idle(llm)
    assert 0.0 < stats.prefix_cache_hit_rate < 1.0
    assert stats.num_prefix_cache_hits == sum(out.num_cached_tokens for out in [*got, again])


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
async def test_tiny_kv_cache_preempts_and_gives_same_greedy_outputs(
    make_llm, reference_model, baseline, enable_prefix_caching
) -> None:
    # 10 blocks of 16 tokens; 5 prompts of ~10 tokens growing to ~50 need up to 4 blocks each.
    llm = make_llm(engine_process=False, num_kv_blocks=10, enable_prefix_caching=enable_prefix_caching)
    got = await run_all(llm, SHORT_PROMPTS, greedy(40, ignore_eos=True))
    stats = await wait_until_idle(llm)
    assert stats.num_preemptions > 0
    assert [len(out.outputs[0].token_ids) for out in got] == [40] * len(SHORT_PROMPTS)
    assert_same_greedy(reference_model, baseline["short"], got)


async def test_all_blocks_free_after_finished_aborted_and_preempted_requests(make_llm) -> None:
    llm = make_llm(engine_process=False, num_kv_blocks=10)

    async def break_after(prompt: str, num_outputs: int) -> None:
        seen = 0
        async for _ in llm.generate(prompt, greedy(40, ignore_eos=True)):
            seen += 1
            if seen == num_outputs:
                break

    async def abort_after(prompt: str, num_outputs: int) -> str | None:
        stream = llm.generate(prompt, greedy(40, ignore_eos=True))
        outputs = []
        async for out in stream:
            outputs.append(out)
            if len(outputs) == num_outputs:
                await llm.abort(stream.request_id)
        return outputs[-1].outputs[0].finish_reason

    finished = [run_one(llm, p, greedy(40, ignore_eos=True)) for p in SHORT_PROMPTS[:4]]
    results = await asyncio.gather(
        *finished, break_after(SHORT_PROMPTS[4], 3), abort_after("Tell me a story about a dragon.", 2)
    )
    assert [out.outputs[0].finish_reason for out in results[:4]] == ["length"] * 4
    assert results[5] == "abort"
    stats = await wait_until_idle(llm)
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks == 10


@pytest.fixture(params=["thread", pytest.param("process", marks=pytest.mark.mp)])
def engine_mode(request: pytest.FixtureRequest) -> str:
    """Where the engine core runs: a background thread or its own process."""
    return request.param


async def test_priority_late_better_request_is_served_before_waiting_worse_ones(make_llm, engine_mode) -> None:
    llm = make_llm(scheduling_policy="priority", max_num_seqs=1, engine_process=engine_mode == "process")
    order: list[str] = []
    first_token = asyncio.Event()

    async def run(name: str, prompt: str, priority: int) -> None:
        async for out in llm.generate(prompt, greedy(6, ignore_eos=True), request_id=name, priority=priority):
            first_token.set()
            if out.finished:
                assert len(out.outputs[0].token_ids) == 6
                order.append(name)

    worse = [asyncio.create_task(run(f"w{i}", p, 5)) for i, p in enumerate(SHORT_PROMPTS[:3])]
    await first_token.wait()  # w0 runs (max_num_seqs=1); w1, w2 wait
    late = asyncio.create_task(run("late", SHORT_PROMPTS[3], 0))
    await asyncio.gather(*worse, late)
    assert order.index("late") < order.index("w1")
    assert order.index("late") < order.index("w2")
    assert order.index("w1") < order.index("w2")  # FCFS within equal priority
    await wait_until_idle(llm)


async def test_request_metrics_and_prometheus_counters(make_llm) -> None:
    llm = make_llm(engine_process=False)
    assert llm.prometheus_registry is not None
    before = time.time()
    outputs = [out async for out in llm.generate(SHORT_PROMPTS[0], greedy(8, ignore_eos=True))]
    final = outputs[-1].metrics
    assert final is not None
    assert before - 1.0 <= final.arrival_time <= time.time()
    assert final.queue_time is not None
    assert 0.0 <= final.queue_time < 5.0
    assert final.first_scheduled_time is not None
    assert final.first_token_time is not None
    assert final.last_token_time is not None
    assert final.first_scheduled_time <= final.first_token_time < final.last_token_time
    assert final.time_to_first_token is not None
    assert 0.0 < final.time_to_first_token <= time.time() - final.arrival_time
    assert final.mean_inter_token_latency == pytest.approx((final.last_token_time - final.first_token_time) / 7)
    first = outputs[0].metrics
    assert first is not None
    assert first.mean_inter_token_latency is None  # one token so far
    registry = llm.prometheus_registry
    labels = {"model_name": llm.config.model.model}
    deadline = time.monotonic() + 2.0  # the handler records a step's stats just after delivering its outputs
    while registry.get_sample_value("asyncllm:generation_tokens_total", labels) != 8:
        assert time.monotonic() < deadline, "generation_tokens_total never reached 8"
        await asyncio.sleep(0.01)
    assert registry.get_sample_value("asyncllm:prompt_tokens_total", labels) == len(outputs[-1].prompt_token_ids)
    assert registry.get_sample_value("asyncllm:time_to_first_token_seconds_count", labels) == 1
    assert registry.get_sample_value("asyncllm:inter_token_latency_seconds_count", labels) == 7
    success = registry.get_sample_value("asyncllm:request_success_total", {**labels, "finished_reason": "length"})
    assert success == 1
