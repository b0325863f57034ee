"""Tools and structured outputs on `/v1/chat/completions`: request fields -> prompt and sampling constraint, and
generated text -> `content` and `tool_calls` (whole, or as streamed deltas).

- `tools` / `tool_choice` / `parallel_tool_calls` go through `asyncllm.processing.tool_calling.plan_chat` (as
  `AsyncLLM.chat`): "required" and a named function force a call valid for the tool's `parameters` with
  structured outputs (any model); "auto" (the default with tools) parses the model's own calls with the server's
  tool parser ("hermes"; a call of a function that was not offered stays content); "none" offers no tools.
- `response_format` `json_object` / `json_schema` and vLLM's `structured_outputs` constrain the output with
  `StructuredOutputsParams`; they cannot be combined with each other or with a forced tool call.
- Text -> message: one `asyncllm.processing.tool_calling_stream.ToolCallStream` per choice, fed the whole text
  (non-streaming) or each delta (streaming), so the reassembled stream equals the non-streamed answer.
  `finish_reason` is "tool_calls" when the answer carries tool calls and generation stopped normally (also for
  forced calls, where OpenAI itself says "stop" for a named function); "length" stays "length" (the last call's
  arguments are then cut off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from asyncllm.entrypoints.openai.errors import APIError
from asyncllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from asyncllm.entrypoints.openai.responses import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCallBody
from asyncllm.errors import InvalidRequestError
from asyncllm.processing.tool_calling import ChatPlan, plan_chat
from asyncllm.processing.tool_calling_stream import PlainStream, StreamDelta, ToolCallStream
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured_outputs import StructuredOutputsParams
from asyncllm.submission import is_long_prompt


@dataclass
class ChatSetup:
    """What `generate()` gets for one chat request, and how to read its text.

    Fields:
        prompt: chat messages (no tools: `generate()` renders them) or the planned prompt dict.
        params: sampling parameters with the output constraint, if any.
        plan: the tool-calling plan, or None without tools.
        constraint_field: the request field the output constraint came from (for error messages).
    """

    prompt: Any
    params: SamplingParams
    plan: ChatPlan | None
    constraint_field: str | None

    def new_stream(self) -> ToolCallStream:
        """A fresh reader of one choice's text."""
        return self.plan.new_stream() if self.plan is not None else PlainStream()


async def prepare_chat(
    tokenizer: Any, request: ChatCompletionRequest, params: SamplingParams, tool_parser: str, max_model_len: int = 0
) -> ChatSetup:
    """Validate the tool and format fields, render the prompt (with tools), and add the output constraint.

    A long conversation with tools is rendered and tokenized in a worker thread.
    Raises:
        APIError: 400 naming the field (`tools`, `tool_choice`, `response_format`, `structured_outputs`,
            `messages`) for a bad or conflicting value.
    """
    constraint, constraint_field = output_constraint(request)
    if constraint is not None:
        params = msgspec.structs.replace(params, structured_outputs=constraint)
    messages = [_message_dict(m) for m in request.messages]
    custom = {
        "chat_template_kwargs": request.chat_template_kwargs is not None,
        "add_generation_prompt": not request.add_generation_prompt,
        "truncate_prompt_tokens": request.truncate_prompt_tokens is not None,
        "continue_final_message": request.continue_final_message,
    }
    custom_render = any(custom.values())
    if not request.tools and not any(_has_tool_parts(m) for m in messages):
        if request.tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice other than 'none' or 'auto' needs tools", param="tool_choice")
        prompt = _render(tokenizer, messages, request, max_model_len) if custom_render else messages
        return ChatSetup(prompt, params, None, constraint_field)
    refused = [name for name, given in custom.items() if given and name != "chat_template_kwargs"]
    if refused:
        raise APIError(f"{refused[0]} is not supported with tools yet", param=refused[0])
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    choice = _tool_choice(request)
    parallel = request.parallel_tool_calls is not False
    args = (tokenizer, messages, params, tools, choice, parallel, tool_parser, request.chat_template_kwargs)
    try:
        if is_long_prompt(messages):
            plan = await anyio.to_thread.run_sync(plan_chat, *args)
        else:
            plan = plan_chat(*args)
    except InvalidRequestError as error:
        raise APIError(str(error), param=_tool_error_param(str(error))) from error
    forced = plan.mode in ("required", "named")
    return ChatSetup(plan.prompt, plan.sampling_params, plan, "tools" if forced else constraint_field)


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], request: ChatCompletionRequest, max_model_len: int
) -> dict[str, Any]:
    """The prompt of a chat request rendered here: with `chat_template_kwargs`, `add_generation_prompt=false` or
    `truncate_prompt_tokens` (the last k token ids kept; -1: `max_model_len`) (`generate()` renders plain messages
    otherwise)."""
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=request.add_generation_prompt, template_kwargs=request.chat_template_kwargs
        )
    except InvalidRequestError as error:
        raise APIError(str(error), param="chat_template_kwargs") from error
    if request.continue_final_message:  # cut the rendering right after the final message's text: left open
        final = request.messages[-1].text()
        end = text.rfind(final) if final else -1
        if end < 0:
            raise APIError(
                "continue_final_message: the final message's text is not in the rendered prompt",
                param="continue_final_message",
            )
        text = text[: end + len(final)]
    ids = tokenizer.encode(text, add_special_tokens=False)
    keep = request.truncate_prompt_tokens
    if keep is None:
        return {"prompt_token_ids": ids, "prompt": text}
    return {"prompt_token_ids": ids[-(max_model_len if keep == -1 else keep) :]}


def output_constraint(request: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The output constraint of a chat or completion request (`response_format` or vLLM's `structured_outputs`)
    and the field it came from.

    Raises:
        APIError: both given, or a bad constraint (400).
    """
    fmt, extra = request.response_format, request.structured_outputs
    if fmt is not None and fmt.type != "text" and extra is not None:
        raise APIError("give response_format or structured_outputs, not both", param="structured_outputs")
    try:
        if extra is not None:
            fields = extra.model_dump(exclude_none=True, by_alias=True)
            return StructuredOutputsParams(**fields), "structured_outputs"
        if fmt is None or fmt.type == "text":
            return None, None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        assert fmt.json_schema is not None  # the model validator requires it
        return StructuredOutputsParams(json=fmt.json_schema.schema_), "response_format"
    except InvalidRequestError as error:
        raise APIError(str(error), param="structured_outputs") from error


def _tool_choice(request: ChatCompletionRequest) -> Any:
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        return choice.model_dump()
    if choice is None:
        return "auto" if request.tools else "none"
    return choice


def _tool_error_param(message: str) -> str | None:
    """The request field a `plan_chat` error is about."""
    if message.startswith(("tools", "tool names")):
        return "tools"
    if message.startswith("tool_choice") or "cannot be combined" in message:
        return "tool_choice"
    if message.startswith("chat message"):
        return "messages"
    return None


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    """A request message as `generate()` / `plan_chat` take it (content parts joined; tool fields kept)."""
    extra = {key: value for key, value in (message.model_extra or {}).items() if value is not None}
    return {**extra, "role": message.role, "content": message.text()}


def _has_tool_parts(message: dict[str, Any]) -> bool:
    return message["role"] == "tool" or bool(message.get("tool_calls"))


def finish_reason(reason: str | None, stream: ToolCallStream) -> str | None:
    """The choice's `finish_reason`: "tool_calls" when it carries calls and stopped normally."""
    return "tool_calls" if reason == "stop" and stream.calls else reason


def tool_call_bodies(stream: ToolCallStream) -> list[ToolCallBody] | None:
    """The finished `message.tool_calls`, or None without calls."""
    calls = [ToolCallBody(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in stream.calls]
    return calls or None


def tool_call_deltas(delta: StreamDelta) -> list[DeltaToolCall] | None:
    """A text delta's tool-call pieces as `delta.tool_calls`, or None without any."""
    pieces = [
        DeltaToolCall(
            index=piece.index,
            id=piece.id,
            type="function" if piece.id is not None else None,
            function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments),
        )
        for piece in delta.calls
    ]
    return pieces or None
