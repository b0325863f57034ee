"""Property-based tests (hypothesis) of hostile input: sampling parameters, prompts (random unicode, random token
ids), request sequences (submit, abort, drop, duplicate ids, shutdown in the middle) and random or mutated frames
on the engine's real socket. Nothing crashes the engine or leaves per-request state behind; bad input gets a typed
`ValueError` subclass (or fails its request alone).

Numeric fields draw from their usual range and from the extremes (integers up to 2**70, NaN, infinities, denormal
floats): every extreme must be refused at submission or served, never reach the engine as an overflow.
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm import AsyncLLM, EngineDeadError, SamplingParams
from asyncllm.engine.client import EngineCoreClient
from asyncllm.errors import AsyncLLMError, EngineGenerateError
from asyncllm.messages.engine import EngineCoreRequest, EngineCoreRequestType
from asyncllm.messages.serial import MsgpackEncoder
from tests.integration.conftest import fake_llm, greedy
from tests.unit.test_wire_fuzz import RANDOM_INPUTS, VALID_INPUTS, mutated

pytestmark = pytest.mark.slow

FEW = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
SOME = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
VOCAB = 49152


def floats(low: float, high: float) -> st.SearchStrategy[float]:
    usual = st.floats(low, high, allow_nan=False, allow_infinity=False)
    return st.one_of(usual, st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True))


def ints(low: int, high: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(low, high), st.integers(-(2**70), 2**70))


TOKEN_IDS = st.lists(st.integers(-2, VOCAB + 2), max_size=4)
PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "n": ints(-1, 3),
        "max_tokens": ints(-1, 3),  # never None: "up to max_model_len" is ~1000 tokens
        "temperature": floats(-1.0, 3.0),
        "top_p": floats(-0.5, 1.5),
        "top_k": ints(-2, 60000),
        "min_p": floats(-0.5, 1.5),
        "seed": st.one_of(st.none(), ints(-5, 2**63 - 1)),
        "presence_penalty": floats(-3.0, 3.0),
        "frequency_penalty": floats(-3.0, 3.0),
        "repetition_penalty": floats(-1.0, 3.0),
        "logit_bias": st.dictionaries(st.integers(-2, VOCAB + 2), floats(-200.0, 200.0), max_size=3),
        "allowed_token_ids": st.one_of(st.none(), TOKEN_IDS),
        "stop": st.lists(st.text(max_size=4), max_size=2),
        "stop_token_ids": TOKEN_IDS,
        "ignore_eos": st.booleans(),
        "min_tokens": ints(-1, 4),
        "logprobs": st.one_of(st.none(), ints(-1, 25)),
        "prompt_logprobs": st.one_of(st.none(), ints(-1, 25)),
        "skip_special_tokens": st.booleans(),
    },
)
PROMPTS = st.one_of(
    st.text(max_size=60),
    st.lists(st.integers(-3, VOCAB + 3), max_size=30).map(lambda ids: {"prompt_token_ids": ids}),
)


async def generate_or_refuse(llm: AsyncLLM, prompt: Any, params: dict[str, Any] | SamplingParams) -> str:
    """'ok', 'refused' (a ValueError subclass at submission) or 'failed' (EngineGenerateError, alone)."""
    try:
        sampling = params if isinstance(params, SamplingParams) else SamplingParams(**params)
        final = await llm.generate(prompt, sampling).collect()
    except EngineDeadError:
        raise
    except ValueError:
        return "refused"
    except EngineGenerateError:
        return "failed"
    assert final.finished
    return "ok"


def assert_engine_serves(llm: AsyncLLM) -> None:
    async def check() -> None:
        final = await llm.generate("Hello", greedy(2, ignore_eos=True)).collect()
        assert len(final.outputs[0].token_ids) == 2
        deadline = time.monotonic() + 120  # generous: raw requests the frontend does not know may still decode
        while (stats := await llm.get_scheduler_stats()).num_running_reqs + stats.num_waiting_reqs:
            assert time.monotonic() < deadline, stats
            await anyio.sleep(0.02)
        assert stats.num_free_blocks == stats.num_total_blocks
        assert llm._output_processor._states == {}
        counts = await llm._client.call_utility_async("count_request_states")
        assert counts == dict.fromkeys(counts, 0), counts

    anyio.run(check)
    assert not llm.errored


# ---- the real model ----------------------------------------------------------------------------------------


@FEW
@given(params=PARAMS)
def test_sampling_params_never_crash_the_engine(llm: AsyncLLM, params: dict[str, Any]) -> None:
    anyio.run(generate_or_refuse, llm, "Hi", params)
    assert not llm.errored


@FEW
@given(prompt=PROMPTS)
def test_prompts_never_crash_the_engine(llm: AsyncLLM, prompt: Any) -> None:
    outcome = anyio.run(generate_or_refuse, llm, prompt, greedy(2))
    if isinstance(prompt, dict):
        ids = prompt["prompt_token_ids"]
        valid = len(ids) > 0 and all(0 <= t < VOCAB for t in ids)
        assert (outcome == "ok") == valid, (outcome, ids)
    assert not llm.errored


@SOME
@given(frames=st.lists(st.one_of(RANDOM_INPUTS, mutated(VALID_INPUTS)), min_size=1, max_size=8))
def test_random_and_mutated_frames_on_the_socket_never_stop_the_engine(llm: AsyncLLM, frames: list) -> None:
    client = llm._client
    assert isinstance(client, EngineCoreClient)
    with client._send_lock:
        for message in frames:
            if message and bytes(message[0]) == EngineCoreRequestType.SHUTDOWN.value:
                continue  # a well-formed SHUTDOWN is the client's own command, not hostile input
            client._input.send_multipart([client._engine_identity, *message])

    async def served_after_the_frames() -> None:
        """The engine reads its socket in order: a request sent after the frames completes only once the engine
        has read them and run the step after them (a bad request that killed an engine in its next step did
        so in the step it was scheduled in, beside this one). Checking `errored` right after sending checked
        before the engine had seen them."""
        final = await llm.generate("Hello", greedy(2, ignore_eos=True)).collect()
        assert len(final.outputs[0].token_ids) == 2

    anyio.run(served_after_the_frames)  # an engine the frames killed raises EngineDeadError here
    assert not llm.errored


def test_decodable_but_invalid_requests_fail_alone(llm: AsyncLLM) -> None:
    """Raw ADD frames the frontend would refuse (an out-of-vocabulary token id once killed the engine in its
    next step): the engine refuses each one alone and keeps serving."""
    client = llm._client
    assert isinstance(client, EngineCoreClient)
    params = SamplingParams(max_tokens=2)
    huge = SamplingParams(max_tokens=2)
    huge.max_tokens = 10**6  # changed after validation: the engine validates again
    encoder = MsgpackEncoder()
    requests = [EngineCoreRequest(f"raw-{i}", ids, params, 2) for i, ids in enumerate([[VOCAB + 10**6], [-5], []])]
    requests += [
        EngineCoreRequest("raw-long", [1] * 100_000, params, 2),
        EngineCoreRequest("raw-huge", [1, 2], huge, 2),
    ]
    # the same id twice while the first still runs (found by the frame fuzzer: it broke the step's batching)
    slow = SamplingParams(max_tokens=16, ignore_eos=True)
    requests += [EngineCoreRequest("raw-dup", [1, 2, 3], slow, 2), EngineCoreRequest("raw-dup", [4], slow, 2)]
    for request in requests:
        with client._send_lock:
            client._input.send_multipart(
                [client._engine_identity, EngineCoreRequestType.ADD.value, *encoder.encode(request)]
            )
    assert_engine_serves(llm)


def test_after_fuzzing_the_engine_serves_and_holds_nothing(llm: AsyncLLM) -> None:
    assert_engine_serves(llm)


# ---- request sequences on a scripted core (the boundary alone: fast) -------------------------------------

OPS = st.lists(
    st.tuples(st.sampled_from(["submit", "abort", "drop", "read", "duplicate", "cancel"]), st.integers(0, 3)),
    min_size=1,
    max_size=25,
)


async def play(llm: AsyncLLM, ops: list[tuple[str, int]], shutdown_at: int | None) -> None:
    """Apply `ops` (on request ids "q0".."q3"); every error must be a typed one."""
    streams: dict[int, Any] = {}
    untyped: list[str] = []
    for step, (op, k) in enumerate(ops):
        if step == shutdown_at:
            await llm.shutdown()
        try:
            if op in ("submit", "duplicate"):
                if op == "submit" and k in streams:
                    await streams.pop(k).aclose()
                streams[k] = llm.generate({"prompt_token_ids": [1, 2]}, greedy(k + 1), request_id=f"q{k}")
            elif op == "abort":
                await llm.abort(f"q{k}")
            elif op == "drop":
                streams.pop(k, None)
            elif op == "read" and k in streams:
                with anyio.move_on_after(5):
                    async for _ in streams[k]:
                        pass
            elif op == "cancel" and k in streams:
                with anyio.move_on_after(0):
                    await streams[k].__anext__()
        except (ValueError, EngineDeadError, StopAsyncIteration):
            pass  # a duplicate id, a used-up or closed stream, or a shut-down engine: typed, expected
        except AsyncLLMError:
            pass
        except Exception as e:
            untyped.append(f"{op} q{k}: untyped {type(e).__name__}: {e}")
    for stream in streams.values():
        await stream.aclose()
    assert untyped == []


@pytest.fixture(scope="module")
def fake(mode: str, tokenizer: Any):
    engine = fake_llm(tokenizer, mode)
    yield engine
    anyio.run(engine.shutdown)


@SOME
@given(ops=OPS)
def test_request_sequences_never_crash_or_leak(fake: AsyncLLM, ops: list[tuple[str, int]]) -> None:
    anyio.run(play, fake, ops, None)
    assert not fake.errored

    async def settle() -> None:
        deadline = time.monotonic() + 10
        while fake._output_processor._states or (await fake.get_scheduler_stats()).num_running_reqs:
            assert time.monotonic() < deadline, fake._output_processor._states
            await anyio.sleep(0.01)

    anyio.run(settle)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, where=st.floats(0, 1))
def test_shutdown_in_the_middle_of_a_sequence(mode: str, tokenizer: Any, ops: list, where: float) -> None:
    llm = fake_llm(tokenizer, mode)
    try:
        anyio.run(play, llm, ops, math.floor(where * len(ops)))
    finally:
        anyio.run(llm.shutdown)
    with pytest.raises(EngineDeadError):
        llm.generate("Hello", greedy(2))
