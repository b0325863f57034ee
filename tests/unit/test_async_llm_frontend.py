"""AsyncLLM on a scripted fake engine core and the real tokenizer: the frontend contract without a model."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

from asyncllm import (
    AsyncLLM,
    EngineDeadError,
    EngineGenerateError,
    InvalidRequestError,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    StreamClosedError,
)
from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncllm.engine.client import EngineCoreClient
from asyncllm.messages.engine import EngineCoreRequest
from asyncllm.streams import RequestOutputCollector
from tests.unit.fake_engine_core import NUM_BLOCKS, FakeEngineCore

ANSWER = "The capital of France is Paris. 😀"


@pytest.fixture(scope="module")
def tokenizer(model_path: str):
    from asyncllm.model.loading.tokenizer import Tokenizer

    return Tokenizer.load(model_path)


def make_llm(tokenizer, **core_kw) -> tuple[AsyncLLM, list[FakeEngineCore]]:
    answer_ids = [*tokenizer.encode(ANSWER, add_special_tokens=False), tokenizer.eos_token_id]
    cores: list[FakeEngineCore] = []

    def script(req: EngineCoreRequest) -> list[int]:
        return answer_ids

    def factory(config: EngineConfig) -> FakeEngineCore:
        cores.append(FakeEngineCore(script, **core_kw))
        return cores[-1]

    config = EngineConfig(ModelConfig("fake", "fake"), CacheConfig(), SchedulerConfig(), ParallelConfig())
    return AsyncLLM(config, tokenizer, EngineCoreClient(config, in_thread=True, core_factory=factory)), cores


@pytest_asyncio.fixture
async def llm(tokenizer) -> AsyncIterator[AsyncLLM]:
    engine, _ = make_llm(tokenizer, max_model_len=256)
    async with engine:
        yield engine


def greedy(max_tokens: int | None = 32, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=kind, **kw)


async def collect(stream) -> list[RequestOutput]:
    return [out async for out in stream]


def user_ids(internal_ids: list[str]) -> list[str]:
    """The user's ids of internal request ids (`f"{user_id}-{n}"`)."""
    return [i.rsplit("-", 1)[0] for i in internal_ids]


async def wait_for(predicate: Callable[[], bool], within: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
async def test_kinds_end_with_one_finished_output(llm: AsyncLLM, kind: RequestOutputKind) -> None:
    outputs = await collect(llm.generate("Hi", greedy(kind=kind)))
    assert [o.finished for o in outputs].count(True) == 1
    assert outputs[-1].finished
    if kind == RequestOutputKind.DELTA:
        text = "".join(o.outputs[0].text for o in outputs)
    else:
        text = outputs[-1].outputs[0].text
    assert text == ANSWER
    assert outputs[-1].outputs[0].finish_reason == "stop"
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1


async def test_three_prompt_forms(llm: AsyncLLM, tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = await collect(llm.generate(messages, greedy(kind=RequestOutputKind.FINAL_ONLY)))
    rendered = tokenizer.apply_chat_template(messages)
    assert chat[0].prompt == rendered
    assert chat[0].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    ids = await collect(llm.generate({"prompt_token_ids": [5, 6]}, greedy(kind=RequestOutputKind.FINAL_ONLY)))
    assert (ids[0].prompt, ids[0].prompt_token_ids) == (None, [5, 6])
    text = await collect(llm.generate("Hello", greedy(kind=RequestOutputKind.FINAL_ONLY)))
    assert text[0].prompt == "Hello"


async def test_stop_string_finishes_and_aborts_in_the_engine(tokenizer) -> None:
    engine, cores = make_llm(tokenizer, step_delay=0.005)
    async with engine:
        outputs = await collect(engine.generate("Hi", greedy(kind=RequestOutputKind.DELTA, stop=[" Paris"])))
        final = outputs[-1].outputs[0]
        assert "".join(o.outputs[0].text for o in outputs) == "The capital of France is"
        assert (final.finish_reason, final.stop_reason) == ("stop", " Paris")
        await wait_for(lambda: user_ids(cores[0].aborted) == [outputs[-1].request_id])


async def test_max_tokens_gives_length(llm: AsyncLLM) -> None:
    outputs = await collect(llm.generate("Hi", greedy(3)))
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert len(outputs[-1].outputs[0].token_ids) == 3


async def test_invalid_input_raises_at_submission(llm: AsyncLLM) -> None:
    for bad in ["", {"prompt_token_ids": []}, {"prompt_token_ids": [10**9]}, [{"role": "user"}], 42]:
        with pytest.raises(InvalidRequestError):
            llm.generate(bad, greedy())  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="256"):
        llm.generate({"prompt_token_ids": [1] * 256}, greedy())
    outputs = await collect(llm.generate("still serving", greedy(2)))
    assert outputs[-1].finished


async def test_one_user_id_in_flight_twice_is_two_requests(tokenizer) -> None:
    """As vLLM (internal ids beside the user's): both are served; abort("dup") reaches both."""
    engine, cores = make_llm(tokenizer, step_delay=0.01)
    async with engine:
        first = engine.generate("Hi", greedy(), request_id="dup")
        second = engine.generate("Hi", greedy(2), request_id="dup")
        assert [o.request_id for o in await collect(first)][-1] == "dup"
        assert len((await second.collect()).outputs[0].token_ids) == 2
        third = engine.generate("Hi", greedy(None, ignore_eos=True), request_id="dup")
        fourth = engine.generate("Hi", greedy(None, ignore_eos=True), request_id="dup")
        await engine.abort("dup")
        for stream in (third, fourth):
            assert (await stream.collect()).outputs[0].finish_reason == "abort"
        await wait_for(lambda: user_ids(cores[0].aborted) == ["dup", "dup"])
        assert len(set(cores[0].aborted)) == 2


async def test_abort_ends_the_stream_with_a_final_abort_output(tokenizer) -> None:
    engine, cores = make_llm(tokenizer, step_delay=0.005)
    async with engine:
        outputs = []
        async for out in engine.generate("Hi", greedy(None, ignore_eos=True), request_id="a"):
            outputs.append(out)
            if len(outputs) == 2:
                await engine.abort("a")
        assert [o.finished for o in outputs].count(True) == 1
        assert outputs[-1].outputs[0].finish_reason == "abort"
        await wait_for(lambda: user_ids(cores[0].aborted) == ["a"])


async def test_aclose_and_breaking_out_abort_in_the_engine(tokenizer) -> None:
    engine, cores = make_llm(tokenizer, step_delay=0.005)
    async with engine:
        stream = engine.generate("Hi", greedy(None, ignore_eos=True), request_id="closed")
        await stream.__anext__()
        await stream.aclose()
        await stream.aclose()
        with pytest.raises(StreamClosedError):
            await stream.__anext__()
        async for _ in engine.generate("Hi", greedy(None, ignore_eos=True), request_id="broken"):
            break
        gc.collect()
        await wait_for(lambda: sorted(user_ids(cores[0].aborted)) == ["broken", "closed"])
        stats = await engine.get_scheduler_stats()
        assert (stats.num_running_reqs, stats.num_free_blocks) == (0, NUM_BLOCKS)


async def test_slow_consumer_delta_merges_to_the_same_text(tokenizer) -> None:
    engine, _ = make_llm(tokenizer, max_model_len=512)
    async with engine:
        outputs = []
        async for out in engine.generate("Hi", greedy(200, RequestOutputKind.DELTA, ignore_eos=True)):
            outputs.append(out)
            await asyncio.sleep(0.01)
        ids = [t for o in outputs for t in o.outputs[0].token_ids]
        assert len(ids) == 200
        assert "".join(o.outputs[0].text for o in outputs) == tokenizer.decode(ids)
        assert len(outputs) < 200, "a lagging consumer should see merged outputs"


async def test_engine_death_reaches_every_stream_and_is_sticky(tokenizer) -> None:
    engine, _ = make_llm(tokenizer, step_delay=0.005, fail_at_step=5)
    streams = [engine.generate("Hi", greedy(None, ignore_eos=True)) for _ in range(3)]
    for stream in streams:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(stream), 60)
    assert engine.errored
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        engine.generate("Hi", greedy())
    await engine.shutdown()


async def test_shutdown_ends_open_streams_and_is_idempotent(tokenizer) -> None:
    engine, cores = make_llm(tokenizer, step_delay=0.005)
    stream = engine.generate("Hi", greedy(None, ignore_eos=True))
    await stream.__anext__()
    await engine.shutdown()
    await engine.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(collect(stream), 60)
    assert cores[0].shut_down.is_set()
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        engine.generate("Hi", greedy())


async def test_a_failing_output_handler_fails_every_stream_instead_of_hanging(
    llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in output processing")

    monkeypatch.setattr(llm._output_processor, "process_outputs", broken)
    streams = [llm.generate("Hi", greedy()) for _ in range(3)]
    for stream in streams:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(stream), 60)
    assert llm.errored
    with pytest.raises(EngineDeadError) as raised:
        await asyncio.wait_for(llm.get_scheduler_stats(), 60)
    assert isinstance(raised.value.__cause__, RuntimeError)
    with pytest.raises(EngineDeadError, match="the output reader failed: RuntimeError"):
        llm._client.check_health()


def test_shutdown_outside_a_loop_is_synchronous(tokenizer) -> None:
    engine, cores = make_llm(tokenizer)
    pending = engine.shutdown()  # no loop runs: the engine is stopped before shutdown() returns
    assert pending.started
    assert cores[0].shut_down.is_set()
    assert not engine.is_running
    assert engine._client._closed


async def test_shutdown_called_as_vllm_does_stops_the_engine_at_the_end_of_the_statement(tokenizer) -> None:
    engine, cores = make_llm(tokenizer)
    outputs = await collect(engine.generate("Hi", greedy(3)))
    assert outputs[-1].finished
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited would warn (and fail here)
        engine.shutdown()  # not awaited, as vLLM's synchronous shutdown() is called
        assert cores[0].shut_down.is_set()
        assert not engine.is_running
        gc.collect()
    await engine.shutdown()  # idempotent, and awaitable


def test_shutdown_runs_wherever_a_coroutine_is_expected(tokenizer) -> None:
    import trio

    first, first_cores = make_llm(tokenizer)
    asyncio.run(first.shutdown())  # made outside the loop: stopped at once, then run as a finished coroutine
    assert first_cores[0].shut_down.is_set()

    second, second_cores = make_llm(tokenizer)

    async def as_a_task() -> None:
        await asyncio.create_task(second.shutdown())
        assert second_cores[0].shut_down.is_set()

    asyncio.run(as_a_task())
    third, third_cores = make_llm(tokenizer)
    trio.run(third.shutdown)
    assert third_cores[0].shut_down.is_set()


async def test_an_awaited_shutdown_keeps_the_loop_running(tokenizer) -> None:
    engine, cores = make_llm(tokenizer)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    before = ticks
    await engine.shutdown()
    ticker.cancel()
    assert cores[0].shut_down.is_set()
    assert ticks > before  # the stop ran in a thread while the loop went on


async def test_many_concurrent_streams(llm: AsyncLLM) -> None:
    streams = [llm.generate(f"prompt {i}", greedy(8, RequestOutputKind.DELTA)) for i in range(300)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for outputs in results:
        assert outputs[-1].finished
        assert len([t for o in outputs for t in o.outputs[0].token_ids]) == 8


async def test_a_request_the_engine_refuses_raises_engine_generate_error_and_others_go_on(llm: AsyncLLM) -> None:
    refused = llm.generate("Hi", greedy(), request_id="refuse-me")
    with pytest.raises(EngineGenerateError, match="refused refuse-me"):
        await collect(refused)
    assert not llm.errored
    outputs = await collect(llm.generate("Hi", greedy()))
    assert outputs[-1].outputs[0].text == ANSWER


async def test_a_long_prompt_is_tokenized_off_the_loop_and_errors_at_the_first_await(tokenizer) -> None:
    from asyncllm.async_llm import LONG_PROMPT_CHARS

    engine, _ = make_llm(tokenizer, max_model_len=1 << 12)
    async with engine:
        text = "word " * (LONG_PROMPT_CHARS // 5 + 10)
        stream = engine.generate(text, greedy(3, ignore_eos=True))
        assert stream.statistics().num_outputs_yielded == 0
        outputs = await collect(stream)
        assert outputs[-1].finished
        assert outputs[-1].prompt_token_ids == tokenizer.encode(text)
        too_long = engine.generate("word " * 5000, greedy(3))  # over max_model_len: raises at the first await
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await too_long.__anext__()
        assert engine.is_running


async def test_an_output_wakes_only_its_own_stream(llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # Waking every waiting stream per engine step made the frontend's cost grow with the number of open streams
    # (issue 17's frontend benchmark: 256 streams, up to 56 us of CPU per token). Each stream waits on its own
    # collector, which only a put into it wakes: every wait ends with something in its own slot (no wake-up is
    # spurious), so there are at most as many waits as outputs yielded.
    waits = spurious = 0
    real_wait = RequestOutputCollector.wait

    async def counting_wait(self: RequestOutputCollector) -> None:
        nonlocal waits, spurious
        waits += 1
        await real_wait(self)
        if self._output is None and self._error is None:
            spurious += 1

    monkeypatch.setattr(RequestOutputCollector, "wait", counting_wait)
    streams = [llm.generate(f"prompt {i}", greedy(8, RequestOutputKind.DELTA)) for i in range(100)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    yielded = sum(len(outputs) for outputs in results)
    assert all(sum(len(o.outputs[0].token_ids) for o in outputs) == 8 for outputs in results)
    assert 0 < waits <= yielded, (waits, yielded)
    assert spurious == 0


async def test_outputs_and_stop_strings_are_handled_while_nobody_reads(tokenizer) -> None:
    # The output handler runs in the background: a stream nobody reads still has its stop string applied and its
    # request aborted in the engine within a step (the fake core emits one token per step per request).
    engine, cores = make_llm(tokenizer, step_delay=0.01)
    async with engine:
        stream = engine.generate("Hi", greedy(kind=RequestOutputKind.DELTA, stop=[" France"]))
        await wait_for(lambda: user_ids(cores[0].aborted) == [stream.request_id], within=60)
        stop_at = len(tokenizer.encode("The capital of France", add_special_tokens=False))
        internal_id = cores[0].aborted[0]
        assert stop_at <= cores[0].emitted[internal_id] <= stop_at + 2, cores[0].emitted
        outputs = await collect(stream)  # everything waited merged in the one slot
        assert len(outputs) == 1
        assert outputs[0].outputs[0].text == "The capital of"
        assert (outputs[0].outputs[0].finish_reason, outputs[0].outputs[0].stop_reason) == ("stop", " France")


async def test_an_unread_stream_holds_one_merged_output_while_others_are_read(tokenizer) -> None:
    engine, _ = make_llm(tokenizer, step_delay=0.002, max_model_len=512)
    async with engine:
        unread = engine.generate("unread", greedy(60, RequestOutputKind.DELTA, ignore_eos=True))
        read = [engine.generate(f"read {i}", greedy(60, RequestOutputKind.DELTA, ignore_eos=True)) for i in range(8)]
        results = await asyncio.gather(*(collect(s) for s in read))
        assert all(sum(len(o.outputs[0].token_ids) for o in outputs) == 60 for outputs in results)
        collector = unread._collector
        await wait_for(lambda: collector._output is not None and collector._output.finished, within=60)
        waiting = collector._output
        assert waiting is not None
        assert len(waiting.outputs[0].token_ids) == 60  # one slot, every token merged
        outputs = await collect(unread)
        assert len(outputs) == 1
        assert outputs[0].outputs[0].text == tokenizer.decode(outputs[0].outputs[0].token_ids)
