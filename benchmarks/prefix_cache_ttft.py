"""Time to first token of a request whose 1,000-token prefix is in the prefix cache vs one whose is not.

Each trial uses a fresh 1,000-token prefix (a trial number at its start changes every block hash). First a
request with that prefix and one question runs (nothing cached: the whole prompt is prefilled), then a request
with the same prefix and another question (the prefix's full blocks are reused; only the tail is computed).
TTFT is `RequestOutput.metrics.time_to_first_token` (frontend wall clock from `generate()` to the first
token), one request at a time, `max_tokens=1`. Prints per-trial numbers and medians.

    .venv/bin/python benchmarks/prefix_cache_ttft.py [--prefix-tokens 1000] [--trials 5] [--num-threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.model.loading.resolve import resolve_model_path

FILLER = (
    "The committee met on a grey morning to review the harbour plans, the budget for the new library, the "
    "schedule of the autumn fair and the long list of letters from residents about the bridge repairs. "
)


def make_prefix(tokenizer, trial: int, num_tokens: int) -> list[int]:
    text = f"Trial {trial} minutes. " + FILLER * (num_tokens // 20 + 1)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"filler too short: {len(ids)} < {num_tokens} tokens")
    return ids[:num_tokens]


async def time_to_first_token(llm: AsyncLLM, token_ids: list[int]) -> tuple[float, int]:
    """(TTFT in seconds, prompt tokens served from the prefix cache) of one request."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = None
    async for out in llm.generate({"prompt_token_ids": token_ids}, params):  # noqa: B007 (keep the last)
        pass
    if out is None or out.metrics is None or out.metrics.time_to_first_token is None:
        raise RuntimeError("the request produced no output with a time to first token")
    return out.metrics.time_to_first_token, out.num_cached_tokens


async def main(prefix_tokens: int, trials: int, num_threads: int | None) -> None:
    model = str(resolve_model_path("smollm2-135m-instruct"))
    args = EngineArgs(model=model, num_kv_blocks=512, num_threads=num_threads)
    async with AsyncLLM.create(args) as llm:
        tokenizer = llm.get_tokenizer()
        question_a = tokenizer.encode(" Question: what was decided about the bridge?", add_special_tokens=False)
        question_b = tokenizer.encode(" Question: when is the autumn fair?", add_special_tokens=False)
        await time_to_first_token(llm, make_prefix(tokenizer, -1, 64) + question_a)  # warm-up
        uncached, cached = [], []
        print(f"{'trial':>5} {'uncached TTFT s':>16} {'cached TTFT s':>14} {'cached tokens':>14}")
        for trial in range(trials):
            prefix = make_prefix(tokenizer, trial, prefix_tokens)
            cold, cold_hits = await time_to_first_token(llm, prefix + question_a)
            warm, warm_hits = await time_to_first_token(llm, prefix + question_b)
            if cold_hits:
                raise RuntimeError(f"trial {trial}: the uncached request hit {cold_hits} cached tokens")
            uncached.append(cold)
            cached.append(warm)
            print(f"{trial:>5} {cold:>16.3f} {warm:>14.3f} {warm_hits:>14}")
        cold_med, warm_med = statistics.median(uncached), statistics.median(cached)
        print(
            f"median TTFT with a {prefix_tokens}-token prefix: uncached {cold_med:.3f} s, cached {warm_med:.3f} s, "
            f"speed-up {cold_med / warm_med:.1f}x"
        )
        stats = await llm.get_scheduler_stats()
        print(f"prefix cache hit rate over the run: {stats.prefix_cache_hit_rate:.1%}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ns = parser.parse_args()
    asyncio.run(main(ns.prefix_tokens, ns.trials, ns.num_threads))
