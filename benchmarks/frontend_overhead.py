"""CPU microseconds per streamed token in the user's process, at 256 concurrent streams, with a scripted engine
core whose steps cost nothing (it runs in the engine process; so everything measured here is the frontend:
request submission, ZeroMQ receive, msgspec decode, output processing, detokenization, the streams).

CPU time is `time.process_time()` of this process (all its threads) over the run, divided by the tokens the
streams yield. A ticker task measures the worst event-loop stall (how late a 5 ms sleep wakes up). Targets
(issue 17): <= 30 us of CPU per token, no stall > 50 ms.

    .venv/bin/python benchmarks/frontend_overhead.py [--streams 256] [--tokens 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import time
from typing import Any

from process_overhead import CONFIG, scripted_client  # benchmarks/ is on sys.path (the engine imports the core)
from throughput import machine_info

from asyncllm import AsyncLLM, SamplingParams
from asyncllm.model.loading.resolve import resolve_model_path
from asyncllm.model.loading.tokenizer import Tokenizer


async def watch_stalls(stop: asyncio.Event, period: float = 0.005) -> float:
    """Largest lateness (seconds) of a `period` sleep while the run goes on."""
    worst = 0.0
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(period)
        worst = max(worst, time.perf_counter() - start - period)
    return worst


async def run(num_streams: int, num_tokens: int) -> dict[str, float]:
    tokenizer = Tokenizer.load(str(resolve_model_path("smollm2-135m-instruct")))
    client = scripted_client(process=True)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    async with AsyncLLM(CONFIG, tokenizer, client) as llm:

        async def one(i: int) -> int:
            count = 0
            async for out in llm.generate({"prompt_token_ids": [1, 2, 3 + i % 100]}, params):
                count = len(out.outputs[0].token_ids)
            return count

        await asyncio.gather(*(one(i) for i in range(8)))  # warm-up
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_stalls(stop))
        cpu0, wall0 = time.process_time(), time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(num_streams)))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        stop.set()
        stall = await watcher
    tokens = sum(counts)
    return {
        "streams": num_streams,
        "tokens": tokens,
        "cpu_us_per_token": cpu / tokens * 1e6,
        "wall_us_per_token": wall / tokens * 1e6,
        "tokens_per_s": tokens / wall,
        "max_event_loop_stall_ms": stall * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--json", default="benchmarks/results/frontend_overhead.json")
    args = parser.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    result: dict[str, Any] = {"benchmark": "frontend_overhead", "machine": machine_info(), "load_before": load_before}
    result |= asyncio.run(run(args.streams, args.tokens))
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    m = result["machine"]
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores; load average before {load_before}, after {result['load_after']}")
    print(f"{result['streams']} streams x {args.tokens} tokens, scripted engine core (steps cost nothing)")
    print(f"{'CPU us/token (user process)':>30} {'wall us/token':>14} {'tokens/s':>10} {'max loop stall ms':>18}")
    print(
        f"{result['cpu_us_per_token']:30.1f} {result['wall_us_per_token']:14.1f} {result['tokens_per_s']:10.0f}"
        f" {result['max_event_loop_stall_ms']:18.1f}"
    )
    print("targets: <= 30 us CPU per token, no stall > 50 ms")
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
