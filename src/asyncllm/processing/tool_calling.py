"""Tool calling for `AsyncLLM.chat`: render the tools into the prompt, force or parse the calls.

Tools and `tool_choice` follow OpenAI's Chat Completions API:
    tools = [{"type": "function", "function": {"name": ..., "description": ..., "parameters": <JSON schema>}}]
    tool_choice = "auto" | "required" | "none" | {"type": "function", "function": {"name": ...}}

- Rendering: a chat template that mentions `tools` gets them as its `tools` variable (as HF `transformers` passes
  them); otherwise a system prompt lists them (one JSON signature per line) and asks for Hermes-style
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, and earlier tool calls and tool results in
  the conversation are rendered in that same format.
- "required" and a named function force a valid call with structured outputs, so they work with any model (as
  vLLM does): named -> the output is the arguments object, valid for that function's `parameters` schema;
  required -> a JSON array of `{"name", "arguments"}` objects (one of the tools each; at most one item unless
  `parallel_tool_calls`, and never more than `MAX_PARALLEL_TOOL_CALLS`, so a model that repeats calls still ends).
- "auto" generates freely and parses the model's own format with a `ToolParser` ("hermes" by default); a call
  of a function that was not offered stays content (vLLM's hermes parser returns it as a call).
- "none" renders no tools and parses nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import RequestOutput, ToolCall
from asyncllm.processing.tool_calling_stream import (
    BufferedParserStream,
    HermesCallStream,
    NamedCallStream,
    PlainStream,
    RequiredCallsStream,
    ToolCallStream,
)
from asyncllm.processing.tool_parsers import get_tool_parser
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured_outputs.params import StructuredOutputsParams

ToolChoice = str | Mapping[str, Any]
MAX_PARALLEL_TOOL_CALLS = 8  # "required" with parallel calls: at most this many (a small model may repeat forever)
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ChatPlan:
    """How to run one chat turn with tools, and how to read its result.

    Fields:
        prompt: the rendered prompt, as `{"prompt": text, "prompt_token_ids": ids}` for `generate()`.
        sampling_params: the caller's parameters, with structured outputs added for forced calls.
        mode: "none", "auto", "required" or "named".
        tool_names: the names of the offered tools.
        forced_name: the function a named tool_choice forces, else None.
        parser: the tool parser's name for "auto".
    """

    prompt: dict[str, Any]
    sampling_params: SamplingParams
    mode: str
    tool_names: tuple[str, ...] = ()
    forced_name: str | None = None
    parser: str = "hermes"

    def new_stream(self) -> ToolCallStream:
        """A fresh incremental reader of one completion's text (content and tool-call deltas; see
        `asyncllm.processing.tool_calling_stream`)."""
        if self.mode == "named" and self.forced_name is not None:
            return NamedCallStream(self.forced_name)
        if self.mode == "required":
            return RequiredCallsStream()
        if self.mode == "auto":
            if self.parser == "hermes":
                return HermesCallStream(self.tool_names)
            return BufferedParserStream(get_tool_parser(self.parser), self.tool_names)
        return PlainStream()

    def finish(self, output: RequestOutput) -> RequestOutput:
        """Fill `tool_calls` (and strip the call markup from `text`) on each finished completion.

        "auto" keeps only calls of offered tools (a call of another name stays in the text, as content).
        Forced calls whose JSON was cut off (finish_reason "length") yield no tool call; the text is kept.
        """
        for completion in output.outputs:
            stream = self.new_stream()
            stream.feed(completion.text, finished=True)
            calls = [ToolCall(call.id, call.name, call.arguments) for call in stream.calls]
            text = stream.content
            forced = self.mode in ("required", "named")
            if forced and (not calls or not all(_is_json_object(c.arguments) for c in calls)):
                calls, text = [], completion.text
            completion.text = text
            completion.tool_calls = calls or None
        return output


def plan_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    sampling_params: SamplingParams | None,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: ToolChoice = "auto",
    parallel_tool_calls: bool = True,
    tool_parser: str = "hermes",
    template_kwargs: dict[str, Any] | None = None,
) -> ChatPlan:
    """Validate the tools and the choice, render the prompt, and pick the sampling constraint.

    Args:
        tokenizer: the model's `Tokenizer` (chat template and encoder).
        messages: OpenAI-style chat messages; may hold assistant `tool_calls` and `tool` results.
        sampling_params: None means `SamplingParams()`.
        tools, tool_choice, parallel_tool_calls: as in OpenAI's API.
        tool_parser: the registered parser for "auto".
        template_kwargs: more chat template variables (vLLM's `chat_template_kwargs`).
    Raises:
        InvalidRequestError: malformed tools, an unknown tool_choice or function name, a forced call combined
            with the caller's own `structured_outputs`, or an unknown parser.
    """
    params = sampling_params if sampling_params is not None else SamplingParams()
    specs = normalize_tools(tools)
    mode, forced = normalize_tool_choice(tool_choice, specs)
    if mode == "auto":
        get_tool_parser(tool_parser)  # fail early on an unknown parser
    offered = specs if mode != "none" else []
    text = render_chat(tokenizer, messages, offered, template_kwargs)
    prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    if mode in ("required", "named"):
        if params.structured_outputs is not None:
            raise InvalidRequestError(
                "tool_choice 'required' or a named function cannot be combined with structured_outputs"
            )
        schema = forced_call_schema(specs, forced, parallel_tool_calls)
        params = msgspec.structs.replace(params, structured_outputs=StructuredOutputsParams(json=schema))
    names = tuple(spec["name"] for spec in specs)
    return ChatPlan(prompt, params, mode, names, forced, tool_parser)


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI `tools` -> the list of their `function` objects (name, description, parameters).

    Raises:
        InvalidRequestError: a tool is not `{"type": "function", "function": {"name": str, ...}}`, names repeat,
            or `parameters` is not a JSON schema object.
    """
    specs: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type", "function") != "function"
            or not isinstance(function, Mapping)
        ):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty str")
        parameters = function.get("parameters") or _EMPTY_PARAMETERS
        if not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
        specs.append({"name": name, "description": function.get("description", ""), "parameters": dict(parameters)})
    names = [spec["name"] for spec in specs]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"tool names must be unique: {names}")
    return specs


def normalize_tool_choice(choice: ToolChoice, specs: list[dict[str, Any]]) -> tuple[str, str | None]:
    """-> (mode, forced function name or None); mode is "none", "auto", "required" or "named".

    Raises:
        InvalidRequestError: an unknown choice, a choice other than "none"/"auto" without tools, or a named
            function that is not among the tools.
    """
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                "tool_choice must be 'auto', 'required', 'none' or {'type': 'function', 'function': {'name': ...}}"
            )
        if name not in {spec["name"] for spec in specs}:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools")
        return "named", name
    if choice not in ("auto", "required", "none"):
        raise InvalidRequestError(
            f"tool_choice={choice!r} is invalid: must be 'auto', 'required', 'none' or a function"
        )
    if not specs:
        if choice == "required":
            raise InvalidRequestError("tool_choice='required' needs at least one tool")
        return "none", None
    return str(choice), None


def forced_call_schema(specs: list[dict[str, Any]], forced: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema of a forced call: the named function's arguments, or an array of calls."""
    if forced is not None:
        return next(spec["parameters"] for spec in specs if spec["name"] == forced)
    variants = [
        {
            "type": "object",
            "properties": {"name": {"enum": [spec["name"]]}, "arguments": spec["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for spec in specs
    ]
    max_items = MAX_PARALLEL_TOOL_CALLS if parallel else 1
    return {"type": "array", "items": {"anyOf": variants}, "minItems": 1, "maxItems": max_items}


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    specs: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of `messages` with the tools offered in `specs` (see the module docstring);
    `template_kwargs` are more template variables (vLLM's `chat_template_kwargs`)."""
    template = tokenizer.chat_template or ""
    extra = {"template_kwargs": template_kwargs} if template_kwargs else {}
    if specs and "tools" in template:
        tools = [{"type": "function", "function": spec} for spec in specs]
        return str(tokenizer.apply_chat_template([dict(m) for m in messages], tools=tools, **extra))
    rendered = [_render_message(m) for m in messages]
    if specs:
        rendered = _add_tools_system_prompt(rendered, specs)
    return str(tokenizer.apply_chat_template(rendered, **extra))


def tools_system_prompt(specs: list[dict[str, Any]]) -> str:
    """The system-prompt text that offers `specs` to a model whose template has no tools support."""
    signatures = "\n".join(json.dumps({"type": "function", "function": spec}, ensure_ascii=False) for spec in specs)
    return (
        "You can call functions (tools). Their signatures, one per line:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "To call one, answer with a JSON object holding its name and arguments inside tags, like this:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>'
    )


def _add_tools_system_prompt(messages: list[dict[str, Any]], specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    offer = tools_system_prompt(specs)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{offer}"}, *messages[1:]]
    return [{"role": "system", "content": offer}, *messages]


def _render_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message with tool calls or a tool result -> plain role/content text (Hermes-style tags)."""
    if not isinstance(message, Mapping):
        raise InvalidRequestError("chat messages must be dicts with 'role' and 'content'")
    role, content = message.get("role"), message.get("content")
    if role == "tool":
        result = content if isinstance(content, str) else json.dumps(content)
        return {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"}
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        blocks = [_render_call(call) for call in calls]
        return {"role": "assistant", "content": "\n".join([*([content] if content else []), *blocks])}
    return dict(message)


def _render_call(call: Any) -> str:
    if isinstance(call, ToolCall):
        call = call.to_message_dict()
    function = call.get("function", {}) if isinstance(call, Mapping) else {}
    arguments = function.get("arguments", "{}")
    parsed = _loads_or_none(arguments) if isinstance(arguments, str) else arguments
    body = json.dumps({"name": function.get("name"), "arguments": parsed}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _is_json_object(text: str) -> bool:
    return isinstance(_loads_or_none(text), dict)


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None
