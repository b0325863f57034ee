"""GenerateOutputStream and its one-slot collector: kinds, merging under a slow consumer, close, errors."""

from __future__ import annotations

import asyncio
import gc

import pytest
from tokenizers import Tokenizer as HFTokenizer

from asyncllm import (
    EngineDeadError,
    EngineGenerateError,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    StreamClosedError,
)
from asyncllm.errors import StreamIncompleteError
from asyncllm.messages.engine import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from asyncllm.outputs import CompletionOutput, Usage
from asyncllm.processing.output_processor import OutputProcessor
from asyncllm.streams import GenerateOutputStream, RequestOutputCollector

TEXT = "Streams merge deltas: ünïcödé 😀 and spaces  kept."


@pytest.fixture(scope="module")
def hf(model_path: str) -> HFTokenizer:
    from asyncllm.model.loading.tokenizer import Tokenizer

    return Tokenizer.load(model_path).hf


def output(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    reason = "length" if finished else None
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, ids, reason)], finished=finished)


class Aborts:
    """Records abort callbacks."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def __call__(self, request_id: str) -> None:
        self.ids.append(request_id)


def make_stream(kind: RequestOutputKind = RequestOutputKind.DELTA) -> tuple[GenerateOutputStream, Aborts]:
    aborts = Aborts()
    collector = RequestOutputCollector(kind)
    return GenerateOutputStream("r", collector, aborts, loop=asyncio.get_running_loop()), aborts


async def feed(hf: HFTokenizer, kind: RequestOutputKind, consume_every: int) -> list[RequestOutput]:
    """Run TEXT through the real output processor one token per step; the consumer reads every n steps."""
    processor = OutputProcessor(hf)
    collector = RequestOutputCollector(kind)
    processor.add_request(EngineCoreRequest("r", [1], SamplingParams(output_kind=kind)), None, collector)
    ids = hf.encode(TEXT).ids
    seen = []
    for i, token in enumerate(ids):
        reason = FinishReason.LENGTH if i == len(ids) - 1 else None
        processor.process_outputs([EngineCoreOutput("r", [token], finish_reason=reason)])
        if i % consume_every == 0 or reason is not None:
            out = collector.get_nowait()
            if out is not None:
                seen.append(out)
    return seen


@pytest.mark.parametrize("consume_every", [1, 3, 7, 1000])
async def test_delta_merging_under_a_slow_consumer_keeps_the_text(hf: HFTokenizer, consume_every: int) -> None:
    outputs = await feed(hf, RequestOutputKind.DELTA, consume_every)
    ids = hf.encode(TEXT).ids
    assert "".join(o.outputs[0].text for o in outputs) == TEXT
    assert [t for o in outputs for t in o.outputs[0].token_ids] == ids
    assert [o.finished for o in outputs].count(True) == 1
    assert outputs[-1].finished
    assert outputs[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
async def test_cumulative_and_final_replace_under_a_slow_consumer(hf: HFTokenizer, kind: RequestOutputKind) -> None:
    outputs = await feed(hf, kind, consume_every=5)
    assert outputs[-1].outputs[0].text == TEXT
    assert outputs[-1].finished
    assert [o.finished for o in outputs].count(True) == 1


async def test_collector_holds_one_output_however_many_are_put() -> None:
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    for i in range(1000):
        collector.put(output("a", [i]))
    merged = collector.get_nowait()
    assert merged is not None
    assert merged.outputs[0].text == "a" * 1000
    assert merged.outputs[0].token_ids == list(range(1000))
    assert collector.get_nowait() is None


async def test_stream_yields_until_finished_then_stops() -> None:
    stream, aborts = make_stream()
    stream._collector.put(output("a", [1]))
    assert (await stream.__anext__()).outputs[0].text == "a"
    stream._collector.put(output("b", [2], finished=True))
    rest = [o async for o in stream]
    assert [o.finished for o in rest] == [True]
    assert stream.finished
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    await stream.aclose()
    assert aborts.ids == []  # finished requests are not aborted


async def test_stream_waits_for_the_producer() -> None:
    stream, _ = make_stream()

    async def produce() -> None:
        await asyncio.sleep(0.01)
        stream._collector.put(output("late", [1], finished=True))

    task = asyncio.create_task(produce())
    assert (await asyncio.wait_for(stream.__anext__(), 5)).outputs[0].text == "late"
    await task


async def test_aclose_is_idempotent_and_aborts_once() -> None:
    stream, aborts = make_stream()
    await stream.aclose()
    await stream.aclose()
    assert aborts.ids == ["r"]
    assert stream.closed


async def test_use_after_close_raises_stream_closed() -> None:
    stream, _ = make_stream()
    await stream.aclose()
    with pytest.raises(StreamClosedError):
        await stream.__anext__()


async def test_async_with_closes_the_stream() -> None:
    stream, aborts = make_stream()
    async with stream as s:
        assert s is stream
    assert aborts.ids == ["r"]


@pytest.mark.parametrize("error", [EngineDeadError(), EngineGenerateError("request failed")])
async def test_errors_are_raised_after_the_waiting_output(error: Exception) -> None:
    stream, aborts = make_stream()
    stream._collector.put(output("a", [1]))
    stream._collector.put_error(error)
    assert (await stream.__anext__()).outputs[0].text == "a"
    with pytest.raises(type(error)):
        await stream.__anext__()
    await stream.aclose()
    assert aborts.ids == []


async def test_error_wakes_a_waiting_consumer() -> None:
    stream, _ = make_stream()
    waiter = asyncio.create_task(stream.__anext__())
    await asyncio.sleep(0)
    stream._collector.put_error(EngineDeadError())
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(waiter, 5)


async def test_cancelling_the_consumer_aborts_the_request() -> None:
    stream, aborts = make_stream()
    waiter = asyncio.create_task(stream.__anext__())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert aborts.ids == ["r"]
    assert stream.closed


async def test_dropping_an_unfinished_stream_schedules_an_abort() -> None:
    stream, aborts = make_stream()
    del stream
    gc.collect()
    await asyncio.sleep(0)
    assert aborts.ids == ["r"]


def test_dropping_a_stream_of_a_closed_loop_is_silent() -> None:
    loop = asyncio.new_event_loop()
    aborts = Aborts()
    stream = GenerateOutputStream("r", RequestOutputCollector(RequestOutputKind.DELTA), aborts, loop=loop)
    loop.close()
    del stream
    gc.collect()
    assert aborts.ids == []


# ---- collect() ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(RequestOutputKind))
async def test_collect_gives_the_full_final_output_with_usage_for_every_kind(
    hf: HFTokenizer, kind: RequestOutputKind
) -> None:
    processor = OutputProcessor(hf)
    collector = RequestOutputCollector(kind)
    params = SamplingParams(output_kind=kind, logprobs=1)
    processor.add_request(EngineCoreRequest("r", [1, 2], params), None, collector)
    stream = GenerateOutputStream("r", collector, Aborts(), loop=asyncio.get_running_loop())
    ids = hf.encode(TEXT).ids

    async def produce() -> None:
        for i, token in enumerate(ids):
            reason = FinishReason.LENGTH if i == len(ids) - 1 else None
            lists = LogprobsLists([[token]], [[-1.0]], [1])
            processor.process_outputs([EngineCoreOutput("r", [token], reason, num_cached_tokens=1, new_logprobs=lists)])
            if i % 4 == 0:
                await asyncio.sleep(0)

    producer = asyncio.create_task(produce())
    result = await stream.collect()
    await producer
    completion = result.outputs[0]
    assert (completion.text, completion.token_ids, completion.finish_reason) == (TEXT, ids, "length")
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(ids)
    assert completion.cumulative_logprob == pytest.approx(-len(ids))
    assert result.finished
    assert result.usage == Usage(num_prompt_tokens=2, num_generated_tokens=len(ids), num_cached_tokens=1)


async def test_collect_raises_instead_of_returning_a_partial_result() -> None:
    stream, _ = make_stream()
    stream._collector.put(output("a", [1]))
    assert (await stream.__anext__()).outputs[0].text == "a"
    stream._collector.put(output("b", [2], finished=True))
    with pytest.raises(StreamIncompleteError, match="partly consumed"):
        await stream.collect()
    closed, _ = make_stream()
    await closed.aclose()
    with pytest.raises(StreamIncompleteError, match="ended unfinished"):
        await closed.collect()


@pytest.mark.parametrize("lag", [False, True])
async def test_collect_merges_n_completions_by_index(lag: bool) -> None:
    """DELTA pieces of two completions arrive interleaved, one per loop turn (or all at once, merging in the
    slot); collect() concatenates them per index."""
    stream, _ = make_stream(RequestOutputKind.DELTA)
    parts = [(1, "x", False), (0, "a", False), (1, "y", True), (0, "b", True)]

    async def produce() -> None:
        for i, (index, text, done) in enumerate(parts):
            completion = CompletionOutput(index, text, [i], "stop" if done else None)
            stream._collector.put(RequestOutput("r", None, [1, 2, 3], [completion], finished=i == len(parts) - 1))
            if not lag:
                await asyncio.sleep(0)

    producer = asyncio.create_task(produce())
    result = await stream.collect()
    await producer
    got = [(c.index, c.text, c.token_ids, c.finish_reason) for c in result.outputs]
    assert got == [(0, "ab", [1, 3], "stop"), (1, "xy", [0, 2], "stop")]
    assert result.usage is not None
    assert result.usage.num_generated_tokens == 4


@pytest.mark.parametrize("consume_every", [1, 5])
@pytest.mark.parametrize("kind", list(RequestOutputKind))
async def test_last_streamed_output_carries_usage(hf: HFTokenizer, kind: RequestOutputKind, consume_every: int) -> None:
    processor = OutputProcessor(hf)
    collector = RequestOutputCollector(kind)
    processor.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(output_kind=kind)), None, collector)
    stream = GenerateOutputStream("r", collector, Aborts(), loop=asyncio.get_running_loop())
    ids = hf.encode(TEXT).ids

    async def produce() -> None:
        for i, token in enumerate(ids):
            reason = FinishReason.LENGTH if i == len(ids) - 1 else None
            processor.process_outputs([EngineCoreOutput("r", [token], reason, num_cached_tokens=2)])
            if i % consume_every == 0:
                await asyncio.sleep(0)

    producer = asyncio.create_task(produce())
    outputs = [o async for o in stream]
    await producer
    assert outputs[-1].finished
    assert outputs[-1].usage == Usage(num_prompt_tokens=3, num_generated_tokens=len(ids), num_cached_tokens=2)
    assert all(o.usage is None for o in outputs[:-1])


async def test_last_streamed_output_counts_n_completions() -> None:
    stream, _ = make_stream(RequestOutputKind.DELTA)
    parts = [(1, [7, 8], False), (0, [5], False), (1, [9], True), (0, [6], True)]
    for i, (index, ids, done) in enumerate(parts):
        completion = CompletionOutput(index, "t", ids, "stop" if done else None)
        stream._collector.put(RequestOutput("r", None, [1, 2], [completion], finished=i == len(parts) - 1))
        if i % 2 == 1:
            last = [o async for o in stream][-1] if i == len(parts) - 1 else await stream.__anext__()
    assert last.finished
    assert last.usage == Usage(num_prompt_tokens=2, num_generated_tokens=5, num_cached_tokens=0)


async def test_a_put_wakes_only_the_consumer_of_its_own_collector() -> None:
    collectors = {key: RequestOutputCollector(RequestOutputKind.DELTA) for key in "abcd"}
    woken: list[str] = []

    async def wait(key: str) -> None:
        await collectors[key].wait()
        woken.append(key)

    tasks = {key: asyncio.create_task(wait(key)) for key in collectors}
    for _ in range(3):  # let every task reach its wait
        await asyncio.sleep(0)
    collectors["c"].put(output("x", [1]))
    await tasks["c"]
    for _ in range(3):
        await asyncio.sleep(0)
    assert woken == ["c"]
    assert not any(tasks[key].done() for key in "abd")
    collectors["a"].put_error(EngineDeadError("gone"))
    await tasks["a"]
    assert woken == ["c", "a"]
    await collectors["c"].wait()  # an output is waiting: returns at once
    for key in "bd":
        tasks[key].cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert all(c._waiter is None for c in collectors.values())
