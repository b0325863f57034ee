"""InputProcessor: the three prompt forms, validation at submission, the length rule, request ids."""

from __future__ import annotations

import pytest

from asyncllm import InvalidRequestError, SamplingParams
from asyncllm.processing.input_processor import InputProcessor, RequestOptions

MAX_MODEL_LEN = 32
VOCAB = 49152


@pytest.fixture(scope="module")
def processor(model_path: str) -> InputProcessor:
    from asyncllm.model.loading.tokenizer import Tokenizer

    return InputProcessor(Tokenizer.load(model_path), MAX_MODEL_LEN, VOCAB)


def test_text_prompt(processor: InputProcessor) -> None:
    text, request = processor.process("Hello world", SamplingParams(max_tokens=4))
    assert text == "Hello world"
    assert request.prompt_token_ids == processor._tokenizer.encode("Hello world")
    assert request.eos_token_id == processor._tokenizer.eos_token_id
    assert request.sampling_params.max_tokens == 4
    assert request.external_req_id is not None
    assert len(request.external_req_id) == 32  # a uuid4 hex: the user's id when none is given
    assert request.request_id.startswith(request.external_req_id + "-")  # the internal id


def test_internal_ids_are_unique_even_for_one_user_id(processor: InputProcessor) -> None:
    ids = [processor.process("Hi", options=RequestOptions(request_id="same")).request for _ in range(3)]
    assert {r.external_req_id for r in ids} == {"same"}
    assert len({r.request_id for r in ids}) == 3


def test_token_prompt(processor: InputProcessor) -> None:
    text, request = processor.process({"prompt_token_ids": [5, 6, 7]})
    assert text is None
    assert request.prompt_token_ids == [5, 6, 7]


def test_chat_prompt_is_rendered_then_encoded_without_special_tokens(processor: InputProcessor) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text, request = processor.process(messages, SamplingParams(max_tokens=1))
    tokenizer = processor._tokenizer
    assert text == tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text is not None
    assert text.endswith("<|im_start|>assistant\n")
    assert request.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [VOCAB]}, "outside the vocabulary"),
        ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
        ({"prompt_token_ids": ["a"]}, "outside the vocabulary"),
        ({"prompt_token_ids": [1] * MAX_MODEL_LEN}, "at most 31 fit"),
        ({"tokens": [1]}, "unknown prompt keys"),
        ([], "no messages"),
        ([{"role": "user"}], "content"),
        (["hi"], "must be a dict"),
        (3, "prompt of type int"),
    ],
)
def test_bad_prompts_raise(processor: InputProcessor, prompt: object, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        processor.process(prompt)  # type: ignore[arg-type]


def test_bad_params_and_ids_raise(processor: InputProcessor) -> None:
    params = SamplingParams()
    params.temperature = -1.0
    with pytest.raises(InvalidRequestError, match="temperature"):
        processor.process("Hi", params)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        processor.process("Hi", SamplingParams(stop_token_ids=[VOCAB]))
    with pytest.raises(InvalidRequestError, match="request_id"):
        processor.process("Hi", options=RequestOptions(request_id=""))
    with pytest.raises(InvalidRequestError, match="sampling_params"):
        processor.process("Hi", {"max_tokens": 3})  # type: ignore[arg-type]


def test_prompt_plus_max_tokens_over_max_model_len_is_rejected(processor: InputProcessor) -> None:
    params = SamplingParams(max_tokens=3, min_tokens=2)
    _, fits = processor.process({"prompt_token_ids": [1] * (MAX_MODEL_LEN - 3)}, params)
    assert fits.sampling_params is params
    with pytest.raises(InvalidRequestError, match=r"max_tokens=3 is invalid: prompt \(30 tokens\).*at most 2"):
        processor.process({"prompt_token_ids": [1] * (MAX_MODEL_LEN - 2)}, params)


def test_max_tokens_none_means_up_to_max_model_len_without_mutating_params(processor: InputProcessor) -> None:
    params = SamplingParams(max_tokens=None)
    _, unbounded = processor.process({"prompt_token_ids": [1] * 10}, params)
    assert unbounded.sampling_params.max_tokens == MAX_MODEL_LEN - 10
    assert params.max_tokens is None
    with pytest.raises(InvalidRequestError, match="min_tokens=30 is invalid"):
        processor.process({"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=None, min_tokens=30))


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids"])
def test_out_of_vocabulary_ids_in_params_are_rejected(processor: InputProcessor, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        processor.process("Hi", SamplingParams(max_tokens=1, **{field: [1, VOCAB]}))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        processor.process("Hi", SamplingParams(max_tokens=1, logit_bias={VOCAB + 5: 1.0}))


def test_generated_request_ids_are_unique(processor: InputProcessor) -> None:
    ids = {processor.process("Hi").request.request_id for _ in range(100)}
    assert len(ids) == 100


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"priority": 2**63}, r"priority=9223372036854775808 is invalid: must be a signed 64-bit integer"),
        ({"priority": -(2**63) - 1}, r"priority=.* is invalid: must be a signed 64-bit integer"),
        ({"cache_salt": ""}, r"cache_salt='' is invalid: must be None or a non-empty str"),
        ({"cache_salt": 5}, r"cache_salt=5 is invalid"),
    ],
)
def test_priority_and_cache_salt_are_checked(processor: InputProcessor, kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        processor.process("Hi", options=RequestOptions(**kwargs))
    request = processor.process("Hi", options=RequestOptions(priority=-(2**63), cache_salt="tenant")).request
    assert (request.priority, request.cache_salt) == (-(2**63), "tenant")
