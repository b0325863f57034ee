"""Total generated tokens/s of `data_parallel_size=2` (backend "mp") next to `data_parallel_size=1`, measured in
the same run on the same prompts, with the ratios.

Three configurations, all started first and then measured in turns (for each concurrency, every round runs
each configuration once; the median of the rounds is kept), so that a shared machine's changing load hits them
alike:
- `DP=1`: one engine with the default thread policy (what a user gets without DP);
- `DP=1 x1t`: one engine with `num_threads=1` (the same threads per engine as DP=2 here);
- `DP=2`: two engines; the machine's CPUs split between them (1 torch thread each on 2 cores).
Every request streams `--max-tokens` new tokens (greedy, EOS ignored); the requests of one measurement start
together; tokens/s = generated tokens / wall seconds from the first submission to the last token. The load
average (`uptime`) is printed before and after.

    .venv/bin/python benchmarks/data_parallel.py [--concurrency 1,8,32,64] [--max-tokens 32] [--rounds 3]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time

from asyncllm import AsyncLLM, EngineArgs, SamplingParams

TOPICS = ["the ocean", "a city at night", "an old library", "mountain weather", "a chess game", "bread"]
CONFIGS = {
    "DP=1": {"data_parallel_size": 1},
    "DP=1 x1t": {"data_parallel_size": 1, "num_threads": 1},
    "DP=2": {"data_parallel_size": 2},
}


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


async def run(concurrency: list[int], max_tokens: int, rounds: int) -> dict[str, dict[int, float]]:
    engines = {name: await AsyncLLM.create(EngineArgs(max_model_len=1024, **kw)) for name, kw in CONFIGS.items()}
    try:
        for llm in engines.values():
            await tokens_per_second(llm, 4, 8)  # warm-up: first allocations, every engine
        samples: dict[str, dict[int, list[float]]] = {name: {c: [] for c in concurrency} for name in engines}
        for c in concurrency:
            for _ in range(rounds):
                for name, llm in engines.items():
                    samples[name][c].append(await tokens_per_second(llm, c, max_tokens))
        return {name: {c: statistics.median(v) for c, v in by_c.items()} for name, by_c in samples.items()}
    finally:
        for llm in engines.values():
            await llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    before = uptime()
    print(f"cpus: {os.cpu_count()}  load before: {before}")
    result = asyncio.run(run(concurrency, args.max_tokens, args.rounds))
    after = uptime()
    one, one_1t, two = result["DP=1"], result["DP=1 x1t"], result["DP=2"]
    print(f"tokens/s (median of {args.rounds} rounds, {args.max_tokens} tokens per request)")
    print(f"{'streams':>8} {'DP=1':>8} {'DP=1 x1t':>9} {'DP=2':>8} {'DP=2/DP=1':>10} {'DP=2/DP=1 x1t':>14}")
    rows = []
    for c in concurrency:
        ratios = f"{two[c] / one[c]:>9.2f}x {two[c] / one_1t[c]:>13.2f}x"
        print(f"{c:>8} {one[c]:>8.1f} {one_1t[c]:>9.1f} {two[c]:>8.1f} {ratios}")
        rows.append({"concurrency": c, **{name: result[name][c] for name in result}, "ratio_dp2_dp1": two[c] / one[c]})
    print(f"load after: {after}")
    if args.json:
        report = {"cpus": os.cpu_count(), "load_before": before, "load_after": after, "max_tokens": args.max_tokens}
        with open(args.json, "w") as f:
            json.dump({**report, "rounds": args.rounds, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
