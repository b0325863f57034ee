"""How long `generate()` with a long prompt blocks the event loop: tokenized on the loop vs in a worker thread.

A ticker task sleeps 1 ms in a loop and records the longest gap between its wake-ups while one request with a
32k-character prompt is submitted and its first output awaited. Both runs are in this process, on the same
engine (a scripted core in its own process: no model work competes with the loop), on asyncio:
- "on the loop": `LONG_PROMPT_CHARS` raised above the prompt length (the old behaviour: tokenize in `generate()`);
- "off the loop": the default (`generate()` defers tokenization to a daemon thread, `utils/threads.py`).

    .venv/bin/python benchmarks/loop_stall.py [--chars 32768] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from process_overhead import CONFIG

from asyncllm import AsyncLLM, SamplingParams, submission
from asyncllm.engine.client import EngineCoreClient
from asyncllm.model.loading.resolve import resolve_model_path
from asyncllm.model.loading.tokenizer import Tokenizer


async def max_gap_ms(llm: AsyncLLM, prompt: str) -> float:
    """Longest event-loop gap (ms) while submitting `prompt` and awaiting its first output."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    stream = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    await stream.__anext__()
    await stream.aclose()
    done.set()
    await task
    return max(gaps) * 1e3


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"load average (1, 5, 15 min): {os.getloadavg()}, cpus: {os.cpu_count()}")
    tokenizer = Tokenizer.load(str(resolve_model_path("smollm2-135m-instruct")))
    client = EngineCoreClient(CONFIG, core_factory="process_overhead:make_scripted_core")
    llm = AsyncLLM(CONFIG, tokenizer, client)
    base = "The quick brown fox jumps over the lazy dog. "
    prompt = (base * (args.chars // len(base) + 1))[: args.chars]
    results: dict[str, list[float]] = {"on the loop": [], "off the loop": []}
    default_limit = submission.LONG_PROMPT_CHARS
    async with llm:
        for i in range(args.repeats):
            for mode in results:
                submission.LONG_PROMPT_CHARS = 1 << 40 if mode == "on the loop" else default_limit
                results[mode].append(await max_gap_ms(llm, f"{i} {mode} {prompt}"))
    submission.LONG_PROMPT_CHARS = default_limit
    on, off = statistics.median(results["on the loop"]), statistics.median(results["off the loop"])
    print(f"{args.chars}-character prompt, median of {args.repeats} runs, longest event-loop gap:")
    print(f"  tokenized on the loop (before): {on:7.1f} ms")
    print(f"  tokenized off the loop (after): {off:7.1f} ms   ({off / on:.2f} x)")


if __name__ == "__main__":
    asyncio.run(main())
