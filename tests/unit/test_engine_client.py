"""EngineCoreClient (engine core in a thread, real sockets) around a scripted fake core: outputs, utility
calls, idle blocking, sticky death."""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncllm import EngineDeadError, EngineGenerateError, SamplingParams
from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncllm.engine.client import EngineCoreClient
from asyncllm.messages.engine import EngineCoreRequest, SchedulerStats
from tests.unit.fake_engine_core import NUM_BLOCKS, FakeEngineCore

CONFIG = EngineConfig(ModelConfig("fake", "fake"), CacheConfig(), SchedulerConfig(), ParallelConfig())


def start_client(**kw) -> tuple[EngineCoreClient, list[FakeEngineCore]]:
    cores: list[FakeEngineCore] = []

    def factory(config: EngineConfig) -> FakeEngineCore:
        cores.append(FakeEngineCore(lambda req: [7, 8, 9], **kw))
        return cores[-1]

    return EngineCoreClient(CONFIG, in_thread=True, core_factory=factory), cores


def request(request_id: str, max_tokens: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2], SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def test_outputs_arrive_until_the_request_finishes() -> None:
    client, _ = start_client()
    try:
        assert client.ready_info.num_kv_blocks == NUM_BLOCKS
        client.add_request(request("a"))
        tokens = []
        while True:
            outputs = await asyncio.wait_for(client.get_output_async(), 5)
            (out,) = outputs.outputs
            tokens += out.new_token_ids
            if out.finished:
                break
        assert tokens == [7, 8, 9]
    finally:
        client.shutdown()


async def test_utility_call_returns_the_core_result() -> None:
    client, _ = start_client()
    try:
        stats = await asyncio.wait_for(client.call_utility_async("get_scheduler_stats"), 5)
        assert isinstance(stats, SchedulerStats)
        assert stats.num_total_blocks == NUM_BLOCKS
        assert await client.call_utility_async("echo", 1, "x") == [1, "x"]
        with pytest.raises(EngineGenerateError, match="unknown utility method"):
            await client.call_utility_async("add_request")  # a core method, but not a utility
        with pytest.raises(EngineGenerateError, match="no workers"):
            await client.call_utility_async("collective_rpc", "get_model_info")
    finally:
        client.shutdown()


async def test_abort_stops_outputs() -> None:
    client, cores = start_client(step_delay=0.01)
    try:
        client.add_request(request("a", max_tokens=1000))
        await asyncio.wait_for(client.get_output_async(), 5)
        client.abort_requests(["a"])
        stats = await asyncio.wait_for(client.call_utility_async("get_scheduler_stats"), 5)
        assert stats.num_running_reqs == 0
        assert cores[0].aborted == ["a"]
    finally:
        client.shutdown()


async def test_idle_engine_blocks_instead_of_stepping() -> None:
    client, cores = start_client()
    try:
        await asyncio.sleep(0.1)
        assert cores[0].num_steps == 0
    finally:
        client.shutdown()
    assert cores[0].shut_down.is_set()


async def test_engine_death_is_sticky() -> None:
    client, _ = start_client(fail_at_step=2)
    client.add_request(request("a", max_tokens=10))
    with pytest.raises(EngineDeadError):  # noqa: PT012 - drains the outputs made before the failure
        for _ in range(10):
            await asyncio.wait_for(client.get_output_async(), 5)
    assert client.errored
    with pytest.raises(EngineDeadError):
        client.check_health()
    with pytest.raises(EngineDeadError):
        client.add_request(request("b"))
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(client.get_output_async(), 5)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(client.call_utility_async("get_scheduler_stats"), 5)
    client.shutdown()


async def test_pending_utility_call_fails_when_the_engine_dies() -> None:
    stepping, release = threading.Event(), threading.Event()

    class SlowCore(FakeEngineCore):
        def step(self):  # type: ignore[no-untyped-def]
            stepping.set()
            release.wait(5)
            raise RuntimeError("boom")

    client = EngineCoreClient(CONFIG, in_thread=True, core_factory=lambda config: SlowCore(lambda req: [1]))
    client.add_request(request("a"))
    await asyncio.to_thread(stepping.wait, 5)
    call = asyncio.create_task(client.call_utility_async("get_scheduler_stats"))
    await asyncio.sleep(0.01)
    release.set()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(call, 5)
    client.shutdown()


def test_core_construction_error_is_raised_by_the_constructor() -> None:
    def factory(config: EngineConfig) -> FakeEngineCore:
        raise FileNotFoundError("no model")

    with pytest.raises(EngineDeadError, match="failed to start: FileNotFoundError: no model"):
        EngineCoreClient(CONFIG, in_thread=True, core_factory=factory)


async def test_shutdown_is_idempotent_and_ends_waiters() -> None:
    client, _ = start_client()
    waiter = asyncio.create_task(client.get_output_async())
    await asyncio.sleep(0.01)
    client.shutdown()
    client.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(waiter, 5)


async def test_a_request_the_core_refuses_fails_alone_and_the_engine_keeps_serving() -> None:
    client, _ = start_client()
    try:
        client.add_request(request("refuse-1"))
        outputs = await asyncio.wait_for(client.get_output_async(), 5)
        assert outputs.failed_requests == {"refuse-1": "ValueError: refused refuse-1"}
        assert not client.errored
        client.add_request(request("b"))
        outputs = await asyncio.wait_for(client.get_output_async(), 5)
        assert [o.request_id for o in outputs.outputs] == ["b"]
    finally:
        client.shutdown()
