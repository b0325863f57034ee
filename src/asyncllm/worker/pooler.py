"""`PromptPooler`: one embedding request's pooled vector, accumulated over its prefill chunks; `pool_step` feeds
the poolers of one model-runner step.

Pooling reads the model's final-norm hidden states of the prompt tokens (as vLLM's pooler,
vllm/model_executor/layers/pooler.py): "last" takes the last prompt position's row, "cls" the first one's,
"mean" the mean over all rows. Chunked prefill is handled by accumulating: each chunk adds its rows (a running
float64 sum for "mean", the first row of the first chunk for "cls", the last row of the final chunk for "last"),
and the vector is finished in the step whose chunk reaches the end of the prompt. Then it is truncated to
`dimensions` (Matryoshka / OpenAI `dimensions`) and L2-normalized when `normalize` is set (`F.normalize`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from asyncllm.pooling_params import PoolingParams


class PromptPooler:
    """Accumulates one request's pooled hidden state over its prompt chunks.

    Args:
        params: the request's validated `PoolingParams`.
        num_prompt_tokens: prompt length; the vector is done once a chunk ends there.
    """

    def __init__(self, params: PoolingParams, num_prompt_tokens: int) -> None:
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self._sum: torch.Tensor | None = None  # [hidden_size] float64, "mean"
        self._first: torch.Tensor | None = None  # [hidden_size], "cls"

    def add_chunk(self, hidden: torch.Tensor, start: int) -> list[float] | None:
        """Add the hidden states of prompt positions [start, start + len(hidden)).

        Args:
            hidden: [num_chunk_tokens, hidden_size] float32 final-norm hidden states of this chunk.
            start: the chunk's first prompt position.
        Returns:
            The finished embedding ([hidden_size] or [dimensions] floats) when this chunk ends the prompt,
            else None.
        """
        kind = self.params.pooling
        end = start + hidden.shape[0]
        if kind == "mean":
            chunk_sum = hidden.sum(0, dtype=torch.float64)
            self._sum = chunk_sum if self._sum is None else self._sum + chunk_sum
        elif kind == "cls" and start == 0:
            self._first = hidden[0].clone()
        if end < self.num_prompt_tokens:
            return None
        if kind == "mean":
            assert self._sum is not None
            vector = (self._sum / self.num_prompt_tokens).to(torch.float32)
        elif kind == "cls":
            assert self._first is not None
            vector = self._first
        else:
            vector = hidden[-1]
        return finish_embedding(vector, self.params)


def finish_embedding(vector: torch.Tensor, params: PoolingParams) -> list[float]:
    """Truncate a pooled [hidden_size] vector to `params.dimensions` and L2-normalize it if asked.

    Returns:
        The embedding as floats ([dimensions] or [hidden_size]).
    """
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, p=2.0, dim=0)
    result: list[float] = vector.tolist()
    return result


def pool_step(
    requests: Iterable[tuple[str, PromptPooler | None, int]], query_lens: np.ndarray, hidden: torch.Tensor
) -> dict[str, list[float]]:
    """Feed each embedding request's rows of one step to its pooler.

    Args:
        requests: per scheduled request, in row order: (request id, its pooler or None, the chunk's first prompt
            position, i.e. its computed tokens before the step).
        query_lens: [num_requests] tokens scheduled per request.
        hidden: [num_tokens, hidden_size] the step's final-norm hidden states.
    Returns:
        request id -> embedding, for the requests whose prompt ends in this step.
    """
    pooled: dict[str, list[float]] = {}
    row_start = 0
    for (req_id, pooler, start), num_tokens in zip(requests, query_lens.tolist(), strict=True):
        if pooler is not None:
            vector = pooler.add_chunk(hidden[row_start : row_start + num_tokens], start)
            if vector is not None:
                pooled[req_id] = vector
        row_start += num_tokens
    return pooled
