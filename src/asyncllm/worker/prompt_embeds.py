"""`embeds_override`: which rows of a model-runner step take prompt embeddings instead of token embeddings.

An embeddings prompt (`{"prompt_embeds": ...}`) has placeholder token ids; at its prompt positions the model's
first layer takes the given vectors (`LlamaForCausalLM.forward(embeds_override=...)`). Generated tokens after the
prompt are embedded as usual. A chunk that covers prompt positions [start, end) uses rows start..end of them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


def embeds_override(
    requests: Iterable[tuple[torch.Tensor | None, int, int]], query_lens: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step's prompt-embeddings rows, for the model's `embeds_override`.

    Args:
        requests: per scheduled request, in row order: (its [num_prompt_tokens, hidden_size] prompt embeddings
            or None, computed tokens before the step, num_prompt_tokens).
        query_lens: [num_requests] tokens scheduled per request.
    Returns:
        (flat rows [n] int64, their vectors [n, hidden_size]), or None when no scheduled token is an embeddings
        prompt position.
    """
    rows, values = [], []
    row_start = 0
    for (embeds, start, num_prompt_tokens), num_tokens in zip(requests, query_lens.tolist(), strict=True):
        end = min(start + num_tokens, num_prompt_tokens)
        if embeds is not None and start < end:
            rows.append(torch.arange(row_start, row_start + end - start))
            values.append(embeds[start:end])
        row_start += num_tokens
    if not rows:
        return None
    return torch.cat(rows), torch.cat(values)


def embeds_from_bytes(data: bytes | None, num_prompt_tokens: int) -> torch.Tensor | None:
    """[num_prompt_tokens, hidden_size] float32 from `NewRequestData.prompt_embeds` (little-endian float32 bytes);
    None stays None."""
    if data is None:
        return None
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").reshape(num_prompt_tokens, -1).copy())
