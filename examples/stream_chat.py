"""Stream a chat answer from a real model on the CPU.

    python examples/stream_chat.py                      # asks the default model about the capital of Germany
    python examples/stream_chat.py --prompt "Write a haiku about autumn." --max-tokens 64 --temperature 0.7

The first run fetches the default model (SmolLM2-135M-Instruct, 98 MB) into ~/.cache/asyncllm/models. The
default weights are the file's own 4-bit blocks (`quantization="auto"`, README "Speed"). The question was the
capital of France until 2026-12-04; that one is a near-tie for this small model (float32 prefers "The" over "L" by
0.08 logits): the 4-bit blocks answer "L'Étoile, ...", as llama.cpp's `llama-server` does on the same file, while
`--quantization none` (float32) answers "The capital of France is Paris.".
"""

from __future__ import annotations

import argparse
import asyncio
import time

from asyncllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name, .gguf path or HF directory")
    parser.add_argument("--prompt", default="What is the capital of Germany?")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "gguf", "int8", "q8_0", "q4_0"],
        help="weights: 'auto' (default: the 4-bit GGUF's own blocks), 'none' (float32), ...; README 'Speed'",
    )
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, output_kind=RequestOutputKind.DELTA
    )
    messages = [{"role": "user", "content": args.prompt}]
    # The engine core runs in its own process; create() starts it without blocking this event loop.
    async with AsyncLLM.create(EngineArgs(model=args.model, quantization=args.quantization)) as llm:
        print(f"user: {args.prompt}\nassistant: ", end="", flush=True)
        start = time.perf_counter()
        num_tokens = 0
        async for out in llm.generate(messages, params):
            completion = out.outputs[0]
            num_tokens += len(completion.token_ids)
            print(completion.text, end="", flush=True)
        elapsed = time.perf_counter() - start
        print(f"\n[{num_tokens} tokens in {elapsed:.2f} s, finish_reason={completion.finish_reason}]")


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
