"""Sampling parameters of one request, validated at submission.

`SamplingParams` is a msgspec Struct so it crosses the engine-process boundary without pickle.
Semantics follow vLLM's `SamplingParams` (https://docs.vllm.ai) for the fields present here.
"""

from __future__ import annotations

import enum

import msgspec

from asyncllm.errors import InvalidRequestError


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a stream carries.

    CUMULATIVE: all text and token ids generated so far (default).
    DELTA: only what is new since the previous output of the stream.
    FINAL_ONLY: a single output, when the request finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample one request.

    Fields:
        max_tokens: generated tokens at most (>= 1); None means up to `max_model_len`.
        temperature: >= 0; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: per-request seed; a seeded request gives the same tokens alone or in any batch.
        stop: strings that end generation when they appear in the output text (not included by default).
        stop_token_ids: token ids that end generation (included in `token_ids`, not in text).
        ignore_eos: keep generating past the model's EOS token.
        min_tokens: EOS and stop tokens are not honoured before this many tokens.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        skip_special_tokens: leave special tokens out of the detokenized text.
        output_kind: CUMULATIVE, DELTA or FINAL_ONLY.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Check every field's range.

        Raises:
            InvalidRequestError: naming the field and its allowed range.
        """
        if self.max_tokens is not None and self.max_tokens < 1:
            _bad("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not self.temperature >= 0.0:
            _bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            _bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < -1:
            _bad("top_k", self.top_k, "-1, 0 (disabled) or >= 1")
        if self.min_tokens < 0:
            _bad("min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.stop is not None and any(not s for s in self.stop):
            _bad("stop", self.stop, "non-empty strings")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            _bad("stop_token_ids", self.stop_token_ids, "token ids >= 0")
        if not isinstance(self.output_kind, RequestOutputKind):
            _bad("output_kind", self.output_kind, "a RequestOutputKind")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0.0


def _bad(field: str, value: object, allowed: str) -> None:
    raise InvalidRequestError(f"SamplingParams.{field}={value!r} is invalid: must be {allowed}")
