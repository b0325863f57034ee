"""Stream answers under trio: two prompts at once in a nursery, one of them cut short by a cancel scope.

    pip install 'asyncllm[trio]'
    python examples/trio_stream.py                      # asks the default model two questions
    python examples/trio_stream.py --max-tokens 32

Leaving a cancel scope (here `trio.move_on_after`) aborts that request in the engine; the other keeps streaming.
The same code runs under asyncio with `anyio.run(main, backend="asyncio")`.
"""

from __future__ import annotations

import argparse

import trio

from asyncllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams

QUESTIONS = ["What is the capital of France?", "Write a long story about the sea."]


async def stream_one(llm: AsyncLLM, question: str, max_tokens: int, answers: dict[str, str]) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    answers[question] = ""
    async for out in llm.generate([{"role": "user", "content": question}], params):
        answers[question] += out.outputs[0].text


async def main(args: argparse.Namespace) -> None:
    llm = AsyncLLM.from_engine_args(EngineArgs(model=args.model, quantization=args.quantization))
    answers: dict[str, str] = {}
    async with llm:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_one, llm, QUESTIONS[0], args.max_tokens, answers)
            with trio.move_on_after(args.story_seconds):  # the story is cut short: its request is aborted
                await stream_one(llm, QUESTIONS[1], 4 * args.max_tokens, answers)
        stats = await llm.get_scheduler_stats()
    for question, answer in answers.items():
        print(f"user: {question}\nassistant: {answer}\n")
    print(f"running requests after the nursery: {stats.num_running_reqs}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name, .gguf path or HF directory")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--story-seconds", type=float, default=1.0, help="how long the story may stream")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "gguf", "int8", "q8_0", "q4_0"],
        help="weights: 'auto' (default: the 4-bit GGUF's own blocks), 'none' (float32), ...; README 'Speed'",
    )
    return parser.parse_args()


if __name__ == "__main__":
    trio.run(main, parse_args())
