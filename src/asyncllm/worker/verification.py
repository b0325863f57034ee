"""Sampling metadata of a speculative step: one row per verification position.

Row j of a request with drafts d_1..d_k samples the token after its known tokens plus d_1..d_j, so the
position-dependent parts of sampling see that context: penalties and `min_tokens` masks count d_1..d_j as
output tokens, and a seeded request's row j is seeded for output position `num_output_tokens + j` (as plain
decoding seeds each position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.logits_processing import RowTokens
from asyncllm.worker.sampler import SamplingMetadata, seed_generator


class VerifiedRequest(Protocol):
    """What verification reads of a request's worker state (`worker.model_runner.CachedRequestState`)."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None

    @property
    def num_output_tokens(self) -> int: ...


def build_verification_metadata(
    states: Sequence[VerifiedRequest], drafts: list[list[int]], vocab_size: int
) -> SamplingMetadata:
    """Per-row sampling parameters for `RejectionSampler`.

    Args:
        states: the requests that sample this step (their `token_ids` hold no drafts yet).
        drafts: per request, its draft tokens (possibly empty).
        vocab_size: logits width.
    Returns:
        Metadata with sum(len(d) + 1) rows, each request's rows consecutive.
    """
    params: list[SamplingParams] = []
    rows: list[RowTokens] = []
    generators: dict[int, torch.Generator] = {}
    needs_tokens = any(s.sampling_params.has_penalties or s.sampling_params.min_tokens > 0 for s in states)
    for state, draft in zip(states, drafts, strict=True):
        seed = state.sampling_params.seed
        for j in range(len(draft) + 1):
            row = len(params)
            params.append(state.sampling_params)
            if needs_tokens:
                prompt, output = state.token_ids[: state.num_prompt_tokens], state.token_ids[state.num_prompt_tokens :]
                rows.append(RowTokens(prompt, [*output, *draft[:j]], state.eos_token_id))
            if state.generator is not None and seed is not None:
                generator = state.generator if j == 0 else torch.Generator()
                generators[row] = seed_generator(generator, seed, state.num_output_tokens + j)
    return SamplingMetadata.from_params(params, vocab_size, generators, rows if needs_tokens else None)
