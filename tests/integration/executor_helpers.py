"""Shared by the executor tests: prompts, engine arguments, greedy token ids, and process liveness checks."""

from __future__ import annotations

import asyncio
import os
import time

from asyncllm import AsyncLLM, EngineArgs, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
MAX_TOKENS = 12


EXECUTOR_OVERRIDES = {"num_kv_blocks": 64, "max_model_len": 256}  # the executor tests' engines (`make_llm` overrides)


def engine_args(model_path: str, **kw) -> EngineArgs:
    """`EngineArgs` of the executor tests: `EXECUTOR_OVERRIDES` and float32 weights (`quantization=None`: the
    references are float32, and TP > 1 runs float32) unless `kw` says otherwise."""
    return EngineArgs(**{"model": model_path, "quantization": None, **EXECUTOR_OVERRIDES, **kw})


async def greedy_ids(llm: AsyncLLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    finals = await asyncio.gather(*(llm.generate(p, params).collect() for p in prompts))
    return [list(f.outputs[0].token_ids) for f in finals]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


def wait_gone(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]
