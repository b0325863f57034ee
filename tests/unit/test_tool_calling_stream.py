"""Incremental tool-call extraction: however the text is split, the deltas reassemble to the one-piece result."""

from __future__ import annotations

import json
import random

import pytest

from asyncllm.outputs import ToolCall
from asyncllm.processing.tool_calling_stream import (
    BufferedParserStream,
    HermesCallStream,
    NamedCallStream,
    PlainStream,
    RequiredCallsStream,
    ToolCallStream,
)
from asyncllm.processing.tool_parsers import HermesToolParser

REQUIRED = '[{"name": "add", "arguments": {"a": 1, "b": "x}y\\\\\\"z]"}}, {"name": "now", "arguments": {}}]'
HERMES = (
    'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> <tool text\n'
    '<tool_call>{"name": "now", "arguments": {}}'
)


def splits(text: str, seed: int) -> list[list[str]]:
    """The text whole, one character at a time, and in random pieces."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(12, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return [[text], list(text), pieces]


def reassemble(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed the pieces; rebuild content and calls from the deltas alone (as the OpenAI client does)."""
    content, calls = "", []
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, finished=i == len(pieces) - 1)
        content += delta.content
        for call in delta.calls:
            if call.id is not None:
                assert call.index == len(calls)
                assert call.name is not None
                calls.append([call.name, call.arguments])
            else:
                assert call.name is None
                assert call.index == len(calls) - 1
                calls[call.index][1] += call.arguments
    assert content == stream.content
    assert [(c.name, c.arguments) for c in stream.calls] == [tuple(c) for c in calls]
    return content, [(name, args) for name, args in calls]


@pytest.mark.parametrize("seed", range(5))
def test_required_calls_stream_the_raw_arguments_of_each_call(seed: int) -> None:
    for pieces in splits(REQUIRED, seed):
        content, calls = reassemble(RequiredCallsStream(), pieces)
        assert content == ""
        assert calls == [("add", '{"a": 1, "b": "x}y\\\\\\"z]"}'), ("now", "{}")]
        assert [json.loads(args) for _, args in calls] == [item["arguments"] for item in json.loads(REQUIRED)]


def test_required_call_cut_off_streams_what_it_has() -> None:
    content, calls = reassemble(RequiredCallsStream(), list('[{"name": "add", "arguments": {"a": 1, "b'))
    assert (content, calls) == ("", [("add", '{"a": 1, "b')])
    assert reassemble(RequiredCallsStream(), ['[{"name": "ad']) == ("", [])


@pytest.mark.parametrize("seed", range(5))
def test_hermes_stream_keeps_unknown_names_and_text_as_content(seed: int) -> None:
    for pieces in splits(HERMES, seed):
        content, calls = reassemble(HermesCallStream(["add", "now"]), pieces)
        assert content == 'Let me check.<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> <tool text'
        assert calls == [("add", '{"a": 1, "b": 2}'), ("now", "{}")]
    parsed, parsed_calls = HermesToolParser().extract_tool_calls(HERMES)  # the library parser: any name
    assert [c.name for c in parsed_calls] == ["add", "rm_rf", "now"]
    assert parsed == "Let me check.<tool text"  # whitespace next to a call is dropped


def test_hermes_stream_sends_plain_text_at_once_except_what_may_start_a_tag() -> None:
    stream = HermesCallStream(["add"])
    assert stream.feed("Hello wor").content == "Hello wor"
    assert stream.feed("ld. <tool").content == "ld."
    assert stream.feed("box> ok").content == " <toolbox> ok"
    assert stream.feed("\n", finished=True).content == "\n"
    assert stream.calls == []


@pytest.mark.parametrize("seed", range(3))
def test_named_and_plain_streams(seed: int) -> None:
    args = '{"timezone": "Europe/Paris"}'
    for pieces in splits(args, seed):
        assert reassemble(NamedCallStream("clock"), pieces) == ("", [("clock", args)])
        assert reassemble(PlainStream(), pieces) == (args, [])


def test_other_parsers_are_read_once_at_the_end_and_unknown_names_stay_content() -> None:
    class Pythonic:
        """A toy whole-text parser: `name(json)` lines are calls."""

        def extract_tool_calls(self, text: str) -> tuple[str, list[ToolCall]]:
            calls = [ToolCall("call_x", line.split("(")[0], line[line.index("(") + 1 : -1]) for line in text.split()]
            return "", calls

    stream = BufferedParserStream(Pythonic(), ["add"])
    assert stream.feed('add({"a":1})').calls == []  # nothing before the end
    delta = stream.feed(' add({"a":2})', finished=True)
    assert [(c.index, c.name, c.arguments) for c in delta.calls] == [(0, "add", '{"a":1}'), (1, "add", '{"a":2}')]
    unknown = BufferedParserStream(Pythonic(), ["add"])
    assert unknown.feed('rm({"a":1})', finished=True).content == 'rm({"a":1})'
    assert unknown.calls == []
