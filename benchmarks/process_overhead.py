"""What the engine boundary costs per step: `engine_process=True` vs the engine core in a thread.

Both modes speak the same ZeroMQ + msgspec frames (one client); they differ in where the engine core runs.
Four measurements, in this run on this machine:
0. the encoding thread mode pays since it uses the same wire as process mode: encode + decode of one step's
   `EngineCoreOutputs` at 1 and 64 streams, next to the thread-mode step time it is part of.
1. utility round trip: `call_utility_async("echo")` one at a time (request socket -> engine -> output socket).
2. per-step cost without a model: a scripted core that emits one token per running request per step with no
   compute, streamed through the whole frontend (output processor, detokenizer, streams) at 1 and 64 streams.
   The difference between the modes is the boundary's cost per step (encode, send, receive, decode).
3. per-step time with the real SmolLM2-135M model at 1 and 8 streams (greedy, EOS ignored).

    .venv/bin/python benchmarks/process_overhead.py [--steps 200] [--model-tokens 32] [--skip-model]

The machine's load average is printed first: on a shared 2-core machine, other processes move these numbers
more than the boundary does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncllm.engine.client import EngineCoreClient
from asyncllm.messages.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReadyInfo,
    FinishReason,
    SchedulerStats,
)
from asyncllm.messages.serial import MsgpackDecoder, MsgpackEncoder
from asyncllm.model.loading.resolve import resolve_model_path
from asyncllm.model.loading.tokenizer import Tokenizer

SCRIPT_TOKENS = [330, 2114, 282, 4536, 314, 7042, 30, 216]  # ordinary word pieces of the SmolLM2 vocabulary
CONFIG = EngineConfig(ModelConfig("scripted", "scripted"), CacheConfig(), SchedulerConfig(), ParallelConfig())


class ScriptedCore:
    """One token per running request per step, no compute: isolates everything around the model."""

    def __init__(self, config: EngineConfig) -> None:
        self.ready_info = EngineReadyInfo(num_kv_blocks=1024, max_model_len=1 << 20, vocab_size=49152)
        self.running: dict[str, list[int]] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        self.running[request.request_id] = [0, request.sampling_params.max_tokens or 16]

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> EngineCoreOutputs:
        outputs = []
        for request_id, state in list(self.running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            reason = FinishReason.LENGTH if done else None
            outputs.append(EngineCoreOutput(request_id, [SCRIPT_TOKENS[state[0] % len(SCRIPT_TOKENS)]], reason))
            if done:
                del self.running[request_id]
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.get_scheduler_stats())

    def get_scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.running))

    def echo(self, *args: Any) -> list[Any]:
        return list(args)

    def register_failure_callback(self, callback: Any) -> None:
        pass

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def make_scripted_core(config: EngineConfig) -> ScriptedCore:
    return ScriptedCore(config)


def scripted_client(process: bool) -> EngineCoreClient:
    return EngineCoreClient(CONFIG, in_thread=not process, core_factory="process_overhead:make_scripted_core")


def encode_decode_us(num_streams: int, num_calls: int = 2000) -> float:
    """Median microseconds to encode and decode one scripted step's outputs for `num_streams` streams."""
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(f"req-{i}", [SCRIPT_TOKENS[i % 8]]) for i in range(num_streams)],
        scheduler_stats=SchedulerStats(num_running_reqs=num_streams),
    )
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    times = []
    for _ in range(num_calls):
        start = time.perf_counter()
        decoder.decode(encoder.encode(outputs))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


async def utility_round_trip_us(client: EngineCoreClient, num_calls: int) -> float:
    """Median microseconds of one `echo` utility call."""
    times = []
    for i in range(num_calls):
        start = time.perf_counter()
        await client.call_utility_async("echo", i)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


async def per_step_ms(llm: AsyncLLM, num_streams: int, num_steps: int, prompt: Any) -> float:
    """Wall milliseconds per engine step while `num_streams` streams each take `num_steps` tokens."""
    params = SamplingParams(max_tokens=num_steps, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> int:
        outputs = [out async for out in llm.generate(prompt(i), params)]
        return len(outputs[-1].outputs[0].token_ids)

    await one(-1)  # warm-up
    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(num_streams)))
    elapsed = time.perf_counter() - start
    assert all(c == num_steps for c in counts), counts
    return elapsed / num_steps * 1e3


async def bench_scripted(tokenizer: Tokenizer, num_steps: int) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = {}
    for process in (False, True):
        client = scripted_client(process)
        llm = AsyncLLM(CONFIG, tokenizer, client)
        async with llm:
            rtt = await utility_round_trip_us(client, 2000)
            step_1 = await per_step_ms(llm, 1, num_steps, lambda i: {"prompt_token_ids": [1, 2, 3]})
            step_64 = await per_step_ms(llm, 64, num_steps, lambda i: {"prompt_token_ids": [1, 2, 3]})
        rows["process" if process else "thread"] = [rtt, step_1 * 1e3, step_64 * 1e3]
    return rows


async def bench_model(model_path: str, num_tokens: int) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = {}
    for process in (False, True):
        llm = await AsyncLLM.create(EngineArgs(model=model_path, engine_process=process, num_kv_blocks=512))
        async with llm:
            prompt = lambda i: f"Write a long story about the sea (version {i})."  # noqa: E731
            rows["process" if process else "thread"] = [
                await per_step_ms(llm, 1, num_tokens, prompt),
                await per_step_ms(llm, 8, num_tokens, prompt),
            ]
    return rows


def print_table(title: str, headers: list[str], rows: dict[str, list[float]]) -> None:
    print(f"\n{title}")
    print(f"{'mode':<16}" + "".join(f"{h:>24}" for h in headers))
    for mode, values in rows.items():
        print(f"{mode:<16}" + "".join(f"{v:>24.1f}" for v in values))
    thread, process = rows["thread"], rows["process"]
    print(f"{'process - thread':<16}" + "".join(f"{p - t:>24.1f}" for p, t in zip(process, thread, strict=True)))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="engine steps per scripted run")
    parser.add_argument("--model-tokens", type=int, default=32, help="tokens per stream with the real model")
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args()
    print(f"load average (1, 5, 15 min): {os.getloadavg()}, cpus: {os.cpu_count()}")
    model_path = str(resolve_model_path("smollm2-135m-instruct"))
    tokenizer = Tokenizer.load(model_path)

    scripted = await bench_scripted(tokenizer, args.steps)
    print_table(
        f"scripted core (no model), {args.steps} steps",
        ["utility RTT (us)", "step, 1 stream (us)", "step, 64 streams (us)"],
        scripted,
    )
    print("\nthread mode: encode + decode of one step's outputs (us), and its share of the thread-mode step")
    for num_streams, step_us in ((1, scripted["thread"][1]), (64, scripted["thread"][2])):
        codec_us = encode_decode_us(num_streams)
        print(
            f"{num_streams:>3} stream(s): {codec_us:8.1f} us of {step_us:8.1f} us per step = {codec_us / step_us:6.1%}"
        )
    if not args.skip_model:
        model = await bench_model(model_path, args.model_tokens)
        print_table(
            f"SmolLM2-135M, {args.model_tokens} tokens per stream",
            ["step, 1 stream (ms)", "step, 8 streams (ms)"],
            model,
        )


if __name__ == "__main__":
    asyncio.run(main())
