"""Total generated tokens/s of `data_parallel_size=1` and `data_parallel_size=2` (backend "mp"), measured in the
same run on the same prompts, with the ratio DP=2 / DP=1.

Each configuration runs as a user runs it (`AsyncLLM` with its engine processes, default thread policy: one
engine uses torch's default threads; two engines split the machine's CPUs, here 1 thread each on 2 cores).
Every request streams `--max-tokens` new tokens (greedy, EOS ignored); at each concurrency the requests start
together and the wall time from the first submission to the last token is measured after a warm-up round.
The load average (`uptime`) is printed before and after: on a shared machine the absolute numbers move, the
ratio (measured minutes apart) much less.

    .venv/bin/python benchmarks/data_parallel.py [--concurrency 8,32,64] [--max-tokens 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from typing import Any

from asyncllm import AsyncLLM, EngineArgs, SamplingParams

TOPICS = ["the ocean", "a city at night", "an old library", "mountain weather", "a chess game", "bread"]


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]} (version {i})." for i in range(n)]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


async def tokens_per_second(llm: AsyncLLM, concurrency: int, max_tokens: int) -> float:
    """Generated tokens / wall seconds for `concurrency` requests started together."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = await asyncio.gather(*(llm.generate(p, params).collect() for p in prompts(concurrency)))
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


async def measure(size: int, concurrency: list[int], max_tokens: int) -> dict[int, float]:
    async with AsyncLLM.create(EngineArgs(data_parallel_size=size, max_model_len=1024)) as llm:
        await tokens_per_second(llm, 4, 8)  # warm-up: first allocations, both engines
        return {c: await tokens_per_second(llm, c, max_tokens) for c in concurrency}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="8,32,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    before = uptime()
    print(f"cpus: {os.cpu_count()}  load before: {before}")
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_before": before, "max_tokens": args.max_tokens}
    one = asyncio.run(measure(1, concurrency, args.max_tokens))
    two = asyncio.run(measure(2, concurrency, args.max_tokens))
    results["load_after"] = after = uptime()
    print(f"{'streams':>8} {'DP=1 tok/s':>11} {'DP=2 tok/s':>11} {'DP=2/DP=1':>10}")
    rows = []
    for c in concurrency:
        print(f"{c:>8} {one[c]:>11.1f} {two[c]:>11.1f} {two[c] / one[c]:>9.2f}x")
        rows.append(
            {"concurrency": c, "dp1_tokens_per_s": one[c], "dp2_tokens_per_s": two[c], "ratio": two[c] / one[c]}
        )
    print(f"load after: {after}")
    results["rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
