"""Incremental repetition detection over a request's output tokens (`SamplingParams.repetition_detection`).

The output's tail is a pattern of `L` tokens repeated `c` times exactly when each of its last `L * (c - 1)`
tokens equals the token `L` positions before it. So for every `L` in [min_pattern_size, max_pattern_size] the
detector keeps `run[L]`: how many trailing tokens in a row equal the token `L` before them. A new token extends
or resets each run (O(max_pattern_size) work per token, never a rescan of the output), and the request is
repetitive once some `run[L] >= L * (min_count - 1)`. Same condition as vLLM's `check_sequence_repetition`
(vllm/v1/core/sched/utils.py), which compares the tail directly at every step.
"""

from __future__ import annotations

import numpy as np

from asyncllm.sampling_params import RepetitionDetectionParams


class RepetitionDetector:
    """Per-request state of repetition detection; feed it every output token in order.

    Args:
        params: an enabled `RepetitionDetectionParams` (max_pattern_size > 0, min_count >= 2).
    """

    def __init__(self, params: RepetitionDetectionParams) -> None:
        min_size = max(params.min_pattern_size, 1)
        self._lags = np.arange(min_size, params.max_pattern_size + 1, dtype=np.int64)  # [num_sizes] pattern sizes
        self._needed = self._lags * (params.min_count - 1)  # [num_sizes] run length that means "repeated"
        self._runs = np.zeros(len(self._lags), dtype=np.int64)  # [num_sizes]
        self._window = np.full(params.max_pattern_size, -1, dtype=np.int64)  # ring: last max_pattern_size tokens
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Output tokens fed so far."""
        return self._num_tokens

    def add_token(self, token_id: int) -> bool:
        """Feed the next output token; True if the output now ends with a repeated pattern."""
        size = len(self._window)
        # The token L positions back sits at ring index (n - L) mod size; -1 (never a token id) before the start.
        previous = self._window[(self._num_tokens - self._lags) % size]
        previous = np.where(self._lags <= self._num_tokens, previous, -1)
        self._runs = np.where(previous == token_id, self._runs + 1, 0)
        self._window[self._num_tokens % size] = token_id
        self._num_tokens += 1
        return bool((self._runs >= self._needed).any())
