"""Talk to `asyncllm serve` with the official `openai` client (streaming chat and a plain completion).

asyncllm serve                                     # in another terminal (http://127.0.0.1:8000)
python examples/openai_client.py                   # streams an answer
python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --max-tokens 32 --api-key KEY
"""

from __future__ import annotations

import argparse
import asyncio

from openai import AsyncOpenAI


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused", help="the server's --api-key, if it has one")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=64)
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    async with AsyncOpenAI(base_url=args.base_url, api_key=args.api_key) as client:
        print(f"user: {args.prompt}\nassistant: ", end="", flush=True)
        stream = await client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": args.prompt}],
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
            if chunk.usage is not None:
                print(
                    f"\n[usage: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]"
                )

        completion = await client.completions.create(
            model=args.model, prompt="The three primary colors are", max_tokens=args.max_tokens, temperature=0
        )
        print(f"completion: The three primary colors are{completion.choices[0].text}")
        print(f"[finish_reason={completion.choices[0].finish_reason}]")


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
