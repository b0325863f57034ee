"""Every numeric field of SamplingParams is range-checked at submission: a value the wire (msgpack int64) or the
engine cannot carry is an InvalidRequestError naming the field, never an OverflowError from the encoder."""

from __future__ import annotations

import msgspec
import pytest

from asyncllm import InvalidRequestError, SamplingParams
from asyncllm.sampling_params import MAX_INT64, MAX_N, SAMPLING_EPS

HUGE = 2**64 + 5  # the failing input of issue 12: OverflowError from the msgpack encoder in process mode


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": HUGE}, "seed"),
        ({"seed": MAX_INT64 + 1}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": MAX_INT64, "n": 2}, "seed"),  # child 1 would get seed 2**63
        ({"n": MAX_N + 1}, "n"),
        ({"n": HUGE}, "n"),
        ({"max_tokens": HUGE}, "max_tokens"),
        ({"min_tokens": HUGE, "max_tokens": None}, "min_tokens"),
        ({"top_k": HUGE}, "top_k"),
        ({"stream_interval": HUGE}, "stream_interval"),
        ({"logprobs": HUGE}, "logprobs"),
        ({"prompt_logprobs": HUGE}, "prompt_logprobs"),
        ({"stop_token_ids": [HUGE]}, "stop_token_ids"),
        ({"allowed_token_ids": [3, HUGE]}, "allowed_token_ids"),
        ({"logit_bias": {HUGE: 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias"),
        ({"logit_bias": {3: HUGE}}, "logit_bias"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": HUGE * 1e300}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
    ],
)
def test_out_of_range_numbers_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field}=") as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seed": 0},
        {"seed": MAX_INT64},
        {"seed": MAX_INT64 - 3, "n": 4},
        {"n": MAX_N},
        {"max_tokens": MAX_INT64},
        {"top_k": MAX_INT64},
        {"stream_interval": MAX_INT64},
        {"stop_token_ids": [MAX_INT64]},
        {"allowed_token_ids": [MAX_INT64]},
        {"logit_bias": {MAX_INT64: float("inf")}},  # clamped to [-100, 100] by the sampler
        {"temperature": 1e-44},
        {"repetition_penalty": 1e30},
    ],
)
def test_the_largest_accepted_values_cross_the_wire(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


def test_a_value_set_after_construction_is_checked_again() -> None:
    params = SamplingParams()
    params.seed = HUGE
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\.seed="):
        params.validate()


@pytest.mark.parametrize("temperature", [0.0, 1e-44, 1e-38, 5e-6, SAMPLING_EPS / 2])
def test_a_temperature_below_the_epsilon_is_greedy(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).greedy


@pytest.mark.parametrize("temperature", [SAMPLING_EPS, 0.01, 1.0])
def test_a_temperature_at_or_above_the_epsilon_samples(temperature: float) -> None:
    assert not SamplingParams(temperature=temperature).greedy


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "presence_penalty"])
def test_an_int_beyond_64_bits_in_a_float_field_names_the_field(field: str) -> None:
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: HUGE})
