"""The server and CLI pieces that need no engine: flags from EngineArgs, request -> SamplingParams, logprobs
shapes, error mapping."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from asyncllm import EngineArgs, InvalidRequestError, Logprob, RequestOutputKind
from asyncllm.entrypoints.arg_utils import add_engine_args, engine_args_from, field_docs
from asyncllm.entrypoints.openai.errors import to_api_error, validation_error_to_api_error
from asyncllm.entrypoints.openai.logprobs import to_chat_logprobs, to_completion_logprobs
from asyncllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from asyncllm.errors import EngineDeadError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_every_engine_args_field_but_model_has_a_flag_with_help() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    docs = field_docs()
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        assert "--" + f.name.replace("_", "-") in flags
        assert docs.get(f.name), f"no docstring line for EngineArgs.{f.name}"
    assert "--max-num-seqs" in parser.format_help()  # every help text formats (a bare % in a docstring would not)


def test_flags_parse_to_engine_args_of_the_right_types() -> None:
    ns = parse(
        "--max-num-seqs", "8", "--no-engine-process", "--scheduling-policy", "priority",
        "--max-model-len", "512", "--stats-log-interval", "2.5",
    )  # fmt: skip
    args = engine_args_from(ns, "m.gguf")
    assert args == EngineArgs(
        model="m.gguf",
        max_num_seqs=8,
        engine_process=False,
        scheduling_policy="priority",
        max_model_len=512,
        stats_log_interval=2.5,
    )
    assert engine_args_from(parse(), "x") == EngineArgs(model="x")  # defaults are EngineArgs' own


def test_bad_flag_values_are_usage_errors() -> None:
    for argv in (["--max-num-seqs", "many"], ["--scheduling-policy", "random"]):
        with pytest.raises(SystemExit):
            parse(*argv)


def test_completion_request_maps_every_sampling_field() -> None:
    request = CompletionRequest(
        prompt="hi", n=2, stop="x", temperature=0.5, top_p=0.9, seed=3, presence_penalty=0.1,
        frequency_penalty=0.2, logit_bias={"7": 5.0}, top_k=4, min_p=0.05, repetition_penalty=1.1,
        min_tokens=1, ignore_eos=True, stop_token_ids=[2], max_tokens=9, logprobs=2,
    )  # fmt: skip
    params = request.to_sampling_params(request.max_tokens, request.logprobs)
    assert (params.n, params.stop, params.temperature, params.top_p, params.seed) == (2, ["x"], 0.5, 0.9, 3)
    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias) == (0.1, 0.2, {7: 5.0})
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens) == (4, 0.05, 1.1, 1)
    assert (params.ignore_eos, params.stop_token_ids, params.max_tokens, params.logprobs) == (True, [2], 9, 2)
    assert params.output_kind == RequestOutputKind.DELTA


def test_out_of_range_fields_name_the_request_field() -> None:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=0)
    with pytest.raises(InvalidRequestError) as info:
        request.to_sampling_params(request.max_completion_tokens, None)
    error = to_api_error(info.value, {"max_tokens": request.max_tokens_field})
    assert (error.status, error.param) == (400, "max_completion_tokens")
    bias = CompletionRequest(prompt="hi", logit_bias={"seven": 1.0})
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        bias.to_sampling_params(4, None)
    assert to_api_error(EngineDeadError()).status == 503
    assert to_api_error(RuntimeError("bug")).status == 500


def test_pydantic_errors_name_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=[{"role": "user", "content": 5}], top_logprobs=21)
    error = validation_error_to_api_error(RequestValidationError(info.value.errors()))
    assert error.status == 400
    assert error.param is not None
    assert error.param.startswith("messages.0.content")
    with pytest.raises(ValidationError, match="extra"):
        CompletionRequest(prompt="hi", echo_twice=True)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="Stream options can only be defined when `stream=True`"):
        CompletionRequest(prompt="hi", stream_options={"include_usage": True})  # type: ignore[arg-type]


def test_chat_content_parts_are_joined_text() -> None:
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert request.messages[0].text() == "a\nb"


POSITIONS = [
    {5: Logprob(-0.1, 1, "Hel"), 6: Logprob(-2.5, 2, "He"), 9: Logprob(-3.0, 3, "X")},
    {7: Logprob(-1.2, 2, "lo"), 8: Logprob(-0.4, 1, "p")},  # the sampled token (7) is not the top one
]


def test_completion_logprobs_shape() -> None:
    lp = to_completion_logprobs([5, 7], POSITIONS, k=1, text_offset=10)
    assert lp.tokens == ["Hel", "lo"]
    assert lp.token_logprobs == [-0.1, -1.2]
    assert lp.top_logprobs == [{"Hel": -0.1}, {"p": -0.4}]
    assert lp.text_offset == [10, 13]


def test_chat_logprobs_shape() -> None:
    lp = to_chat_logprobs([5, 7], POSITIONS, k=2)
    assert lp.content is not None
    first, second = lp.content
    assert (first.token, first.logprob, first.bytes) == ("Hel", -0.1, list(b"Hel"))
    assert [t.token for t in first.top_logprobs] == ["Hel", "He"]
    assert [t.token for t in second.top_logprobs] == ["p", "lo"]
    assert to_chat_logprobs([5], POSITIONS[:1], k=0).content[0].top_logprobs == []  # type: ignore[index]


def test_the_server_prebuilds_the_grammar_compiler_and_the_library_does_not() -> None:
    from asyncllm.entrypoints.cli import make_parser

    assert EngineArgs().prebuild_grammar_compiler is False
    assert EngineArgs().create_engine_config().scheduler.prebuild_grammar_compiler is False
    served = make_parser().parse_args(["serve"])
    assert engine_args_from(served, "m").prebuild_grammar_compiler is True
    opted_out = make_parser().parse_args(["serve", "--no-prebuild-grammar-compiler"])
    assert engine_args_from(opted_out, "m").prebuild_grammar_compiler is False
    generated = make_parser().parse_args(["generate", "hi"])
    assert engine_args_from(generated, "m").prebuild_grammar_compiler is False


def test_the_server_populates_its_kv_cache_and_the_library_does_not() -> None:
    from asyncllm.entrypoints.cli import make_parser

    assert EngineArgs().populate_kv_cache is False
    assert EngineArgs().create_engine_config().cache.populate is False
    served = make_parser().parse_args(["serve"])
    assert engine_args_from(served, "m").populate_kv_cache is True
    assert dataclasses.replace(EngineArgs(), populate_kv_cache=True).create_engine_config().cache.populate is True
    opted_out = make_parser().parse_args(["serve", "--no-populate-kv-cache"])
    assert engine_args_from(opted_out, "m").populate_kv_cache is False
    generated = make_parser().parse_args(["generate", "hi"])
    assert engine_args_from(generated, "m").populate_kv_cache is False
