"""`AsyncLLM.create()` starts the real engine without blocking the caller's event loop.

What is measured: a ticker task sleeps 10 ms in a loop during the whole start-up and records how late each tick
wakes (its loop stall). `from_engine_args()` called on the loop stalls it for the whole start-up (seconds);
`create()` runs the start-up in a worker thread. What remains is GIL contention with that thread: the longest
single hold is `tokenizers` building the 49k-token BPE model (one Rust call, 35-75 ms measured on a 2-core
machine at load 5). On a machine this shared (load 12 on 2 cores) the OS alone can keep the loop's thread off
a core for a few hundred ms, so the bound is relative: the longest stall must stay under a tenth of the
start-up time (a blocking start stalls for all of it) or under 250 ms, whichever is larger, and the loop must
keep ticking through the start-up. The report of issue 16 lists the measured numbers.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import time
from multiprocessing import resource_tracker

import pytest

from asyncllm import AsyncLLM, EngineArgs, SamplingParams

pytestmark = pytest.mark.mp
TICK_S = 0.01
MAX_STALL_S = 0.25


class Heartbeat:
    """A task that sleeps TICK_S in a loop and records how late each wake-up is (seconds)."""

    def __init__(self) -> None:
        self.stalls: list[float] = []
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self.stalls.append(now - last - TICK_S)
            last = now

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def test_create_keeps_the_event_loop_running(model_path: str) -> None:
    heartbeat = Heartbeat()
    await asyncio.sleep(0.05)
    started = time.monotonic()
    llm = await AsyncLLM.create(EngineArgs(model=model_path))
    elapsed = time.monotonic() - started
    await heartbeat.stop()
    try:
        out = await llm.generate("The capital of France is", SamplingParams(max_tokens=2, temperature=0.0)).collect()
        assert len(out.outputs[0].token_ids) == 2
    finally:
        await llm.shutdown()
    assert elapsed > 0.5  # a real start-up happened while the ticker ran
    stall = max(heartbeat.stalls)
    assert stall < max(MAX_STALL_S, elapsed / 10), f"loop stalled {stall * 1000:.0f} ms in a {elapsed:.1f} s start"
    assert len(heartbeat.stalls) >= 0.25 * elapsed / TICK_S  # the loop kept ticking the whole time


async def test_async_with_create_shuts_down_on_exit(model_path: str) -> None:
    async with AsyncLLM.create(EngineArgs(model=model_path)) as llm:
        assert llm.is_running
        out = await llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0.0)).collect()
        assert out.finished
    assert not llm.is_running


async def test_create_raises_start_up_errors(tmp_path: pathlib.Path) -> None:
    from asyncllm import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        await AsyncLLM.create(EngineArgs(model=tmp_path / "missing.gguf"))


def _children() -> set[int]:
    pids = set()
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == os.getpid() and fields[0] not in ("Z", "X"):
                pids.add(int(entry.name))
    return pids


async def _start(model_path: str) -> AsyncLLM:
    return await AsyncLLM.create(EngineArgs(model=model_path))


@pytest.mark.slow
async def test_cancelled_create_stops_the_engine_it_started(model_path: str) -> None:
    resource_tracker.ensure_running()  # a child process of its own, started once: not an engine
    before = _children()
    task = asyncio.create_task(_start(model_path))
    await asyncio.sleep(0.5)  # the worker thread is now starting the engine (start-up takes seconds)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    seen_engine = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        engines = _children() - before
        seen_engine = seen_engine or bool(engines)
        if seen_engine and not engines:
            break
        await asyncio.sleep(0.05)
    assert seen_engine, "the worker thread never started the engine"
    assert not _children() - before, "the engine of a cancelled create() is still running"
