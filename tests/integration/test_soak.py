"""Soak: 300 greedy requests per engine mode at high concurrency on the real model, 30% cancelled at random
points, with a KV cache small enough to force preemption part of the time. Every surviving request gets exactly the
output it gets alone; afterwards nothing per-request is left in the frontend, the client or the engine, every KV
block is free, and the resident memory of both processes is back within 10% of its level after warm-up.

Size: `SOAK_REQUESTS` per engine mode (see docs/reliability.md for its runtime on the 2-core CI machine);
`ASYNCLLM_SOAK_REQUESTS` overrides it for local runs.
"""

from __future__ import annotations

import gc
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from asyncllm import AsyncLLM, EngineArgs, RequestOutput, RequestOutputKind, SamplingParams
from tests.integration.conftest import MODES, wait_until_idle

pytestmark = pytest.mark.slow

SOAK_REQUESTS = int(os.environ.get("ASYNCLLM_SOAK_REQUESTS", "300"))
CONCURRENCY = 64  # requests in flight at once (max_num_seqs=32: the rest wait in the engine's queue)
CANCEL_FRACTION = 0.3
NUM_KV_BLOCKS = 36  # 576 tokens: 32 running sequences of up to ~120 tokens do not fit -> preemption
RSS_TOLERANCE = 1.10
CANCEL_POINTS = ("before_first_token", "while_queued", "mid_stream", "right_after_finishing")
SEED = 12

REFERENCES: list[Reference] = []
WORDS = ["river", "stone", "light", "garden", "window", "morning", "paper", "silver", "market", "quiet"]


@dataclass(frozen=True)
class PromptSpec:
    """One prompt and the params that fix its greedy output (the varied params never change the tokens)."""

    prompt: str
    max_tokens: int
    stop: tuple[str, ...] = ()


@dataclass
class Reference:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float]


@dataclass
class Tally:
    completed: int = 0
    cancelled: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CANCEL_POINTS, 0))
    reused: int = 0
    mismatches: list[str] = field(default_factory=list)


def prompt_specs() -> list[PromptSpec]:
    """12 prompts from ~12 to ~110 tokens; max_tokens 2, 5 or 8 (enough for 1-3 outputs before a mid-stream cut
    and for stop strings to stop: few decode steps per request); every fourth has stop strings."""
    rng = random.Random(SEED)
    specs = []
    for i in range(12):
        length = [1, 4, 12, 40, 90][i % 5]
        body = " ".join(rng.choice(WORDS) for _ in range(length))
        prompt = f"Note {i}: {body}. Describe it in one sentence:"
        stop = (".", "\n") if i % 4 == 0 else ()
        specs.append(PromptSpec(prompt, max_tokens=[2, 5, 8][i % 3], stop=stop))
    return specs


def params_for(spec: PromptSpec, n: int, kind: RequestOutputKind, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=spec.max_tokens, temperature=0.0, n=n, output_kind=kind, logprobs=logprobs, stop=list(spec.stop)
    )


async def solo_references(llm: AsyncLLM, specs: list[PromptSpec]) -> list[Reference]:
    """Each prompt alone (one request in the engine at a time), with logprobs of the sampled tokens."""
    refs = []
    for spec in specs:
        final = await llm.generate(spec.prompt, params_for(spec, 1, RequestOutputKind.CUMULATIVE, 1)).collect()
        out = final.outputs[0]
        assert out.logprobs is not None
        sampled = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        refs.append(Reference(list(out.token_ids), out.text, out.finish_reason, sampled))
    return refs


def merge_final(outputs: list[RequestOutput], kind: RequestOutputKind, n: int) -> list[dict[str, Any]]:
    """Per completion index: all token ids, text, sampled logprobs and the finish reason of a finished stream."""
    merged = [{"token_ids": [], "text": "", "logprobs": [], "finish_reason": None} for _ in range(n)]
    for output in outputs:
        for completion in output.outputs:
            slot = merged[completion.index]
            if kind is RequestOutputKind.DELTA:
                slot["token_ids"] += completion.token_ids
                slot["text"] += completion.text
                slot["logprobs"] += completion.logprobs or []
            else:
                slot["token_ids"] = list(completion.token_ids)
                slot["text"] = completion.text
                slot["logprobs"] = list(completion.logprobs or [])
            slot["finish_reason"] = completion.finish_reason or slot["finish_reason"]
    return merged


def check_survivor(
    request_id: str, outputs: list[RequestOutput], kind: RequestOutputKind, n: int, logprobs: int | None, ref: Reference
) -> str | None:
    """None when the request's output equals the solo reference; else what differs."""
    if not outputs or not outputs[-1].finished:
        return f"{request_id}: stream ended without a finished output"
    for i, got in enumerate(merge_final(outputs, kind, n)):
        where = f"{request_id}[{i}] ({kind.name}, n={n}, logprobs={logprobs})"
        if got["token_ids"] != ref.token_ids or got["text"] != ref.text:
            return f"{where}: {got['token_ids']} {got['text']!r} != {ref.token_ids} {ref.text!r}"
        if got["finish_reason"] != ref.finish_reason:
            return f"{where}: finish_reason {got['finish_reason']} != {ref.finish_reason}"
        if logprobs is not None:
            sampled = [lp[t].logprob for lp, t in zip(got["logprobs"], got["token_ids"], strict=True)]
            if sampled != pytest.approx(ref.logprobs, abs=0.05):
                return f"{where}: sampled logprobs {sampled} != {ref.logprobs}"
    return None


async def run_request(
    llm: AsyncLLM, request_id: str, spec: PromptSpec, ref: Reference, rng: random.Random, tally: Tally
) -> None:
    """One soak request: read to the end (checked against `ref`), or cancel it at a random point."""
    n = rng.choice((1, 1, 3))
    kind = rng.choice((RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE))
    logprobs = rng.choice((None, None, 2))
    cancel = rng.choice(CANCEL_POINTS) if rng.random() < CANCEL_FRACTION else None
    stream = llm.generate(spec.prompt, params_for(spec, n, kind, logprobs), request_id=request_id)
    outputs: list[RequestOutput] = []
    if cancel == "before_first_token":
        await stream.aclose()
    elif cancel == "while_queued":
        with anyio.move_on_after(rng.uniform(0.0, 0.05)):  # a cancelled task, most often before any output
            async for output in stream:
                outputs.append(output)
        await stream.aclose()
    elif cancel == "mid_stream":
        how = -1
        async for output in stream:
            outputs.append(output)
            if len(outputs) >= rng.randint(1, 3):
                how = rng.randrange(3)
                if how == 0:
                    await llm.abort(request_id)  # the stream then ends with finish_reason "abort"
                    outputs += [out async for out in stream]
                    assert outputs[-1].finished
                break  # how 1: leave the loop, then aclose(); how 2: leave it and let the stream be dropped
        if how == 1:
            await stream.aclose()
        del stream
    else:
        outputs = [out async for out in stream]
        if cancel == "right_after_finishing":
            await llm.abort(request_id)  # a finished request: ignored
            tally.cancelled[cancel] += 1
        problem = check_survivor(request_id, outputs, kind, n, logprobs, ref)
        if problem is not None:
            tally.mismatches.append(problem)
        tally.completed += 1
        return
    tally.cancelled[cancel] += 1
    if rng.random() < 0.5:  # reuse the id at once: the fresh request must get exactly the reference output
        again = llm.generate(spec.prompt, params_for(spec, n, kind, logprobs), request_id=request_id)
        problem = check_survivor(request_id, [out async for out in again], kind, n, logprobs, ref)
        if problem is not None:
            tally.mismatches.append(f"reused id: {problem}")
        tally.reused += 1


async def run_soak(llm: AsyncLLM, specs: list[PromptSpec], refs: list[Reference], count: int, seed: int) -> Tally:
    tally = Tally()
    rng = random.Random(seed)
    limiter = anyio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        async with limiter:
            k = rng.randrange(len(specs))
            await run_request(llm, f"soak-{seed}-{i}", specs[k], refs[k], random.Random(rng.random()), tally)

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(one, i)
    return tally


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def megabytes(sizes: dict[str, int]) -> dict[str, int]:
    return {name: size >> 20 for name, size in sizes.items()}


def pids_of(llm: AsyncLLM) -> dict[str, int]:
    pids = {"frontend": os.getpid()}
    process = llm._client.process
    if process is not None:
        pids["engine"] = process.pid
    return pids


async def assert_nothing_left(llm: AsyncLLM) -> None:
    """No per-request state anywhere; every KV block free."""
    await wait_until_idle(llm, within=30.0)
    assert llm._output_processor._states == {}
    assert llm._output_processor._parents == {}
    assert llm._output_processor._external_ids == {}
    assert not llm._client._outputs
    assert llm._client._results == {}
    counts = await llm._client.call_utility_async("count_request_states")
    assert counts == dict.fromkeys(counts, 0), counts


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode", MODES)
def test_soak_with_random_cancellations(model_path: str, mode: str) -> None:
    args = EngineArgs(
        model=model_path,
        engine_process=mode == "process",
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_seqs=32,
        quantization=None,
    )
    specs = prompt_specs()

    async def body() -> None:
        async with AsyncLLM.from_engine_args(args) as llm:
            if not REFERENCES:  # computed once, in the first mode; the other mode must match them too
                REFERENCES.extend(await solo_references(llm, specs))
            refs = REFERENCES
            assert sum(r.finish_reason == "stop" for r in refs) >= 1  # some stop strings really stop
            warm = await run_soak(llm, specs, refs, CONCURRENCY, seed=1)  # warm-up: same load, checked too
            assert warm.mismatches == []
            await assert_nothing_left(llm)
            gc.collect()
            before = {name: rss_bytes(pid) for name, pid in pids_of(llm).items()}
            preemptions_before = (await llm.get_scheduler_stats()).num_preemptions

            started = time.monotonic()
            tally = await run_soak(llm, specs, refs, SOAK_REQUESTS, seed=2)
            took = time.monotonic() - started

            assert tally.mismatches == [], tally.mismatches[:10]
            num_cut = sum(tally.cancelled.values()) - tally.cancelled["right_after_finishing"]
            assert tally.completed + num_cut == SOAK_REQUESTS
            assert all(count > 0 for count in tally.cancelled.values()), tally.cancelled
            assert tally.reused > 0
            stats = await llm.get_scheduler_stats()
            assert stats.num_preemptions > preemptions_before  # the small cache forced preemption
            await assert_nothing_left(llm)
            gc.collect()
            after = {name: rss_bytes(pid) for name, pid in pids_of(llm).items()}
            print(
                f"soak {mode}: {SOAK_REQUESTS} requests in {took:.1f} s, completed {tally.completed}, cancelled "
                f"{tally.cancelled}, reused {tally.reused}, preemptions {stats.num_preemptions - preemptions_before}, "
                f"RSS MB before {megabytes(before)} after {megabytes(after)}"
            )
            for name, rss in after.items():
                assert rss <= RSS_TOLERANCE * before[name], f"{name} RSS {before[name] >> 20} -> {rss >> 20} MB"

    anyio.run(body)
