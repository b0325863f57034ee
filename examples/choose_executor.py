"""Run the same prompts under different engine layouts and compare (see docs/executors.md).

    python examples/choose_executor.py                         # thread, process + uni, process + mp
    python examples/choose_executor.py --layouts uni mp --max-tokens 64

Layouts: `thread` (engine core in a background thread of this process), `uni` (engine core in its own
process, the model in it; the default), `mp` (engine core process + one worker process; with
--tensor-parallel-size 3 the model is sharded over 3 workers). Greedy outputs must be the same in every layout.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from asyncllm import AsyncLLM, EngineArgs, RequestOutput, SamplingParams

LAYOUTS = {
    "thread": {"engine_process": False},
    "uni": {"engine_process": True, "distributed_executor_backend": "uni"},
    "mp": {"engine_process": True, "distributed_executor_backend": "mp"},
}
PROMPTS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello in Spanish."]


async def run_layout(layout: str, args: argparse.Namespace) -> tuple[list[str], float, float]:
    """Start an engine in `layout`, answer every prompt concurrently; returns (texts, start-up s, run s)."""
    extra = dict(LAYOUTS[layout])
    if layout == "mp":
        extra["tensor_parallel_size"] = args.tensor_parallel_size
    # The default `quantization="auto"` keeps a 4-bit GGUF's blocks at TP=1 but runs float32 at TP > 1 (block
    # weights are not sharded), so with --tensor-parallel-size > 1 every layout runs float32 to compare the same math.
    quantization = "auto" if args.tensor_parallel_size == 1 else "none"
    start = time.perf_counter()
    llm = await AsyncLLM.create(EngineArgs(model=args.model, quantization=quantization, **extra))
    startup = time.perf_counter() - start
    async with llm:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        start = time.perf_counter()
        messages = [[{"role": "user", "content": p}] for p in PROMPTS]
        outputs: list[RequestOutput] = await asyncio.gather(*(llm.generate(m, params).collect() for m in messages))
        elapsed = time.perf_counter() - start
    return [o.outputs[0].text for o in outputs], startup, elapsed


async def main(args: argparse.Namespace) -> None:
    reference: list[str] | None = None
    for layout in args.layouts:
        texts, startup, elapsed = await run_layout(layout, args)
        tokens = len(PROMPTS) * args.max_tokens
        same = "reference" if reference is None else ("same text" if texts == reference else "DIFFERENT text")
        print(
            f"{layout:>6}: start-up {startup:5.1f} s, {len(PROMPTS)} prompts in {elapsed:5.2f} s "
            f"(<= {tokens / elapsed:5.1f} tokens/s), {same}: {texts[0].strip()[:50]!r}"
        )
        reference = reference or texts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="workers for the mp layout (1 or 3)")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
