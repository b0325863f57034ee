"""Generation tokens/s with and without n-gram speculative decoding, measured in the same run.

Two engines (process mode, same model and cache settings) run side by side: the reference without speculation
and one with `speculative_config={"method": "ngram", ...}`. Two workloads of 8 chat prompts each, greedy,
`max_tokens` fixed: "extractive" (repeat / fix / reformat a given text: the answer copies the prompt, so drafts
are accepted) and "free-form" (open questions: few n-gram matches). Each is run at batch 1 (one request at a
time) and at 8 streams (all 8 at once); the reference and the speculative engine take turns, `--rounds` times,
and the best round of each counts (the machine is shared: the best is the least disturbed). Prints tokens/s,
the ratio speculative / reference, the draft acceptance rate, and the load average (`os.getloadavg`) before and
after. Greedy outputs are also compared token for token (they must be equal).

    .venv/bin/python benchmarks/speculative.py [--k 4] [--lookup-min 1] [--lookup-max 3] [--max-tokens 96]
        [--rounds 2] [--num-threads N] [--workloads extractive,free-form] [--no-adaptive]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.messages.engine import SpecDecodeMetrics
from asyncllm.model.loading.resolve import resolve_model_path

PARAGRAPH = (
    "The harbour committee met on Tuesday to review the plans for the new pier, the budget for the library "
    "roof, the schedule of the autumn fair and the letters from residents about the bridge repairs."
)
EXTRACTIVE = [
    f"Repeat this text exactly, word for word: {PARAGRAPH}",
    "Fix the typo in this code and print the whole fixed code:\n"
    "def mean(values):\n    total = 0\n    for value in values:\n"
    "        total += value\n    retrun total / len(values)\n",
    "Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew, kiwis.",
    f"Rewrite this text in capital letters: {PARAGRAPH}",
    'Copy this JSON exactly: {"name": "Ada Lovelace", "born": 1815, "city": "London", "field": "maths"}',
    "Fix the spelling in this sentence and repeat it: The wether in the citty was nice todya and tomorow.",
    f"Quote the first sentence of this text: {PARAGRAPH} It was a long meeting.",
    "Repeat after me: to be or not to be, that is the question, whether it is nobler in the mind to suffer.",
]
FREE_FORM = [
    "Tell me a short story about a dragon who learns to bake.",
    "Explain what a CPU does.",
    "Give me five tips for learning a new language.",
    "Why is the sky blue?",
    "Describe a perfect weekend in the mountains.",
    "What are the benefits of regular exercise?",
    "Write a short poem about autumn.",
    "How do airplanes stay in the air?",
]


async def run_workload(llm: AsyncLLM, prompts: list[str], streams: int, max_tokens: int) -> tuple[float, list]:
    """(generated tokens / wall seconds, token ids per prompt) with `streams` requests in flight at most."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results: list = [None] * len(prompts)
    semaphore = asyncio.Semaphore(streams)

    async def one(i: int) -> None:
        async with semaphore:
            out = await llm.chat([{"role": "user", "content": prompts[i]}], params)
            results[i] = out.outputs[0].token_ids

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    elapsed = time.perf_counter() - start
    return sum(len(r) for r in results) / elapsed, results


def acceptance(before: SpecDecodeMetrics | None, after: SpecDecodeMetrics | None) -> str:
    if before is None or after is None:
        return "-"
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return f"{accepted / drafted:.0%} of {drafted}" if drafted else "no drafts"


async def main(args: argparse.Namespace) -> None:
    model = str(resolve_model_path("smollm2-135m-instruct"))
    common = {"model": model, "num_kv_blocks": 256, "max_model_len": 1024, "num_threads": args.num_threads}
    common["quantization"] = args.quantization  # the default "auto": the file's blocks, where "greedy equal" can be
    # False at near-ties (a verify step's attention rounds differently; docs/speculative.md); "none": float32
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
        "adaptive": args.adaptive,
    }
    load_before = os.getloadavg()
    async with (
        AsyncLLM.create(EngineArgs(**common)) as reference,
        AsyncLLM.create(EngineArgs(**common, speculative_config=spec)) as speculative,
    ):
        for llm in (reference, speculative):  # warm-up
            await run_workload(llm, FREE_FORM[:2], 2, 8)
        print(
            f"speculative_config={spec}, quantization={args.quantization!r}, max_tokens={args.max_tokens}, best of "
            f"{args.rounds} rounds"
        )
        print(
            f"{'workload':<11} {'streams':>7} {'reference tok/s':>16} {'speculative tok/s':>18} {'ratio':>6}  "
            f"{'acceptance':>14}  greedy equal"
        )
        workloads = {"extractive": EXTRACTIVE, "free-form": FREE_FORM}
        for name in args.workloads.split(","):
            prompts = workloads[name]
            for streams in (1, 8):
                best_ref = best_spec = 0.0
                rate, equal = "-", True
                for _ in range(args.rounds):
                    ref_tps, ref_ids = await run_workload(reference, prompts, streams, args.max_tokens)
                    before = (await speculative.get_scheduler_stats()).spec_decode
                    spec_tps, spec_ids = await run_workload(speculative, prompts, streams, args.max_tokens)
                    after = (await speculative.get_scheduler_stats()).spec_decode
                    best_ref, best_spec = max(best_ref, ref_tps), max(best_spec, spec_tps)
                    rate, equal = acceptance(before, after), equal and ref_ids == spec_ids
                print(
                    f"{name:<11} {streams:>7} {best_ref:>16.1f} {best_spec:>18.1f} {best_spec / best_ref:>5.2f}x  "
                    f"{rate:>14}  {equal}"
                )
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before: {load_before}, after: {load_after}; cores: {os.cpu_count()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="auto", help="EngineArgs.quantization of both engines")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=1, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=3, help="prompt_lookup_max")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--workloads", default="extractive,free-form", help="comma-separated subset")
    parser.add_argument(
        "--no-adaptive",
        dest="adaptive",
        action="store_false",
        help="always draft k tokens (speculative_config adaptive=false)",
    )
    asyncio.run(main(parser.parse_args()))
