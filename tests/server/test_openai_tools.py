"""Tools and response formats on `/v1/chat/completions`: the real server (shared, real model) and the official
`openai` client. Forced calls (required, named) streamed and not, JSON output formats, and 400s naming the field.
Greedy decoding, so the streamed answer reassembled by the client must equal the non-streamed one."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI

pytestmark = pytest.mark.mp

MODEL = "smollm2-135m-instruct"
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "pattern": "^[0-9+*/() .-]{1,24}$"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TOOLS: list[Any] = [CALCULATOR, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is 12 times 7? And what time is it in Tokyo?"}]
NAMED = {"type": "function", "function": {"name": "clock"}}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("choice", [pytest.param("required", marks=pytest.mark.slow), "named"])
async def test_forced_tool_calls_streamed_and_not_are_equal_and_valid(base_url: str, choice: str) -> None:
    tool_choice: Any = NAMED if choice == "named" else "required"
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0,
        "max_tokens": 96,
    }
    async with client(base_url) as oai:
        full = await oai.chat.completions.create(**kwargs)
        raw = await oai.chat.completions.create(**kwargs, stream=True)
        chunks = [chunk async for chunk in raw]
        async with oai.chat.completions.stream(**kwargs) as stream:  # the client's own delta accumulation
            streamed = await stream.get_final_completion()
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    assert message.tool_calls
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]  # type: ignore[union-attr]
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if choice == "named":
        assert [name for name, _ in calls] == ["clock"]
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    # the client's accumulation of the deltas gives the same calls and finish reason
    assert streamed.choices[0].finish_reason == "tool_calls"
    streamed_calls = streamed.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in streamed_calls] == calls
    # the deltas are shaped as OpenAI streams them: the first piece of a call names it, later pieces add arguments
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    firsts = [p for p in pieces if p.id is not None]
    assert [(p.index, p.type, p.function and p.function.name) for p in firsts] == [
        (i, "function", name) for i, (name, _) in enumerate(calls)
    ]
    assert all(p.type is None and p.function and p.function.name is None for p in pieces if p.id is None)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


@pytest.mark.timeout(600)
async def test_auto_tool_choice_streamed_equals_non_streamed(base_url: str) -> None:
    """ "auto": the model answers in its own words or its own `<tool_call>` format; either way the streamed
    deltas reassemble to the non-streamed message, and any call names an offered tool with valid arguments."""
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 48}
    async with client(base_url) as oai:
        full = await oai.chat.completions.create(**kwargs)
        async with oai.chat.completions.stream(**kwargs) as stream:
            streamed = await stream.get_final_completion()
    choice, streamed_choice = full.choices[0], streamed.choices[0]
    assert (streamed_choice.message.content or None) == choice.message.content
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
    assert [(c.function.name, c.function.arguments) for c in streamed_choice.message.tool_calls or []] == calls
    assert streamed_choice.finish_reason == choice.finish_reason
    assert choice.finish_reason in (("tool_calls",) if calls else ("stop", "length"))
    for name, arguments in calls:
        assert name in SCHEMAS
        json.loads(arguments)


# The Hermes call format the "auto" prompt asks for (`tool_calling.tools_system_prompt`), as a regex admitting
# exactly one valid call of either offered tool: which tool and which arguments stay the model's choice.
HERMES_CALL = "|".join(
    rf'<tool_call>\n\{{"name": "{name}", "arguments": \{{"{argument}": "{value}"\}}\}}\n</tool_call>'
    for name, argument, value in [
        ("calculator", "expression", "[0-9+*/() .-]{1,24}"),
        ("clock", "timezone", "(UTC|Europe/Paris|Asia/Tokyo)"),
    ]
)


@pytest.mark.timeout(600)
async def test_auto_tool_choice_parses_the_models_own_call(base_url: str) -> None:
    """ "auto" with a constrained first turn, so a call is certain: the model writes its answer in the Hermes
    format (a regex over both tools; the model picks the tool and its arguments), and the server's "auto" path
    must parse it into a `tool_calls` message, streamed and not alike, with no call text left in the content."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": 64,
        "extra_body": {"structured_outputs": {"regex": HERMES_CALL}},
    }
    async with client(base_url) as oai:
        full = await oai.chat.completions.create(**kwargs)
        async with oai.chat.completions.stream(**kwargs) as stream:
            streamed = await stream.get_final_completion()
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content, choice.message.content
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
    assert len(calls) == 1, choice.message
    name, arguments = calls[0]
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert choice.message.tool_calls[0].id.startswith("call_")  # type: ignore[index]
    streamed_choice = streamed.choices[0]
    assert streamed_choice.finish_reason == "tool_calls"
    assert not streamed_choice.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed_choice.message.tool_calls or []] == calls


@pytest.mark.timeout(600)
async def test_response_formats_give_valid_json(base_url: str) -> None:
    ask = [{"role": "user", "content": "Give a JSON object with the name and age of a person."}]
    schema_format: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    async with client(base_url) as oai:
        by_schema = await oai.chat.completions.create(
            model=MODEL, messages=ask, response_format=schema_format, temperature=0, max_tokens=64
        )
        by_object = await oai.chat.completions.create(
            model=MODEL, messages=ask, response_format={"type": "json_object"}, temperature=0, max_tokens=64
        )
        by_choice = await oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
            temperature=0,
            max_tokens=8,
        )
    for response in (by_schema, by_object):
        assert response.choices[0].finish_reason == "stop", response.choices[0].message.content
        assert response.choices[0].message.tool_calls is None
    jsonschema.validate(json.loads(by_schema.choices[0].message.content or ""), PERSON)
    assert isinstance(json.loads(by_object.choices[0].message.content or ""), dict)
    assert by_choice.choices[0].message.content in ("yes", "no")


BAD_BODIES = [
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [CALCULATOR, CALCULATOR]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mail"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"guided_json": PERSON}, "guided_json"),
]  # fmt: skip


async def test_bad_tools_and_formats_are_400_naming_the_field(base_url: str) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        for extra, param in BAD_BODIES:
            body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
            response = await http.post(f"{base_url}/v1/chat/completions", json=body)
            assert response.status_code == 400, (extra, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["param"] == param, (extra, error)
        # the server still serves
        ok = await http.post(f"{base_url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2})
        assert ok.status_code == 200
