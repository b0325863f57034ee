"""Does a stream nobody reads slow the others? 9 greedy requests of 256 tokens (DELTA outputs) on the default
model: once with all 9 read, once with one left unread for its first 10 seconds (then drained). Prints the mean
inter-token latency of the 8 read streams in both runs, measured by the reader (seconds between outputs that
carry new tokens, divided by the tokens they carry), and what the unread stream got when it woke up.

    .venv/bin/python benchmarks/unread_stream.py
"""

from __future__ import annotations

import asyncio
import statistics
import time

from asyncllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams

TOKENS, STREAMS, UNREAD_S = 256, 9, 10.0


async def read(stream) -> float:  # type: ignore[no-untyped-def]
    """Mean seconds per token between outputs."""
    gaps, last = [], None
    async for out in stream:
        now, n = time.perf_counter(), len(out.outputs[0].token_ids)
        if last is not None and n:
            gaps.append((now - last) / n)
        last = now
    return statistics.mean(gaps)


async def unread(stream) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(outputs, tokens) received after sleeping `UNREAD_S` seconds."""
    await asyncio.sleep(UNREAD_S)
    outputs = tokens = 0
    async for out in stream:
        outputs, tokens = outputs + 1, tokens + len(out.outputs[0].token_ids)
    return outputs, tokens


async def run(llm: AsyncLLM, leave_one: bool) -> tuple[float, tuple[int, int] | None]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    streams = [llm.generate(f"Tell me a long story, number {i}.", params) for i in range(STREAMS)]
    first = unread(streams[0]) if leave_one else read(streams[0])
    results = await asyncio.gather(first, *(read(s) for s in streams[1:]))
    itl = statistics.mean(results[1:])
    return itl, results[0] if leave_one else None


async def main() -> None:
    async with AsyncLLM.create(EngineArgs()) as llm:
        await run(llm, False)  # warm-up
        for leave_one in (False, True, False, True):
            itl, woke = await run(llm, leave_one)
            extra = f"; the unread stream woke to {woke[0]} output(s), {woke[1]} tokens" if woke else ""
            print(f"{'one unread' if leave_one else 'all read  '}: others' mean ITL {itl * 1e3:.1f} ms{extra}")


if __name__ == "__main__":
    asyncio.run(main())
