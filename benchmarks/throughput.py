"""Total generated tokens/s of asyncllm at 1 and 32 concurrent streams, next to HF `transformers` `generate`.

Both run the same model (SmolLM2-135M-Instruct GGUF, dequantized to float32), the same prompts, greedy,
`max_tokens` new tokens per request with EOS ignored, on this machine, in this run. Prints a table with the
ratio asyncllm / transformers.

    .venv/bin/python benchmarks/throughput.py [--max-tokens 128] [--concurrency 1 32] [--skip-hf]

Needs the dev extra (transformers + accelerate) for the reference column.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.model.resolve import resolve_model_path

PROMPT_TOPICS = ["the ocean", "a city at night", "an old library", "mountain weather", "a chess game", "bread"]


def make_prompts(n: int) -> list[str]:
    return [f"Write a long story about {PROMPT_TOPICS[i % len(PROMPT_TOPICS)]} (version {i})." for i in range(n)]


async def run_asyncllm(llm: AsyncLLM, prompts: list[str], max_tokens: int) -> float:
    """Stream all prompts concurrently; returns generated tokens per second."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: str) -> int:
        outputs = [out async for out in llm.generate(prompt, params)]
        return len(outputs[-1].outputs[0].token_ids)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts) / (time.perf_counter() - start)


def run_transformers(model, tokenizer, prompts: list[str], max_tokens: int) -> float:
    """HF `generate`, one padded batch of all prompts; returns generated tokens per second."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **batch,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts) / elapsed


def load_transformers(path: str):
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, torch_dtype=torch.float32).eval()
    return model, tokenizer


async def main(args: argparse.Namespace) -> None:
    path = str(resolve_model_path(args.model))
    results: dict[int, tuple[float, float | None]] = {}
    llm = await AsyncLLM.create(EngineArgs(model=path, engine_process=False, max_num_seqs=64))
    async with llm:
        await run_asyncllm(llm, make_prompts(2), 8)  # warm-up
        for n in args.concurrency:
            results[n] = (await run_asyncllm(llm, make_prompts(n), args.max_tokens), None)
    if not args.skip_hf:
        model, tokenizer = load_transformers(path)
        run_transformers(model, tokenizer, make_prompts(2), 8)  # warm-up
        for n in args.concurrency:
            results[n] = (results[n][0], run_transformers(model, tokenizer, make_prompts(n), args.max_tokens))

    print(f"\nthroughput, {args.max_tokens} new tokens per request, greedy, torch threads={torch.get_num_threads()}")
    print(f"{'streams':>8} {'asyncllm tok/s':>15} {'transformers tok/s':>19} {'ratio':>7}")
    for n, (ours, ref) in results.items():
        ref_s = f"{ref:19.1f}" if ref else f"{'-':>19}"
        ratio = f"{ours / ref:7.2f}" if ref else f"{'-':>7}"
        print(f"{n:>8} {ours:15.1f} {ref_s} {ratio}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--skip-hf", action="store_true")
    asyncio.run(main(parser.parse_args()))
