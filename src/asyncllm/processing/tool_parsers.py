"""Tool-call parsers: turn a model's own tool-call text into `ToolCall`s (for `tool_choice="auto"`).

Pluggable: subclass `ToolParser`, decorate it with `register_tool_parser("name")`, and pass
`tool_parser="name"` to `AsyncLLM.chat`. The built-in "hermes" parser reads the format of the Hermes function
calling models (NousResearch), also used by Qwen2.5 and others: one JSON object
`{"name": ..., "arguments": {...}}` inside each `<tool_call>...</tool_call>`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeVar

from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import ToolCall
from asyncllm.processing.tool_calling_stream import HermesCallStream

_PARSERS: dict[str, type[ToolParser]] = {}
P = TypeVar("P", bound="type[ToolParser]")


class ToolParser(ABC):
    """Extracts tool calls from a finished completion's text."""

    @abstractmethod
    def extract_tool_calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """Split `text` into (content without the tool-call markup, tool calls in order).

        Malformed calls are left in the content and not returned; no call found -> (text, []).
        """


def register_tool_parser(name: str) -> Callable[[P], P]:
    """Class decorator: make a `ToolParser` subclass available as `tool_parser=name`."""

    def register(cls: P) -> P:
        _PARSERS[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> ToolParser:
    """A new parser registered under `name`.

    Raises:
        InvalidRequestError: no parser has that name (the message lists the known ones).
    """
    cls = _PARSERS.get(name)
    if cls is None:
        raise InvalidRequestError(f"unknown tool_parser {name!r}; known: {sorted(_PARSERS)}")
    return cls()


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """`<tool_call>{"name": "f", "arguments": {...}}</tool_call>` blocks (a missing closing tag at the very end,
    as when generation stops on it, is accepted). The same rules as the streamed form
    (`tool_calling_stream.HermesCallStream`, which `AsyncLLM.chat` and the server use): whitespace next to a call
    is dropped, a malformed block stays content. Any function name is accepted here; the streamed form checks
    names against the offered tools."""

    def extract_tool_calls(self, text: str) -> tuple[str, list[ToolCall]]:
        stream = HermesCallStream(None)
        stream.feed(text, finished=True)
        calls = [ToolCall(call.id, call.name, call.arguments) for call in stream.calls]
        return stream.content, calls
