"""Tool-call parsers: turn a model's own tool-call text into `ToolCall`s (for `tool_choice="auto"`).

Pluggable: subclass `ToolParser`, decorate it with `register_tool_parser("name")`, and pass
`tool_parser="name"` to `AsyncLLM.chat`. The built-in "hermes" parser reads the format of the Hermes function
calling models (NousResearch), also used by Qwen2.5 and others: one JSON object
`{"name": ..., "arguments": {...}}` inside each `<tool_call>...</tool_call>`.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import ToolCall

_PARSERS: dict[str, type[ToolParser]] = {}
P = TypeVar("P", bound="type[ToolParser]")


def make_tool_call_id() -> str:
    """A fresh OpenAI-style tool call id ("call_" + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def make_tool_call(name: str, arguments: Any) -> ToolCall:
    """A `ToolCall` with a fresh id; `arguments` (a dict, or JSON text) is stored as compact JSON text."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=make_tool_call_id(), name=name, arguments=arguments)


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
    as when generation stops on it, is accepted)."""

    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract_tool_calls(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        kept: list[str] = []
        position = 0
        for match in self._BLOCK.finditer(text):
            call = _parse_call(match.group(1))
            if call is None:
                continue
            kept.append(text[position : match.start()])
            position = match.end()
            calls.append(call)
        if not calls:
            return text, []
        kept.append(text[position:])
        return "".join(kept).strip(), calls


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return make_tool_call(obj["name"], arguments)
