"""A stream closed or aborted by another task while a task waits for its next output, on the real engine.

The waiting task must end at once (the engine sends nothing more for that request, so nothing else would wake
it), whether it waits for the output-handling turn or holds it (reading the engine's socket for every stream);
and a later `shutdown()` must return promptly and leave the event loop free. Found in the OpenAI server: a batch
whose second prompt failed closed the first prompt's stream while a leftover task still read it; at SIGTERM that
task spun on the dead engine and the server never exited.
"""

from __future__ import annotations

import time

import anyio
import pytest

from asyncllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
from asyncllm.errors import EngineDeadError, StreamClosedError
from tests.integration.conftest import run

pytestmark = [pytest.mark.mp]
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
DEADLINE_S = 60.0  # generous: a loaded 2-core machine; a hang is what fails


async def read_all(stream, errors: list[BaseException]) -> None:
    try:
        async for _ in stream:
            pass
    except (StreamClosedError, EngineDeadError) as e:
        errors.append(e)


async def close_while_read(llm: AsyncLLM, how: str) -> list[BaseException]:
    """One stream alone (its reader holds the read turn) and two streams (one reader waits for the turn); the
    first stream is closed or aborted by another task after its first output. Returns what its reader raised."""
    errors: list[BaseException] = []
    first_output = anyio.Event()
    stream = llm.generate("Tell me a long story about the sea.", LONG)
    other = llm.generate("Count to a thousand.", LONG) if how.endswith("+other") else None

    async def reader() -> None:
        await stream.__anext__()
        first_output.set()
        await read_all(stream, errors)

    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await first_output.wait()
            await anyio.sleep(0.05)  # the reader is waiting again (for the socket, or for the turn)
            if how.startswith("close"):
                await stream.aclose()
            else:
                await llm.abort(stream.request_id)
        if other is not None:
            await other.aclose()
    return errors


@pytest.mark.parametrize("how", ["close", "close+other", "abort", "abort+other"])
async def test_reader_ends_when_its_stream_is_closed_or_aborted(llm: AsyncLLM, how: str) -> None:
    """On the module's shared engine (per mode): each case leaves it idle and serving, which it checks."""
    errors = await close_while_read(llm, how)
    if how.startswith("close"):
        assert [type(e) for e in errors] == [StreamClosedError]
    else:
        assert errors == []  # aborted: the stream ended with its final "abort" output
    assert await llm.check_health() is None  # the engine still serves
    final = await llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0.0)).collect()
    assert len(final.outputs[0].token_ids) == 3


def test_shutdown_with_a_task_still_reading_a_closed_stream(mode: str, model_path: str) -> None:
    """The server's case: a leftover task reads a stream closed under it, then the engine is shut down."""

    async def body() -> None:
        llm = await AsyncLLM.create(EngineArgs(model=model_path, engine_process=mode == "process", quantization=None))
        errors: list[BaseException] = []
        stream = llm.generate("Tell me a long story about the sea.", LONG)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await anyio.sleep(0.01)
                ticks += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all, stream, errors)
            tg.start_soon(tick)
            await anyio.sleep(0.5)  # the reader is waiting for the engine
            stream.close()
            started = time.monotonic()
            with anyio.fail_after(DEADLINE_S):
                await llm.shutdown()
                ticks_after_shutdown = ticks
                await anyio.sleep(0.2)
                assert ticks > ticks_after_shutdown, "the event loop is blocked after shutdown"
            print(f"shutdown took {time.monotonic() - started:.3f} s")
            tg.cancel_scope.cancel()
        assert [type(e) for e in errors] in ([StreamClosedError], [EngineDeadError])

    run("asyncio", body)


def test_reader_ends_on_trio_too(model_path: str) -> None:
    """The same on trio (thread mode: the backend, not the engine's place, is what differs)."""

    async def body() -> None:
        async with AsyncLLM.create(EngineArgs(model=model_path, engine_process=False, quantization=None)) as llm:
            errors = await close_while_read(llm, "close")
            assert [type(e) for e in errors] == [StreamClosedError]

    run("trio", body)
