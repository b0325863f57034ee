"""A thread-mode engine gives its memory back at shutdown: starting and stopping engines in one process does not
grow its resident set by an engine each time (glibc kept ~400 MB of freed weights and KV cache per engine in its
arenas until the engine thread called `malloc_trim`; the test suite's process reached 8.5 GB)."""

from __future__ import annotations

import gc

import anyio

from asyncllm import AsyncLLM, EngineArgs, SamplingParams

ALLOWED_GROWTH_MB = 150  # one engine is ~400 MB (fp32 weights of SmolLM2-135M + KV cache)


def rss_mb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def test_start_stop_cycles_do_not_keep_an_engine_each(model_path: str) -> None:
    async def cycle() -> None:
        llm = await AsyncLLM.create(
            EngineArgs(model=model_path, engine_process=False, num_kv_blocks=64, quantization=None)
        )
        out = await llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)).collect()
        assert len(out.outputs[0].token_ids) == 4
        await llm.shutdown()

    sizes = []
    for _ in range(3):
        anyio.run(cycle)
        gc.collect()
        sizes.append(rss_mb())
    assert sizes[-1] - sizes[0] <= ALLOWED_GROWTH_MB, sizes
