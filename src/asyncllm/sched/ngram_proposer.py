"""N-gram ("prompt lookup") draft proposals: copy what followed an earlier occurrence of the last n tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of a request (prompt + output)
are looked up among its earlier tokens; at the most recent earlier match, the (up to k) tokens that followed
it are the draft. The first n that matches wins (longer contexts predict better). Method of Saxena's "prompt
lookup decoding" and vLLM's `NgramProposer` (vllm/v1/spec_decode/ngram_proposer.py); written with numpy.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from asyncllm.engine_config import SpeculativeConfig


def propose_ngram(token_ids: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Draft tokens for one sequence.

    Args:
        token_ids: [num_tokens_so_far] int64, prompt + output.
        num_tokens: draft tokens at most (k).
        min_n, max_n: n-gram sizes looked up, longest first.
    Returns:
        Up to `num_tokens` token ids (empty when no n-gram in [min_n, max_n] occurs earlier).
    """
    length = len(token_ids)
    if num_tokens <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        windows = sliding_window_view(token_ids[: length - 1], n)  # [length - n, n]; excludes the suffix itself
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return token_ids[start : start + num_tokens].tolist()
    return []


class NgramProposer:
    """Proposes drafts for requests from their token ids (runs in the engine core, before scheduling).

    Args:
        config: k and the n-gram size range.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_num_tokens: int) -> list[int]:
        """Up to `min(k, max_num_tokens)` draft tokens continuing `token_ids` (prompt + output)."""
        limit = min(self.num_speculative_tokens, max_num_tokens)
        if limit <= 0 or len(token_ids) <= self.min_n:
            return []
        return propose_ngram(np.asarray(token_ids, dtype=np.int64), limit, self.min_n, self.max_n)
