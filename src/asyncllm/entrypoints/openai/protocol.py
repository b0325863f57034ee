"""Request bodies of the OpenAI-compatible API (pydantic models); the responses are in `responses.py`.

Field names and meanings follow the OpenAI API reference (`/v1/completions`, `/v1/chat/completions`, with
`tools`, `tool_choice`, `parallel_tool_calls` and `response_format`) plus vLLM's extra fields (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `structured_outputs`,
`repetition_detection`, `cache_salt`). Types are checked here; ranges are checked once, by
`SamplingParams.validate()`.
Unknown fields are rejected (HTTP 400 naming the field): a field the server cannot honour is never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncllm.errors import InvalidRequestError
from asyncllm.sampling_params import MAX_LOGPROBS, RepetitionDetectionParams, RequestOutputKind, SamplingParams

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a last chunk with the usage; `continuous_usage_stats` (vLLM)
    puts the running usage on every chunk."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class RepetitionDetection(BaseModel):
    """vLLM's `repetition_detection` object (see `asyncllm.RepetitionDetectionParams`); a request it stops
    finishes with `finish_reason: "repetition"`, as vLLM's server answers."""

    model_config = ConfigDict(extra="forbid")
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


class SamplingFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # prefix-cache isolation (`AsyncLLM.generate(cache_salt=)`), vLLM's extra field
    cache_salt: str | None = Field(default=None, min_length=1)
    repetition_detection: RepetitionDetection | None = None
    allowed_token_ids: list[int] | None = None
    # keep only the prompt's last k tokens (vLLM's; -1: as many as max_model_len allows with one token to generate)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # vLLM's: per prompt token, its logprob and the k most likely alternatives (-1: the whole vocabulary)
    prompt_logprobs: int | None = None
    # vLLM's: logprobs name tokens "token_id:N" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")  # vLLM's 400
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or >= 1")
        return self

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's `SamplingParams` (DELTA outputs) for this request.

        Raises:
            InvalidRequestError: a field is out of range (the message names it as `SamplingParams.<field>`).
        """
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=parse_logit_bias(self.logit_bias),
            stop=stop or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            allowed_token_ids=self.allowed_token_ids,
            output_kind=RequestOutputKind.DELTA,
            repetition_detection=(
                RepetitionDetectionParams(**self.repetition_detection.model_dump())
                if self.repetition_detection is not None
                else None
            ),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage_stats(self) -> bool:
        """Usage on every chunk: only with `include_usage` too, as vLLM."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`. `prompt`: a string, a list of strings, token ids, or a list of lists of token ids.
    `logprobs`: top tokens per position (0..20). `echo`: the prompt's text before each completion's (not with
    `logprobs`: prompt logprobs are not sent). `return_token_ids` (vLLM): `prompt_token_ids` and `token_ids` on each
    choice. `response_format` / `structured_outputs` constrain the output as for chat. Not supported (400 when set):
    `suffix`, `best_of` other than `n`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: None = None
    best_of: int | None = None
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None


class ChatMessage(BaseModel):
    """One chat message; `content` is a string or a list of `{"type": "text", "text": ...}` parts."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextContentPart] | None = None

    def text(self) -> str:
        """The content as one string (text parts joined with newlines; None is "")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class TextContentPart(BaseModel):
    """A text part of a message's content (the only content type a text model can take)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionDefinition(BaseModel):
    """A tool's function: `name` (OpenAI's pattern), `description`, `parameters` (a JSON schema object)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """One entry of `tools`: `{"type": "function", "function": {...}}`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice={"type": "function", "function": {"name": ...}}`: force a call of that function."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class StructuredOutputsField(BaseModel):
    """vLLM's extra `structured_outputs` body field: exactly one of `json` (a JSON schema), `json_object`,
    `regex`, `choice`, `grammar` (see `asyncllm.structured_outputs.StructuredOutputsParams`)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`. `max_completion_tokens` wins over the older `max_tokens`; None = up to the
    context length. `logprobs=true` returns the sampled token's logprob, `top_logprobs` (0..20) the most likely
    alternatives. `tools`, `tool_choice` (None = "auto" with tools, else "none"), `parallel_tool_calls`
    (None = true), `response_format` and `structured_outputs`: see `serving_chat_tools`. Not supported (400
    when set): audio, images."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    add_generation_prompt: bool = True
    # vLLM's: extra variables of the chat template (e.g. {"enable_thinking": false}); not with tools
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the final (assistant) message is left open and continued; needs add_generation_prompt=false
    continue_final_message: bool = False
    # vLLM's: the reply starts with the last message's content when that message is the assistant's
    echo: bool = False

    @model_validator(mode="after")
    def _continue_needs_no_generation_prompt(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self

    def echoed_text(self) -> str:
        """What `echo` puts before the reply: the last message's text when it is the assistant's, else ""."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        """One clear error naming `tool_choice` (pydantic's union errors would name each union member)."""
        if value is None or value in ("none", "auto", "required"):
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if (
            isinstance(value, dict)
            and set(value) == {"type", "function"}
            and value["type"] == "function"
            and isinstance(function, dict)
            and set(function) == {"name"}
            and isinstance(function["name"], str)
        ):
            return NamedToolChoice.model_validate(value)
        raise ValueError("must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")

    @property
    def max_tokens_field(self) -> str:
        """The name of the field the output length came from (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: `name`, `description`, `schema` (required here), `strict`. The output is
    always constrained to the schema, whatever `strict` says (as vLLM does)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: `{"type": "text"}` (free text), `{"type": "json_object"}` (one JSON object), or
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (JSON valid for the schema)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only allowed with it")
        return self


ChatMessage.model_rebuild()
ChatCompletionRequest.model_rebuild()


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: either `prompt` (plain text) or `messages` (rendered with the chat template)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # vLLM's: also each token's string in the vocabulary ("token_strs")
    # vLLM's, for `messages` (rendered as a chat request would be)
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: token ids -> text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def parse_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings); the engine wants ints.

    Raises:
        InvalidRequestError: a key is not an integer (as `SamplingParams.logit_bias`).
    """
    if logit_bias is None:
        return None
    parsed: dict[int, float] = {}
    for key, bias in logit_bias.items():
        try:
            parsed[int(key)] = bias
        except ValueError:
            raise InvalidRequestError(
                f"SamplingParams.logit_bias={{{key!r}: {bias}}} is invalid: keys must be token ids"
            ) from None
    return parsed


class EmbeddingRequest(BaseModel):
    """`POST /v1/embeddings` (OpenAI's shape): `input` is a string, a list of strings, token ids, or a list of
    token-id lists; `encoding_format` "float" (a list of numbers) or "base64" (little-endian float32 bytes, what
    the official client asks for by default); `dimensions` truncates (then normalizes). Extras (asyncllm's
    `PoolingParams`): `pooling` ("last" by default: the last prompt token's hidden state) and `normalize`."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    pooling: Literal["last", "mean", "cls"] = "last"
    normalize: bool = True
