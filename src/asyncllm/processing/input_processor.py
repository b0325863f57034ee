"""Prompt -> validated `EngineCoreRequest`, on the caller's side, before anything reaches the engine.

Prompt forms:
    "text"                                       encoded with the tokenizer (special tokens added, e.g. BOS).
    (each dict form may carry "cache_salt"; `asyncllm.inputs` has vLLM's TypedDicts for them)
    {"prompt_token_ids": [int, ...]}             used as is (optionally with "prompt": its text).
    {"prompt": "text"}                           same as "text".
    {"prompt_embeds": tensor}                    [num_tokens, hidden_size] float32 vectors the first layer takes
                                                 instead of token embeddings (`processing/prompt_embeds.py`);
                                                 the request's token ids are placeholders (0), as vLLM.
    [{"role": "user", "content": "..."}, ...]    rendered with the model's chat template
                                                 (add_generation_prompt=True), encoded without special tokens.

Length rule (as vLLM): a prompt may use at most `max_model_len - 1` tokens (one must be left to generate);
a request with `num_prompt_tokens + max_tokens > max_model_len` is rejected (`InvalidRequestError`), never
silently shortened; `max_tokens=None` means "up to max_model_len": `max_model_len - num_prompt_tokens`.
`max_model_len` is the engine's (from the handshake), already capped so one sequence fits the whole KV cache
(`EngineCore._cap_max_model_len`): a request that passes this rule can always run, it never waits forever.

Request ids (as vLLM's `InputProcessor.assign_request_id`): the user's id (or a new uuid4 hex) becomes
`EngineCoreRequest.external_req_id`; `request_id` is an internal id unique for this process's life
(`make_internal_request_id`), which is what the output processor, the client and the engine key by.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import msgspec
import numpy as np

from asyncllm.engine_config import LoRAConfig
from asyncllm.errors import InvalidRequestError
from asyncllm.lora.checker import LoRAChecker
from asyncllm.lora.request import LoRARequest
from asyncllm.messages.engine import EngineCoreRequest
from asyncllm.pooling_params import PoolingParams
from asyncllm.processing.no_tokenizer import NoTokenizer
from asyncllm.processing.prompt_embeds import PLACEHOLDER_TOKEN_ID, check_embeds_params, to_prompt_embeds_array
from asyncllm.sampling_params import MAX_INT64, MAX_LOGPROBS, RequestOutputKind, SamplingParams
from asyncllm.structured_outputs.backend import check_constraint
from asyncllm.utils import request_callables

PromptType = str | Mapping[str, Any] | Sequence[Mapping[str, Any]]


class TokenizerLike(Protocol):
    """What the input processor needs from `asyncllm.model.loading.tokenizer.Tokenizer`."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class RequestOptions:
    """A request's options besides its prompt and parameters, built once at the door (`AsyncLLM.generate`,
    `encode`) and read by every step of the request path.

    Fields:
        request_id: the user's id (`external_req_id`); None makes one (uuid4 hex).
        priority: lower runs first with `scheduling_policy="priority"`; a signed 64-bit integer.
        cache_salt: None, or a non-empty str mixed into the first KV block's hash (tenant isolation).
        data_parallel_rank: the engine rank to run on with data parallelism; None lets the load balancer pick.
        lora_request: the PEFT LoRA adapter to run with, or None for the base model.
    Invalid values raise `InvalidRequestError` from `InputProcessor.process`, not here.
    """

    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    lora_request: LoRARequest | None = None


class ProcessedRequest(NamedTuple):
    """A validated request and the prompt text (None for token-id prompts) for `RequestOutput.prompt`."""

    prompt: str | None
    request: EngineCoreRequest


class InputProcessor:
    """Tokenizes and validates prompts.

    Args:
        tokenizer: the model's tokenizer.
        max_model_len: tokens per sequence at most (prompt + output).
        vocab_size: valid token ids are [0, vocab_size).
        kv_cache_blocks: (num_kv_blocks, block_size) of the engine's KV cache (handshake), to say so in the
            errors when the cache is what limits `max_model_len`; None = not known.
        hidden_size: the model's hidden size (handshake), for prompt embeddings and `dimensions`; 0 = unknown.
        lora_config: the engine's LoRA settings (None = LoRA off: a `lora_request` is refused).
        max_logprobs: `logprobs` / `prompt_logprobs` at most (`EngineArgs.max_logprobs`; -1 = the vocabulary).
        callables_in_process: the worker runs in this process (engine thread, "uni" executor, no speculative
            decoding), so `SamplingParams.logits_processors` can reach it; False refuses them.
        max_prompt_len: a longer prompt is refused, tokens (`ModelConfig.max_prompt_len`: a LongRoPE checkpoint's
            original context); None = only `max_model_len` limits it.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        max_model_len: int,
        vocab_size: int,
        kv_cache_blocks: tuple[int, int] | None = None,
        hidden_size: int = 0,
        lora_config: LoRAConfig | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        callables_in_process: bool = False,
        max_prompt_len: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        self._callables_in_process = callables_in_process
        self._hidden_size = hidden_size
        self._lora_checker = LoRAChecker(lora_config)
        self._max_model_len = max_model_len
        self._max_prompt_len = max_prompt_len
        self._vocab_size = vocab_size
        self._limit = f"max_model_len={max_model_len}"
        if kv_cache_blocks is not None and kv_cache_blocks[0] * kv_cache_blocks[1] <= max_model_len:
            num_blocks, block_size = kv_cache_blocks
            self._limit += (
                f"; the KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks of {block_size})"
            )

    def process(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        options: RequestOptions = RequestOptions(),
        internal_id: str | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> ProcessedRequest:
        """Build the engine request for one prompt.

        Args:
            prompt: one of the forms in the module docstring.
            sampling_params: None means `SamplingParams()`; never mutated (a copy is sent when max_tokens is None).
            options: the request's id, priority, cache salt and LoRA adapter (its directory is read and checked
                here); `data_parallel_rank` is the client's, not read here.
            internal_id: the internal id (`make_internal_request_id(request_id)`); None makes one.
            pooling_params: set for an embedding request (`AsyncLLM.encode`); `sampling_params` must then be
                None (a `max_tokens=1` FINAL_ONLY placeholder is sent; the engine never samples it).
        Returns:
            The prompt text and the `EngineCoreRequest` (eos id from the tokenizer, max_tokens set when None).
        Raises:
            InvalidRequestError: bad prompt shape, empty or too long prompt, prompt + max_tokens over
                max_model_len, token id outside the vocabulary, bad sampling parameters, request id, priority,
                cache salt, bad pooling parameters, bad prompt embeddings, or a LoRA adapter that is off, missing,
                malformed or refused (`asyncllm.lora.peft`).
        """
        params = self._validate_params(sampling_params)
        if pooling_params is not None:
            params = self._pooling_placeholder(pooling_params, sampling_params)
        request_id = validate_request_id(options.request_id)
        priority, cache_salt = options.priority, _prompt_cache_salt(prompt, options.cache_salt)
        _validate_priority(priority)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError(f"cache_salt={cache_salt!r} is invalid: must be None or a non-empty str")
        lora = None if options.lora_request is None else self._lora_checker.check(options.lora_request)
        embeds = None
        if isinstance(prompt, Mapping) and "prompt_embeds" in prompt:
            if pooling_params is not None:
                raise InvalidRequestError("encode() takes text or token-id prompts, not prompt_embeds")
            embeds = self._prompt_embeds(prompt, params)
            text, token_ids = None, [PLACEHOLDER_TOKEN_ID] * embeds.shape[0]
        else:
            text, token_ids = self.tokenize(prompt)
        self._validate_token_ids(token_ids)
        engine_id = internal_id or make_internal_request_id(request_id)
        params = self._resolve_max_tokens(params, len(token_ids))
        if params.logits_processors:  # last: nothing after this may raise, or the entry would be left behind
            request_callables.register(engine_id, params.logits_processors)
            params = msgspec.structs.replace(params, logits_processors=None, logits_processors_key=engine_id)
        request = EngineCoreRequest(
            request_id=engine_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self._tokenizer.eos_token_id,
            arrival_time=time.time(),
            priority=priority,
            external_req_id=request_id,
            cache_salt=cache_salt,
            pooling_params=pooling_params,
            prompt_embeds=embeds,
            lora_request=lora,
        )
        return ProcessedRequest(text, request)

    def _pooling_placeholder(
        self, pooling_params: PoolingParams, sampling_params: SamplingParams | None
    ) -> SamplingParams:
        """Validate an embedding request's parameters; the placeholder sampling parameters it carries."""
        if not isinstance(pooling_params, PoolingParams):
            raise InvalidRequestError(f"pooling_params must be a PoolingParams, not {type(pooling_params).__name__}")
        if sampling_params is not None:
            raise InvalidRequestError("an embedding request takes pooling_params, not sampling_params")
        pooling_params.validate(self._hidden_size or None)
        return SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)

    def _prompt_embeds(self, prompt: Mapping[str, Any], params: SamplingParams) -> np.ndarray:
        """The checked [num_tokens, hidden_size] float32 array of a `{"prompt_embeds": ...}` prompt."""
        unknown = sorted(set(prompt) - {"prompt_embeds", "cache_salt"})
        if unknown:
            raise InvalidRequestError(f"a prompt_embeds prompt takes no other keys; got {unknown}")
        check_embeds_params(params)
        return to_prompt_embeds_array(prompt["prompt_embeds"], self._hidden_size)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Turn a prompt into (text or None, token ids).

        Raises:
            InvalidRequestError: the prompt has none of the accepted shapes, or is empty.
        """
        if isinstance(prompt, str):
            return prompt, self._encode_text(prompt, add_special_tokens=True)
        if isinstance(prompt, Mapping):
            return self._tokenize_dict(prompt)
        if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            text = self._render_chat(prompt)
            return text, self._encode_text(text, add_special_tokens=False)
        raise InvalidRequestError(
            f"prompt of type {type(prompt).__name__} is invalid: must be a str, a dict with "
            "'prompt_token_ids' (or 'prompt'), or a list of chat messages"
        )

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        if not text:
            raise InvalidRequestError("the prompt is empty")
        token_ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not token_ids:
            raise InvalidRequestError("the prompt encodes to no tokens")
        return list(token_ids)

    def _tokenize_dict(self, prompt: Mapping[str, Any]) -> tuple[str | None, list[int]]:
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
        not_served = [key for key in unknown if key in VLLM_PROMPT_KEYS_NOT_SERVED]
        if not_served:
            raise InvalidRequestError(
                f"prompt keys {not_served} are not supported: asyncllm serves text-only decoder models "
                "(vLLM's multi-modal and cross-encoder prompt keys)"
            )
        if unknown:
            raise InvalidRequestError(
                f"unknown prompt keys {unknown}: use 'prompt_token_ids' or 'prompt' (and optionally 'cache_salt')"
            )
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise InvalidRequestError("prompt['prompt'] must be a str")
        if "prompt_token_ids" not in prompt:
            if text is None:
                raise InvalidRequestError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
            return text, self._encode_text(text, add_special_tokens=True)
        token_ids = prompt["prompt_token_ids"]
        if not isinstance(token_ids, Sequence) or isinstance(token_ids, str | bytes):
            raise InvalidRequestError("prompt_token_ids must be a list of ints")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: prompt_token_ids has no tokens")
        return text, list(token_ids)

    def _render_chat(self, messages: Sequence[Any]) -> str:
        if not messages:
            raise InvalidRequestError("the chat prompt has no messages")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise InvalidRequestError(f"chat message {i} must be a dict with 'role' and 'content'")
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not role:
                raise InvalidRequestError(f"chat message {i} needs a non-empty str 'role'")
            if not isinstance(content, str):
                raise InvalidRequestError(f"chat message {i} needs a str 'content'")
        return self._tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True)

    def _validate_token_ids(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self._vocab_size:
                raise InvalidRequestError(f"token id {token_id!r} is outside the vocabulary [0, {self._vocab_size})")
        if len(token_ids) > self._max_model_len - 1:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; at most {self._max_model_len - 1} fit "
                f"({self._limit}; one token must be left to generate)"
            )
        if self._max_prompt_len is not None and len(token_ids) > self._max_prompt_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; this model takes at most {self._max_prompt_len} "
                "(LongRoPE's original context: HF rotates a longer prompt with the long factors from its first "
                "token, asyncllm only from that position on)"
            )

    def _validate_params(self, params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
        params.validate()
        params.validate_vocab(self._vocab_size)
        if params.structured_outputs is not None:
            check_constraint(params.structured_outputs)
        self._validate_logprobs(params)
        if params.logits_processors and not self._callables_in_process:
            raise InvalidRequestError(
                "SamplingParams.logits_processors need the worker in this process: callables cannot be sent to "
                "another process without pickle. Use EngineArgs(engine_process=False) with the 'uni' executor, one "
                "engine and no speculative decoding"
            )
        if params.logits_processors_key is not None:
            raise InvalidRequestError("SamplingParams.logits_processors_key is set at submission, not by users")
        if params.bad_words:
            params = msgspec.structs.replace(params, bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        if isinstance(self._tokenizer, NoTokenizer):
            return self._token_ids_only(params)
        return params

    @staticmethod
    def _token_ids_only(params: SamplingParams) -> SamplingParams:
        """With `skip_tokenizer_init`: refuse what needs text; outputs are not detokenized (empty text, as vLLM)."""
        if params.stop:
            raise InvalidRequestError("SamplingParams.stop needs a tokenizer: the engine has skip_tokenizer_init=True")
        if params.structured_outputs is not None:
            raise InvalidRequestError(
                "structured outputs require a tokenizer, so they cannot be used with skip_tokenizer_init=True"
            )
        return msgspec.structs.replace(params, detokenize=False) if params.detokenize else params

    def _validate_logprobs(self, params: SamplingParams) -> None:
        """vLLM's check of `logprobs` / `prompt_logprobs` (-1 = the vocabulary) against `max_logprobs`."""
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            value = getattr(params, name)
            if value is None:
                continue
            wanted = self._vocab_size if value == -1 else value
            if wanted > self._max_logprobs:
                raise InvalidRequestError(
                    f"SamplingParams.{name}={value} is invalid: requested {kind} logprobs of {wanted}, which is "
                    f"greater than max allowed: {self._max_logprobs} (EngineArgs.max_logprobs; -1 there allows "
                    "the whole vocabulary)"
                )

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token sequences: the word as written (leading blanks stripped) and with one leading
        space (when that tokenizes differently, to the same length), as vLLM's `SamplingParams.bad_words`."""
        sequences: list[list[int]] = []
        for word in words:
            bare = self._tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self._tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (bare, spaced):
                if ids and ids not in sequences and (ids is bare or len(ids) == len(bare)):
                    sequences.append(list(ids))
        for ids in sequences:
            self._validate_token_ids(ids)
        return sequences

    def _resolve_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        room = self._max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            if params.min_tokens > room:
                raise InvalidRequestError(
                    f"SamplingParams.min_tokens={params.min_tokens} is invalid: the {num_prompt_tokens}-token "
                    f"prompt leaves room for {room} tokens ({self._limit})"
                )
            return msgspec.structs.replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"SamplingParams.max_tokens={params.max_tokens} is invalid: prompt ({num_prompt_tokens} tokens) + "
                f"max_tokens must be <= max_model_len ({self._limit}); at most {room} here"
            )
        return params


VLLM_PROMPT_KEYS_NOT_SERVED = frozenset(
    {"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "token_type_ids"}
)  # keys of vLLM's TextPrompt / TokensPrompt that only multi-modal or cross-encoder models read


def _prompt_cache_salt(prompt: PromptType, salt: str | None) -> str | None:
    """The request's cache salt: `generate(cache_salt=)`, or a dict prompt's "cache_salt" key (vLLM's
    `TokensPrompt(cache_salt=...)`).

    Raises:
        InvalidRequestError: both are given and differ.
    """
    if not isinstance(prompt, Mapping) or "cache_salt" not in prompt:
        return salt
    in_prompt = prompt["cache_salt"]
    if salt is not None and salt != in_prompt:
        raise InvalidRequestError(
            f"cache_salt is given twice and differs: {salt!r} (argument) and {in_prompt!r} (the prompt's key)"
        )
    return in_prompt


_internal_id_counter = itertools.count()  # next() is atomic in CPython: safe from any thread


def make_internal_request_id(request_id: str) -> str:
    """The internal id of a new request with the user's id `request_id`: `f"{request_id}-{n}"`.

    n comes from one counter for the whole process, so no two calls ever return the same id (the text after
    the last "-" is n, and each n is used once), whatever the user's ids are. vLLM appends 8 random characters
    instead; a counter makes uniqueness certain rather than probable.
    """
    return f"{request_id}-{next(_internal_id_counter)}"


def validate_request_id(request_id: str | None) -> str:
    """The user's request id, or a new uuid4 hex for None.

    Raises:
        InvalidRequestError: not a non-empty str.
    """
    if request_id is None:
        return uuid.uuid4().hex
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(f"request_id={request_id!r} is invalid: must be a non-empty str")
    return request_id


def _validate_priority(priority: object) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority={priority!r} is invalid: must be an integer")
    if not -MAX_INT64 - 1 <= priority <= MAX_INT64:
        raise InvalidRequestError(f"priority={priority!r} is invalid: must be a signed 64-bit integer")
