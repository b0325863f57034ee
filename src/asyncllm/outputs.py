"""What a stream yields: `RequestOutput` with one `CompletionOutput` per sequence (shape follows vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReasonStr = Literal["stop", "length", "abort"]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Fields:
        index: position of this completion among the request's completions (0 when n == 1).
        text: generated text (all of it, or the new part for DELTA streams).
        token_ids: generated token ids (all, or the new ones for DELTA streams).
        finish_reason: "stop" (EOS, stop string or stop token), "length" (max_tokens or max_model_len),
            "abort" (cancelled), or None while the sequence is still running.
        stop_reason: the stop string or stop token id that ended the sequence; None for EOS or otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReasonStr | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One item of a `GenerateOutputStream`.

    Fields:
        request_id: the id given to (or made by) `generate()`.
        prompt: the prompt text (rendered chat template for chat prompts; None for token-id prompts).
        prompt_token_ids: the prompt as token ids.
        outputs: the completions.
        finished: True on the last output of the request, and only there.
        num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
