"""Sampling parameters of one request, validated at submission.

`SamplingParams` is a msgspec Struct so it crosses the engine-process boundary without pickle.
Semantics follow vLLM's `SamplingParams` (https://docs.vllm.ai) for the fields present here.
"""

from __future__ import annotations

import enum
import math
from typing import Any, NoReturn

import msgspec

from asyncllm.errors import InvalidRequestError
from asyncllm.structured_outputs.params import StructuredOutputsParams


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a stream carries.

    CUMULATIVE: all text and token ids generated so far (default).
    DELTA: only what is new since the previous output of the stream.
    FINAL_ONLY: a single output, when the request finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class RepetitionDetectionParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Stop a request whose generated tail is one pattern repeated (vLLM's `RepetitionDetectionParams`).

    The request finishes with finish_reason "repetition" (stop_reason "repetition_detected") as soon as its
    last `L * min_count` output tokens are one pattern of `L` tokens repeated `min_count` times, for some
    `L` in [`min_pattern_size`, `max_pattern_size`]. Checked after every generated token (cost
    O(max_pattern_size) per token, see `sched/repetition.py`).

    Fields:
        max_pattern_size: largest pattern size in tokens; 0 disables detection.
        min_pattern_size: smallest pattern size in tokens; 0 means 1. At most `max_pattern_size`.
        min_count: repetitions that trigger it; >= 2 when detection is enabled.
    """

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0

    def validate(self) -> None:
        """Raises:
        InvalidRequestError: naming the field (`repetition_detection.<field>`) and its allowed range.
        """
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            _check_int(f"repetition_detection.{name}", getattr(self, name), 0)
        if not self.enabled:
            return
        if self.min_pattern_size > self.max_pattern_size:
            _bad(
                "repetition_detection.min_pattern_size",
                self.min_pattern_size,
                f"<= max_pattern_size ({self.max_pattern_size})",
            )
        if self.min_count < 2:
            _bad("repetition_detection.min_count", self.min_count, "an integer >= 2 when max_pattern_size > 0")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample one request. Same names and meanings as vLLM's `SamplingParams`.

    Fields:
        n: completions per prompt, in [1, 128] (OpenAI's limit: each is an engine request); they share one
            stream, tagged by `CompletionOutput.index`.
        max_tokens: generated tokens at most (>= 1); None means up to `max_model_len`. A prompt with
            `num_prompt_tokens + max_tokens > max_model_len` is rejected at submission.
        temperature: finite, >= 0; below `SAMPLING_EPS` (1e-5, vLLM's `_SAMPLING_EPS`) means greedy (argmax):
            dividing logits by a tiny temperature overflows float32 and would sample garbage.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it; at most 2**63 - 1.
        min_p: in [0, 1]; drop tokens whose probability is below `min_p` times the top token's.
        seed: per-request seed in [0, 2**63 - 1]; a seeded request gives the same tokens alone or in any batch.
            With n > 1, completion i uses `seed + i` (so `seed + n - 1` must stay in range). The range is the one
            a msgpack int64 and torch's generator carry without wrapping: every accepted seed gives its own
            random stream (a wider range would alias, e.g. 5 and 5 + 2**63).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token already generated.
        frequency_penalty: in [-2, 2]; subtracted from a token's logit per time it was generated.
        repetition_penalty: finite, > 0; logits of tokens in the prompt or the output are divided by it when
            positive and multiplied by it when negative (1 disables it; CTRL, Keskar et al., 2019).
        logit_bias: token id -> bias added to its logit; bias a number (not NaN), clamped to [-100, 100] (as
            OpenAI/vLLM).
    Every integer (counts, token ids, seed) must fit in a signed 64-bit integer (`MAX_INT64`), the wire's
    limit; token ids are checked against the model's vocabulary at submission (`validate_vocab`).
        allowed_token_ids: when set (non-empty), only these tokens can be sampled.
        stop: strings that end generation when they appear in the output text (not included by default).
        stop_token_ids: token ids that end generation (included in `token_ids`, not in text).
        ignore_eos: keep generating past the model's EOS token.
        min_tokens: EOS and stop tokens cannot be sampled (masked) before this many tokens.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        skip_special_tokens: leave special tokens out of the detokenized text.
        logprobs: None, -1 (every token of the vocabulary), or k >= 0: return per generated token the sampled
            token's logprob first, then the k most likely tokens' by rank (k = 0: only the sampled token's), as
            vLLM. At most `EngineArgs.max_logprobs` (default 20; -1 there allows the whole vocabulary), checked
            at submission. Logprobs are of the raw model distribution (log_softmax of the logits before
            temperature, penalties and masks) unless `EngineArgs.logprobs_mode` says otherwise.
        prompt_logprobs: None, -1 or k >= 0: the same for each prompt token (the first entry is None).
        output_kind: CUMULATIVE, DELTA or FINAL_ONLY.
        stream_interval: emit an output every this many generated tokens (and at the end); >= 1.
        structured_outputs: constrain the output to a JSON schema, JSON object, regex, choice or grammar
            (`StructuredOutputsParams`); None = free text. Not combinable with `min_tokens` > 0 (the grammar
            may allow only EOS).
        repetition_detection: stop with finish_reason "repetition" when the output's tail repeats a pattern
            (`RepetitionDetectionParams`); None (default) = off.
        bad_words: words never generated (vLLM's `bad_words`): each word is tokenized as is and with a leading
            space; the last token of a tokenization is masked whenever the output ends with the tokens before it
            (a one-token word is never sampled). Set `bad_words_token_ids` at submission.
        bad_words_token_ids: the token sequences of `bad_words`, filled at submission (not for users to set).
        logits_processors: per-request callables, as vLLM v0 documents them: `fn(output_token_ids, logits)` or
            `fn(prompt_token_ids, output_token_ids, logits)`, `logits` the request's [vocab_size] float32 row,
            returning the new row. Applied before every other edit (grammar, bias, penalties, temperature), one
            row at a time, in any batch. Callables cannot cross a process boundary without pickle: they need
            `EngineArgs(engine_process=False)` with the "uni" executor, one engine and no speculative decoding
            (refused otherwise at submission). An exception in one fails that request alone (its stream raises
            `EngineGenerateError`).
        logits_processors_key: set at submission (not for users): where the worker finds the callables.
        detokenize: False: outputs carry token ids and an empty `text` (no detokenization; stop strings cannot
            be used then, as vLLM).
        best_of: vLLM v1's rejection kept: None or 1 only (`best_of > 1` raises, as vLLM v1 does).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int = 1
    structured_outputs: StructuredOutputsParams | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    logits_processors: list[Any] | None = None
    logits_processors_key: str | None = None
    detokenize: bool = True
    best_of: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range.

        Raises:
            InvalidRequestError: naming the field and its allowed range, or the expected type (e.g.
                "must be a number (int or float), got str").
        """
        self._validate_counts()
        self._validate_sampling()
        self._validate_penalties()
        self._validate_token_lists()
        if not isinstance(self.output_kind, RequestOutputKind):
            _bad("output_kind", self.output_kind, "a RequestOutputKind")
        self._validate_structured_outputs()
        self._validate_vllm_options()
        if self.repetition_detection is not None:
            if not isinstance(self.repetition_detection, RepetitionDetectionParams):
                _bad("repetition_detection", self.repetition_detection, "a RepetitionDetectionParams or None")
            self.repetition_detection.validate()

    def validate_vocab(self, vocab_size: int) -> None:
        """Check the token ids in `stop_token_ids`, `logit_bias` and `allowed_token_ids` against the model.

        Raises:
            InvalidRequestError: a token id is outside [0, vocab_size).
        """
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            ids = getattr(self, name) or ()
            bad = sorted(t for t in ids if t >= vocab_size)
            if bad:
                _bad(name, bad, f"token ids in [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax: temperature below `SAMPLING_EPS` (as vLLM's `SamplingType.GREEDY`)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """True when presence, frequency or repetition penalties change the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def _validate_structured_outputs(self) -> None:
        if self.structured_outputs is None:
            return
        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            _bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")
        self.structured_outputs.validate()
        if self.min_tokens > 0:
            _bad("min_tokens", self.min_tokens, "0 with structured_outputs (the grammar may only allow EOS)")

    def _validate_vllm_options(self) -> None:
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1, "None or 1")
            if self.best_of > 1:
                raise InvalidRequestError(
                    f"SamplingParams.best_of={self.best_of} is invalid: vLLM V1 does not yet support best_of, "
                    "and asyncllm follows it (ask for n completions with logprobs and pick one)"
                )
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            _bad("bad_words", self.bad_words, "a list of non-blank strings")
        if self.logits_processors is not None and any(not callable(f) for f in self.logits_processors):
            _bad("logits_processors", self.logits_processors, "a list of callables")
        if not isinstance(self.detokenize, bool):
            _bad("detokenize", self.detokenize, "True or False")
        if not self.detokenize and self.stop:
            _bad("stop", self.stop, "None with detokenize=False (stop strings need the text; as vLLM)")

    def _validate_counts(self) -> None:
        _check_int("n", self.n, 1, f"an integer in [1, {MAX_N}]", MAX_N)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, "an integer >= 1 or None")
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        _check_int("stream_interval", self.stream_interval, 1)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, -1, "None, -1 (the whole vocabulary) or an integer >= 0")
        if self.seed is not None:
            top = MAX_INT64 - (self.n - 1)  # child i of an n > 1 request uses seed + i
            _check_int("seed", self.seed, 0, f"None or an integer in [0, {top}] (2**63 - n)", top)

    def _validate_sampling(self) -> None:
        if not 0.0 <= _check_number("temperature", self.temperature) < math.inf:
            _bad("temperature", self.temperature, ">= 0 and finite")
        if not 0.0 < _check_number("top_p", self.top_p) <= 1.0:
            _bad("top_p", self.top_p, "in (0, 1]")
        _check_int("top_k", self.top_k, -1, "-1, 0 (disabled) or an integer in [1, 2**63 - 1]")
        if not 0.0 <= _check_number("min_p", self.min_p) <= 1.0:
            _bad("min_p", self.min_p, "in [0, 1]")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= _check_number(name, value) <= 2.0:
                _bad(name, value, "in [-2, 2]")
        if not 0.0 < _check_number("repetition_penalty", self.repetition_penalty) < math.inf:
            _bad("repetition_penalty", self.repetition_penalty, "> 0 and finite (1 disables it)")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if math.isnan(_check_number("logit_bias", bias, {token_id: bias})):
                    _bad("logit_bias", {token_id: bias}, "token id -> a number")

    def _validate_token_lists(self) -> None:
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            _bad("stop", self.stop, "non-empty strings")
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            ids = getattr(self, name)
            if ids is not None and any(not _is_token_id(t) for t in ids):
                _bad(name, ids, "token ids >= 0")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            _bad("allowed_token_ids", self.allowed_token_ids, "None or a non-empty list of token ids")


MAX_LOGPROBS = 20  # top logprobs per token at most by default (vLLM's max_logprobs default, OpenAI's top_logprobs)
MAX_INT64 = 2**63 - 1  # every integer field at most: msgpack's signed 64-bit range, torch's seed range
MAX_N = 128  # completions per request at most (OpenAI's limit for `n`)
SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's `_SAMPLING_EPS`)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT64


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_number(field: str, value: object, shown: object = None) -> float:
    """`value` as a float; raises InvalidRequestError naming the field and the expected type if it is no number."""
    if not _is_number(value):
        _bad(field, value if shown is None else shown, f"a number (int or float), got {type(value).__name__}")
    if isinstance(value, int) and not -MAX_INT64 - 1 <= value <= MAX_INT64:
        _bad(field, value if shown is None else shown, "a float, or an int in the signed 64-bit range")
    return float(value)  # type: ignore[arg-type]


def _check_int(field: str, value: object, minimum: int, allowed: str | None = None, maximum: int = MAX_INT64) -> None:
    """Raises InvalidRequestError naming `field` unless `value` is an int (not bool) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        _bad(field, value, f"an integer, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        _bad(field, value, allowed or f"an integer in [{minimum}, {'2**63 - 1' if maximum == MAX_INT64 else maximum}]")


def _bad(field: str, value: object, allowed: str) -> NoReturn:
    raise InvalidRequestError(f"SamplingParams.{field}={value!r} is invalid: must be {allowed}")
