"""Several agent loops sharing one engine, each step under a timeout.

    python examples/concurrent_agents.py --agents 4 --steps 3 --max-tokens 48

Each agent keeps its own conversation and asks the model for its next step; all agents run at once on one
`AsyncLLM`, whose scheduler batches their requests together. A step that takes longer than `--step-timeout`
seconds is cancelled (which aborts its request in the engine) and the agent carries on with the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from asyncllm import AsyncLLM, EngineArgs, SamplingParams

TOPICS = ["a bakery", "a bicycle shop", "a small library", "a vegetable garden", "a tea house", "a bookshop"]


async def ask(llm: AsyncLLM, history: list[dict[str, str]], params: SamplingParams) -> str:
    """One model call: the whole conversation in, the answer text out."""
    result = await llm.generate(history, params).collect()
    return result.outputs[0].text


async def run_agent(llm: AsyncLLM, index: int, args: argparse.Namespace) -> list[str]:
    """An agent loop: plan, then refine its plan step by step. Returns its step results."""
    name, topic = f"agent-{index}", TOPICS[index % len(TOPICS)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=index)
    history = [{"role": "system", "content": f"You are {name}, who plans the opening of {topic}. Be brief."}]
    steps = []
    for step in range(args.steps):
        history.append({"role": "user", "content": "Plan your first step." if step == 0 else "What next?"})
        try:
            # asyncio.wait_for works on Python 3.10 too (asyncio.timeout is 3.11+); a timeout cancels the
            # step's task, which aborts its request in the engine.
            answer = await asyncio.wait_for(ask(llm, history, params), timeout=args.step_timeout)
        except asyncio.TimeoutError:
            answer = "(timed out)"
        history.append({"role": "assistant", "content": answer})
        steps.append(answer)
        print(f"[{name} step {step + 1}] {answer.strip()[:100]!r}", flush=True)
    return steps


async def main(args: argparse.Namespace) -> None:
    async with AsyncLLM.create(EngineArgs(model=args.model)) as llm:  # starts without blocking the loop
        start = time.perf_counter()
        results = await asyncio.gather(*(run_agent(llm, i, args) for i in range(args.agents)))
        elapsed = time.perf_counter() - start
    done = sum(answer != "(timed out)" for steps in results for answer in steps)
    print(f"{args.agents} agents x {args.steps} steps: {done} answered, in {elapsed:.1f} s on one engine")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--step-timeout", type=float, default=60.0, help="seconds one step may take")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
