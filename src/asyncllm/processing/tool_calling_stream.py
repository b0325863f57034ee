"""Incremental tool-call extraction: generated text deltas -> content deltas and tool-call deltas.

One `ToolCallStream` per completion reads the text as it is generated and says, for each new piece, which part is
content and which part belongs to which tool call, in the shape of OpenAI's streamed `delta.tool_calls`: the first
delta of a call carries its `index`, `id` and `name` (and the first piece of `arguments`, possibly ""); later deltas
carry more `arguments` text for that index. The finished result (`content`, `calls`) is by construction the
concatenation of the deltas, however the text was split, so a non-streamed answer equals the reassembled stream.

- `NamedCallStream`: a named `tool_choice`; the whole output is the arguments JSON (structured outputs force it).
- `RequiredCallsStream`: `tool_choice="required"`; the output is the forced JSON array
  `[{"name": ..., "arguments": ...}, ...]` (`tool_calling.forced_call_schema`, generated compactly); each call's
  `arguments` is its raw JSON text, streamed as it comes.
- `HermesCallStream`: `tool_choice="auto"` with the Hermes format (`<tool_call>{"name", "arguments"}</tool_call>`);
  text outside calls is content (held back only while it might start a tag); a block is sent as one call when its
  closing tag (or the end) arrives and it holds a JSON object naming an offered tool, else it stays content.
  Whitespace next to a recognised call is dropped. Calls are not streamed argument by argument: a call is only
  announced once it is known to be valid, so nothing streamed is ever taken back.
- `PlainStream`: no tools; all text is content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol


class WholeTextParser(Protocol):
    """What `BufferedParserStream` needs of a `tool_parsers.ToolParser`."""

    def extract_tool_calls(self, text: str) -> tuple[str, list[Any]]: ...


def make_tool_call_id() -> str:
    """A fresh OpenAI-style tool call id ("call_" + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A piece of one tool call: `id` and `name` only on its first delta (else None)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class StreamDelta:
    """What one text delta adds: content text and tool-call pieces (consecutive pieces of a call merged)."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add_call_piece(self, piece: ToolCallDelta) -> None:
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == piece.index and piece.id is None:
            last.arguments += piece.arguments
        else:
            self.calls.append(piece)


@dataclass
class StreamedCall:
    """A tool call assembled from its deltas."""

    id: str
    name: str
    arguments: str = ""


class ToolCallStream:
    """Base: splits a completion's text deltas into content and tool calls; keeps the assembled result."""

    def __init__(self) -> None:
        self.content = ""
        self.calls: list[StreamedCall] = []

    def feed(self, text: str, finished: bool = False) -> StreamDelta:
        """Read the next text delta (`finished`: it is the last); returns what it adds."""
        delta = StreamDelta()
        self._read(text, delta)
        if finished:
            self._finish(delta)
        return delta

    def _read(self, text: str, delta: StreamDelta) -> None:
        raise NotImplementedError

    def _finish(self, delta: StreamDelta) -> None:
        """Flush whatever was held back (the output ended)."""

    def _content(self, text: str, delta: StreamDelta) -> None:
        self.content += text
        delta.content += text

    def _start_call(self, name: str, arguments: str, delta: StreamDelta) -> None:
        call = StreamedCall(make_tool_call_id(), name, arguments)
        self.calls.append(call)
        delta.add_call_piece(ToolCallDelta(len(self.calls) - 1, arguments, call.id, name))

    def _arguments(self, text: str, delta: StreamDelta) -> None:
        self.calls[-1].arguments += text
        delta.add_call_piece(ToolCallDelta(len(self.calls) - 1, text))


class PlainStream(ToolCallStream):
    """No tool calls: every piece of text is content."""

    def _read(self, text: str, delta: StreamDelta) -> None:
        if text:
            self._content(text, delta)


class NamedCallStream(ToolCallStream):
    """A forced call of one function: the output text is its arguments (announced with the first text)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _read(self, text: str, delta: StreamDelta) -> None:
        if not text:
            return
        if not self.calls:
            self._start_call(self.name, text, delta)
        else:
            self._arguments(text, delta)


_CALL_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class RequiredCallsStream(ToolCallStream):
    """The forced array of calls, scanned one character at a time (JSON strings, escapes and nesting tracked).

    A call is announced when its `"name"` is complete and its `"arguments"` value starts; every character of that
    value is streamed as arguments; the `}` closing the call object, the separators and the array brackets are not.
    """

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0  # nesting of objects/arrays, outside strings: 1 = in the array, 2 = in a call object
        self._in_string = False
        self._escaped = False
        self._header: str | None = None  # text of the call object before its arguments value, while reading it
        self._in_arguments = False

    def _read(self, text: str, delta: StreamDelta) -> None:
        pieces: list[str] = []
        for char in text:
            if self._in_arguments and not self._in_string and char == "}" and self._depth == 2:
                self._flush_arguments(pieces, delta)
                self._in_arguments = False
            elif self._header is not None and not char.isspace() and (match := _CALL_HEADER.fullmatch(self._header)):
                self._header = None
                self._in_arguments = True
                self._start_call(json.loads(match.group(1)), "", delta)
            if self._in_arguments:
                pieces.append(char)
            elif self._header is not None:
                self._header += char
            elif not self._in_string and char == "{" and self._depth == 1:
                self._header = char
            self._track(char)
        self._flush_arguments(pieces, delta)

    def _flush_arguments(self, pieces: list[str], delta: StreamDelta) -> None:
        if pieces:
            self._arguments("".join(pieces), delta)
            pieces.clear()

    def _track(self, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1


class HermesCallStream(ToolCallStream):
    """`tool_choice="auto"` with Hermes-style `<tool_call>` blocks (see the module docstring).

    Args:
        tool_names: the offered tools; a block naming another function stays content. None: any name.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: Collection[str] | None) -> None:
        super().__init__()
        self.tool_names = frozenset(tool_names) if tool_names is not None else None
        self._held = ""  # content that may still turn out to precede (or start) a tag
        self._block: str | None = None  # body of the open block, while inside one
        self._block_space = ""  # whitespace before the open block (dropped if the block is a call)
        self._after_call = False  # drop whitespace right after a call

    def _read(self, text: str, delta: StreamDelta) -> None:
        text, self._held = self._held + text, ""
        while text:
            if self._block is not None:
                self._block += text
                end = self._block.find(self.CLOSE)
                if end < 0:
                    return
                text = self._block[end + len(self.CLOSE) :]
                self._close_block(self._block[:end], self.CLOSE, delta)
                continue
            if self._after_call:
                text = text.lstrip()
                if not text:
                    return
                self._after_call = False
            start = text.find(self.OPEN)
            if start >= 0:
                before = text[:start]
                kept = before.rstrip()
                self._content(kept, delta)
                self._block, self._block_space = "", before[len(kept) :]
                text = text[start + len(self.OPEN) :]
                continue
            cut = _hold_from(text, self.OPEN)
            self._content(text[:cut], delta)
            self._held = text[cut:]
            return

    def _close_block(self, body: str, closing: str, delta: StreamDelta) -> None:
        self._block = None
        call = parse_hermes_body(body)
        if call is not None and (self.tool_names is None or call[0] in self.tool_names):
            self._start_call(call[0], call[1], delta)
            self._after_call = True
        else:
            self._content(self._block_space + self.OPEN + body + closing, delta)
        self._block_space = ""

    def _finish(self, delta: StreamDelta) -> None:
        if self._block is not None:
            self._close_block(self._block, "", delta)  # a call cut off before its closing tag (e.g. a stop string)
        if self._held:
            self._content(self._held, delta)
            self._held = ""


class BufferedParserStream(ToolCallStream):
    """Any registered `ToolParser` without an incremental form: the text is held until the output ends, then
    parsed once. If the parser names a function that was not offered, the whole text stays content.

    Args:
        parser: the parser.
        tool_names: the offered tools.
    """

    def __init__(self, parser: WholeTextParser, tool_names: Collection[str]) -> None:
        super().__init__()
        self.parser = parser
        self.tool_names = frozenset(tool_names)
        self._text = ""

    def _read(self, text: str, delta: StreamDelta) -> None:
        self._text += text

    def _finish(self, delta: StreamDelta) -> None:
        content, calls = self.parser.extract_tool_calls(self._text)
        if any(call.name not in self.tool_names for call in calls):
            content, calls = self._text, []
        if content:
            self._content(content, delta)
        for call in calls:
            self._start_call(call.name, call.arguments, delta)


def parse_hermes_body(body: str) -> tuple[str, str] | None:
    """The (name, arguments as compact JSON text) of a Hermes `<tool_call>` body, or None if it is not a JSON
    object with a str `name` and an object `arguments` (also accepted: `parameters`, or the object as JSON text)."""
    try:
        obj: Any = json.loads(body)
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
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _hold_from(text: str, tag: str) -> int:
    """Where the part of `text` to hold back starts: its trailing whitespace plus any end that may begin `tag`."""
    cut = len(text)
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            cut = len(text) - size
            break
    return len(text[:cut].rstrip())
