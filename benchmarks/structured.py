"""Generated tokens/s at 32 concurrent streams with and without structured-output constraints, in one run.

The same engine, prompts and greedy decoding; each request makes exactly `max_tokens` tokens in both runs (free:
EOS ignored; constrained: a JSON schema asking for at least 40 array items, so the grammar never lets it end
early). The runs alternate (free, constrained, free, constrained, ...) so machine load hits both alike; prints
each run, the medians and the ratio constrained / free (goal: >= 0.8), with the machine load (`os.getloadavg`).

    .venv/bin/python benchmarks/structured.py [--streams 32] [--max-tokens 64] [--rounds 2] [--kind json|regex|choice]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from asyncllm import AsyncLLM, EngineArgs, SamplingParams, StructuredOutputsParams
from asyncllm.model.loading.resolve import resolve_model_path

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["student", "teacher", "engineer"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json={"type": "array", "items": ITEM, "minItems": 40}),
    "regex": StructuredOutputsParams(regex=r"([A-Z][a-z]{2,9} ){40,}"),
}
TOPICS = ["a school", "a hospital", "a start-up", "a football club", "a library", "a ship crew", "a band", "a lab"]


def make_prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"List the people of {TOPICS[i % len(TOPICS)]} ({i})."}] for i in range(n)]


async def run(llm: AsyncLLM, prompts: list, params: SamplingParams) -> tuple[float, int]:
    """All prompts at once; returns (generated tokens per second, generated tokens)."""

    async def one(prompt: list) -> int:
        final = await llm.generate(prompt, params).collect()
        return len(final.outputs[0].token_ids)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts) / (time.perf_counter() - start), sum(counts)


async def main(args: argparse.Namespace) -> None:
    path = str(resolve_model_path(args.model))
    engine_args = EngineArgs(model=path, engine_process=not args.thread, max_num_seqs=max(64, args.streams))
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured_outputs=CONSTRAINTS[args.kind])
    prompts = make_prompts(args.streams)
    rates: dict[str, list[float]] = {"free": [], "constrained": []}
    load_before = os.getloadavg()
    async with AsyncLLM.from_engine_args(engine_args) as llm:
        await run(
            llm, prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=CONSTRAINTS[args.kind])
        )
        for round_ in range(args.rounds):
            for name, params in (("free", free), ("constrained", constrained)):
                rate, tokens = await run(llm, prompts, params)
                rates[name].append(rate)
                print(f"round {round_} {name:>11}: {tokens} tokens, {rate:7.1f} tok/s")
    free_rate, constrained_rate = statistics.median(rates["free"]), statistics.median(rates["constrained"])
    load = f"load average before/after: {load_before[0]:.1f}/{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    print(f"\n{args.streams} streams x {args.max_tokens} tokens, constraint={args.kind}, {load}")
    print(f"{'free tok/s':>12} {'constrained tok/s':>18} {'ratio':>6}")
    print(f"{free_rate:12.1f} {constrained_rate:18.1f} {constrained_rate / free_rate:6.2f}  (goal >= 0.80)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kind", choices=sorted(CONSTRAINTS), default="json")
    parser.add_argument("--thread", action="store_true", help="engine core in a thread instead of its own process")
    asyncio.run(main(parser.parse_args()))
