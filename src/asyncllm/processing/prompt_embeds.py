"""Prompt embeddings (`{"prompt_embeds": tensor}` prompts): checked and turned into the wire array.

The frontend accepts a torch tensor or a numpy array `[num_tokens, hidden_size]` of float32 (the model's dtype on
CPU) and sends it as a numpy array, which `messages/serial.py` carries as a zero-copy frame. The engine core
re-checks what it receives with the same function. torch is never imported here: a tensor is recognised only if
the caller's process already loaded torch (as `messages/serial.py` does).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from asyncllm.errors import InvalidRequestError
from asyncllm.sampling_params import SamplingParams

PLACEHOLDER_TOKEN_ID = 0  # the token id of every prompt position of an embeddings prompt (as vLLM's placeholders)


def to_prompt_embeds_array(value: Any, hidden_size: int) -> np.ndarray:
    """Check a prompt-embeddings value and return it as a C-contiguous float32 numpy array.

    Args:
        value: torch tensor or numpy array, [num_tokens, hidden_size] float32, every value finite.
        hidden_size: the model's hidden size (0 = unknown: the width is not checked).
    Returns:
        [num_tokens, hidden_size] float32 numpy array (no copy when `value` already is one, contiguous).
    Raises:
        InvalidRequestError: naming `prompt_embeds` and what is wrong: type, dtype, shape (2-D, non-empty, width
            `hidden_size`), or non-finite values.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            raise InvalidRequestError(f"prompt_embeds has dtype {value.dtype}; it must be torch.float32")
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise InvalidRequestError(
            f"prompt_embeds of type {type(value).__name__} is invalid: must be a torch.Tensor or a numpy array"
        )
    if value.dtype != np.float32:
        raise InvalidRequestError(f"prompt_embeds has dtype {value.dtype}; it must be float32")
    if value.ndim != 2 or value.shape[0] == 0:
        raise InvalidRequestError(
            f"prompt_embeds has shape {list(value.shape)}; it must be [num_tokens >= 1, hidden_size]"
        )
    if hidden_size and value.shape[1] != hidden_size:
        raise InvalidRequestError(
            f"prompt_embeds has shape {list(value.shape)}; rows must have the model's hidden size {hidden_size}"
        )
    if not np.isfinite(value).all():
        raise InvalidRequestError("prompt_embeds has non-finite values (nan or inf)")
    return np.ascontiguousarray(value)


def check_embeds_params(params: SamplingParams) -> None:
    """Refuse sampling parameters that read the prompt's token ids, which an embeddings prompt does not have.

    Raises:
        InvalidRequestError: `repetition_penalty` != 1 (it penalizes the prompt's tokens) or `prompt_logprobs`
            set (they score the prompt's tokens).
    """
    if params.repetition_penalty != 1.0:
        raise InvalidRequestError(
            f"SamplingParams.repetition_penalty={params.repetition_penalty} is invalid with prompt_embeds: "
            "it penalizes the prompt's token ids, which an embeddings prompt does not have (use 1.0)"
        )
    if params.prompt_logprobs is not None:
        raise InvalidRequestError(
            "SamplingParams.prompt_logprobs is invalid with prompt_embeds: there are no prompt token ids to score"
        )
