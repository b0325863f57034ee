"""SamplingParams: every invalid value raises InvalidRequestError naming the field and its allowed range."""

from __future__ import annotations

import msgspec
import pytest

from asyncllm import InvalidRequestError, RequestOutputKind, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, r"n=0 is invalid: must be an integer in \[1, 128\]"),
        ({"n": 1.5}, r"n=1.5 is invalid"),
        ({"max_tokens": 0}, r"max_tokens=0 is invalid: must be an integer >= 1 or None"),
        ({"max_tokens": True}, r"max_tokens=True is invalid"),
        ({"temperature": -0.1}, r"temperature=-0.1 is invalid: must be >= 0"),
        ({"temperature": float("nan")}, r"temperature=nan is invalid"),
        ({"top_p": 0.0}, r"top_p=0.0 is invalid: must be in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p=1.01 is invalid"),
        ({"top_k": -2}, r"top_k=-2 is invalid: must be -1, 0 \(disabled\) or an integer in \[1, 2\*\*63 - 1\]"),
        ({"min_p": -0.01}, r"min_p=-0.01 is invalid: must be in \[0, 1\]"),
        ({"min_p": 1.5}, r"min_p=1.5 is invalid"),
        ({"presence_penalty": 2.5}, r"presence_penalty=2.5 is invalid: must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty=-2.5 is invalid: must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty=0.0 is invalid: must be > 0"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias=\{-1: 1.0\} is invalid: must be token ids >= 0"),
        ({"logit_bias": {3: float("nan")}}, r"logit_bias=\{3: nan\} is invalid: must be token id -> a number"),
        ({"allowed_token_ids": []}, r"allowed_token_ids=\[\] is invalid: must be None or a non-empty list"),
        ({"allowed_token_ids": [-3]}, r"allowed_token_ids=\[-3\] is invalid: must be token ids >= 0"),
        ({"stop": [""]}, r"stop=\[''\] is invalid: must be non-empty strings"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids=\[-1\] is invalid: must be token ids >= 0"),
        ({"min_tokens": -1}, r"min_tokens=-1 is invalid: must be an integer in \[0, 2\*\*63 - 1\]"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens=5 is invalid: must be <= max_tokens \(4\)"),
        ({"logprobs": -2}, r"logprobs=-2 is invalid: must be None, -1 \(the whole vocabulary\) or an integer >= 0"),
        ({"prompt_logprobs": -3}, r"prompt_logprobs=-3 is invalid: must be None, -1"),
        ({"best_of": 2}, r"best_of=2 is invalid: vLLM V1 does not yet support best_of"),
        ({"bad_words": [" "]}, r"bad_words=\[' '\] is invalid: must be a list of non-blank strings"),
        ({"stream_interval": 0}, r"stream_interval=0 is invalid: must be an integer in \[1, 2\*\*63 - 1\]"),
        ({"output_kind": 7}, r"output_kind=7 is invalid: must be a RequestOutputKind"),
        ({"seed": "x"}, r"seed='x' is invalid: must be an integer, got str"),
        ({"seed": -(1 << 64)}, r"is invalid: must be None or an integer in \[0, 9223372036854775807\]"),
    ],
)
def test_invalid_values_raise_naming_field_and_range(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)


NUMBER_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
INT_FIELDS = ["n", "max_tokens", "top_k", "min_tokens", "logprobs", "prompt_logprobs", "stream_interval", "seed"]


@pytest.mark.parametrize("field", NUMBER_FIELDS)
@pytest.mark.parametrize("value", ["0.5", None, [0.5]])
def test_wrong_type_for_a_number_field_names_field_and_type(field: str, value: object) -> None:
    with pytest.raises(
        InvalidRequestError, match=rf"SamplingParams\.{field}=.* must be a number \(int or float\), got "
    ):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", INT_FIELDS)
def test_wrong_type_for_an_integer_field_names_field_and_type(field: str) -> None:
    with pytest.raises(
        InvalidRequestError, match=rf"SamplingParams\.{field}='3' is invalid: must be an integer, got str"
    ):
        SamplingParams(**{field: "3"})
    with pytest.raises(
        InvalidRequestError, match=rf"SamplingParams\.{field}=2.0 is invalid: must be an integer, got float"
    ):
        SamplingParams(**{field: 2.0})


def test_logit_bias_value_of_the_wrong_type_names_the_type() -> None:
    with pytest.raises(
        InvalidRequestError, match=r"logit_bias=\{3: '1'\} is invalid: must be a number \(int or float\), got str"
    ):
        SamplingParams(logit_bias={3: "1"})


def test_validate_catches_values_set_after_construction() -> None:
    params = SamplingParams()
    params.top_k = -5
    with pytest.raises(InvalidRequestError, match="top_k"):
        params.validate()


def test_defaults_and_boundaries_are_valid() -> None:
    params = SamplingParams()
    assert (params.n, params.max_tokens, params.temperature, params.output_kind) == (
        1,
        16,
        1.0,
        RequestOutputKind.CUMULATIVE,
    )
    SamplingParams(
        n=4,
        max_tokens=None,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=0.5,
        logit_bias={0: -1000.0},
        allowed_token_ids=[0],
        logprobs=0,
        prompt_logprobs=20,
        stream_interval=5,
    )


def test_a_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]  # type: ignore[arg-type]


def test_vocabulary_check_names_the_field() -> None:
    SamplingParams(stop_token_ids=[9], allowed_token_ids=[9], logit_bias={9: 1.0}).validate_vocab(10)
    with pytest.raises(
        InvalidRequestError, match=r"allowed_token_ids=\[10\] is invalid: must be token ids in \[0, 10\)"
    ):
        SamplingParams(allowed_token_ids=[1, 10]).validate_vocab(10)


def test_round_trips_through_msgpack() -> None:
    params = SamplingParams(n=2, logit_bias={5: -3.0, 7: 2.5}, logprobs=3, output_kind=RequestOutputKind.DELTA)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
