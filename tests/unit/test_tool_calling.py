"""Tool calling without the engine: the Hermes parser, tool/tool_choice validation, forced-call schemas, prompt
rendering (template without tools support: the real SmolLM2 template; with support: a small template)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.model.loading.tokenizer import Tokenizer
from asyncllm.outputs import CompletionOutput, RequestOutput, ToolCall
from asyncllm.processing.tool_calling import MAX_PARALLEL_TOOL_CALLS, forced_call_schema, normalize_tools, plan_chat
from asyncllm.processing.tool_parsers import HermesToolParser, ToolParser, get_tool_parser, register_tool_parser
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured_outputs import StructuredOutputsParams

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer.load(model_path)


def test_hermes_parser_extracts_calls_and_keeps_the_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "now", "arguments": {}}'
    )
    content, calls = HermesToolParser().extract_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("now", {})]
    assert len({c.id for c in calls}) == 2
    assert all(c.id.startswith("call_") for c in calls)
    broken = "<tool_call>{not json}</tool_call> hello"
    assert HermesToolParser().extract_tool_calls(broken) == (broken, [])
    assert HermesToolParser().extract_tool_calls("plain answer") == ("plain answer", [])


def test_parsers_are_pluggable() -> None:
    @register_tool_parser("test-upper")
    class Upper(ToolParser):
        def extract_tool_calls(self, text: str) -> tuple[str, list[ToolCall]]:
            return text.upper(), []

    assert get_tool_parser("test-upper").extract_tool_calls("x") == ("X", [])
    with pytest.raises(InvalidRequestError, match="unknown tool_parser"):
        get_tool_parser("nope")


def test_bad_tools_and_tool_choice_are_rejected(tokenizer: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ([{"type": "function"}], "auto", "tools\\[0\\]"),
        ([ADD, ADD], "auto", "unique"),
        ([ADD], "sometimes", "tool_choice"),
        ([ADD], {"type": "function", "function": {"name": "mul"}}, "not among the tools"),
        (None, "required", "at least one tool"),
    ]
    for tools, choice, words in cases:
        with pytest.raises(InvalidRequestError, match=words):
            plan_chat(tokenizer, msgs, None, tools, choice)
    so = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(InvalidRequestError, match="cannot be combined"):
        plan_chat(tokenizer, msgs, so, [ADD], "required")


def test_forced_schemas_accept_exactly_valid_calls() -> None:
    specs = normalize_tools([ADD, NOW])
    named = forced_call_schema(specs, "add", parallel=True)
    jsonschema.validate({"a": 1, "b": 2}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": 1}, named)
    required = forced_call_schema(specs, None, parallel=False)
    jsonschema.validate([{"name": "now", "arguments": {}}], required)
    for bad in ([], [{"name": "add", "arguments": {"a": 1}}], [{"name": "now", "arguments": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    parallel = forced_call_schema(specs, None, parallel=True)  # bounded: a repeating model still ends
    jsonschema.validate([{"name": "now", "arguments": {}}] * MAX_PARALLEL_TOOL_CALLS, parallel)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "arguments": {}}] * (MAX_PARALLEL_TOOL_CALLS + 1), parallel)


def test_template_without_tools_gets_a_system_prompt_and_hermes_history(tokenizer: Tokenizer) -> None:
    call = ToolCall("call_1", "add", '{"a": 1, "b": 2}')
    msgs = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [call.to_message_dict()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    plan = plan_chat(tokenizer, msgs, None, [ADD], {"type": "function", "function": {"name": "add"}})
    text = plan.prompt["prompt"]
    assert text.startswith("<|im_start|>system\nYou can call functions")
    assert '"name": "add"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text
    assert plan.prompt["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)
    assert plan.sampling_params.structured_outputs == StructuredOutputsParams(json=ADD["function"]["parameters"])
    none = plan_chat(tokenizer, msgs[:1], None, [ADD], "none")
    assert "You can call functions" not in none.prompt["prompt"]
    assert none.sampling_params.structured_outputs is None


def test_template_with_tools_support_renders_them_itself(tokenizer: Tokenizer) -> None:
    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    own = Tokenizer(tokenizer.hf, None, tokenizer.eos_token_id, template, False)
    plan = plan_chat(own, [{"role": "user", "content": "go"}], None, [ADD, NOW], "auto")
    assert plan.prompt["prompt"] == "[add][now]go"


def test_finish_fills_tool_calls(tokenizer: Tokenizer) -> None:
    def output(text: str) -> RequestOutput:
        return RequestOutput("r", None, [], [CompletionOutput(0, text, [], "stop")], finished=True)

    msgs = [{"role": "user", "content": "x"}]
    required = plan_chat(tokenizer, msgs, None, [ADD, NOW], "required").finish(
        output('[{"name": "add", "arguments": {"a": 4, "b": 5}}]')
    )
    (call,) = required.outputs[0].tool_calls or []
    assert (call.name, json.loads(call.arguments), required.outputs[0].text) == ("add", {"a": 4, "b": 5}, "")
    auto = plan_chat(tokenizer, msgs, None, [NOW], "auto").finish(output("It is noon."))
    assert auto.outputs[0].tool_calls is None
    assert auto.outputs[0].text == "It is noon."
    cut = plan_chat(tokenizer, msgs, None, [ADD], {"type": "function", "function": {"name": "add"}})
    assert cut.finish(output('{"a": 4, "b"')).outputs[0].tool_calls is None
    early = plan_chat(tokenizer, msgs, None, [ADD, NOW], "required").finish(output('[{"name": "ad'))
    assert (early.outputs[0].tool_calls, early.outputs[0].text) == (None, '[{"name": "ad')  # cut-off text kept
