"""Per-row logit edits applied before sampling: per-request logits processors (callables), allowed tokens,
min_tokens, bad words, logit bias, penalties, min-p.

Each edit is a tensor built once per step from the rows' parameters (None when no row in the batch uses it),
so a batch without these parameters pays nothing. Formulas follow vLLM v1 (`vllm/v1/sample/ops/penalties.py`,
`vllm/model_executor/layers/utils.py::apply_penalties`, `vllm/v1/sample/logits_processor`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.sampling_params import SamplingParams

LOGIT_BIAS_LIMIT = 100.0  # |bias| at most, as OpenAI and vLLM clamp it


@dataclass
class RowTokens:
    """The tokens of one sampled row that the edits depend on.

    Fields:
        prompt_token_ids: [num_prompt_tokens].
        output_token_ids: tokens generated so far.
        eos_token_id: the model's EOS id (masked before `min_tokens`), or None.
    """

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None = None


@dataclass
class Penalties:
    """Penalty parameters and token statistics of the sampled rows.

    Fields:
        repetition, frequency, presence: [num_reqs] float32 penalties.
        output_counts: [num_reqs, vocab_size] float32, times each token was generated.
        seen: [num_reqs, vocab_size] bool, token in the prompt or the output.
    """

    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    output_counts: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def from_rows(cls, params: list[SamplingParams], rows: list[RowTokens], vocab_size: int) -> Penalties:
        counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32)
        seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
        for i, row in enumerate(rows):
            output = torch.tensor(row.output_token_ids, dtype=torch.int64)
            counts[i].index_add_(0, output, torch.ones(len(output), dtype=torch.float32))
            seen[i, torch.tensor(row.prompt_token_ids, dtype=torch.int64)] = True
        return cls(
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
            output_counts=counts,
            seen=seen | (counts > 0),
        )


@dataclass
class LogitsEdits:
    """The edits of one step; every tensor has one row per sampled request.

    Fields:
        additive: [num_reqs, vocab_size] float32 added to the logits (logit bias, and -inf for tokens outside
            `allowed_token_ids` or for EOS/stop tokens before `min_tokens`), or None.
        penalties: or None when no row uses penalties.
        min_p: [num_reqs] float32, or None when no row uses min-p.
    """

    additive: torch.Tensor | None = None
    penalties: Penalties | None = None
    min_p: torch.Tensor | None = None

    @classmethod
    def from_rows(cls, params: list[SamplingParams], rows: list[RowTokens], vocab_size: int) -> LogitsEdits:
        """Build the edits for sampled rows with `params` and `rows` (one each per row)."""
        edits = cls(additive=_build_additive(params, rows, vocab_size))
        if any(p.has_penalties for p in params):
            edits.penalties = Penalties.from_rows(params, rows, vocab_size)
        if any(p.min_p > 0.0 for p in params):
            edits.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        return edits

    def apply_before_temperature(self, logits: torch.Tensor) -> torch.Tensor:
        """Additive edits, then penalties. [num_reqs, vocab_size] -> a new tensor (or `logits` if no edit)."""
        if self.additive is not None:
            logits = logits + self.additive
        if self.penalties is not None:
            logits = apply_penalties(logits, self.penalties)
        return logits


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition, frequency and presence penalties.

    Args:
        logits: [num_reqs, vocab_size] float32.
        penalties: the rows' penalties and token statistics.
    Returns:
        A new [num_reqs, vocab_size] tensor: for tokens in the prompt or output, positive logits divided by
        the repetition penalty and negative ones multiplied by it (CTRL, Keskar et al., 2019); then
        `- frequency * count - presence * (count > 0)` over generated tokens (OpenAI's definition).
    """
    penalty = torch.where(penalties.seen, penalties.repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    counts = penalties.output_counts
    logits = logits - penalties.frequency.unsqueeze(1) * counts
    return logits - penalties.presence.unsqueeze(1) * (counts > 0).float()


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below `min_p` times the row's top probability.

    Args:
        logits: [num_reqs, vocab_size] float32 (temperature already applied).
        min_p: [num_reqs] float32 in [0, 1].
    Returns:
        A new tensor with masked entries at -inf. Source: min-p sampling (Nguyen et al., 2024).
    """
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _build_additive(params: list[SamplingParams], rows: list[RowTokens], vocab_size: int) -> torch.Tensor | None:
    """Logit bias, allowed-token masks and min_tokens masks as one additive tensor (None if no row needs it)."""
    additive: torch.Tensor | None = None
    for i, (p, row) in enumerate(zip(params, rows, strict=True)):
        masked = _min_tokens_masked_ids(p, row) + _bad_words_masked_ids(p, row)
        if not (p.logit_bias or p.allowed_token_ids or masked):
            continue
        if additive is None:
            additive = torch.zeros(len(params), vocab_size, dtype=torch.float32)
        if p.allowed_token_ids:
            allowed = torch.tensor(p.allowed_token_ids, dtype=torch.int64)
            additive[i].fill_(float("-inf")).index_fill_(0, allowed, 0.0)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
            additive[i].index_add_(0, ids, bias.clamp(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT))
        if masked:
            additive[i, masked] = float("-inf")
    return additive


def _min_tokens_masked_ids(params: SamplingParams, row: RowTokens) -> list[int]:
    """EOS and stop token ids a row may not sample yet (fewer than `min_tokens` generated)."""
    if len(row.output_token_ids) >= params.min_tokens:
        return []
    ids = list(params.stop_token_ids or ())
    if row.eos_token_id is not None and not params.ignore_eos:
        ids.append(row.eos_token_id)
    return ids


def _bad_words_masked_ids(params: SamplingParams, row: RowTokens) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far (a one-token word: always)."""
    masked = []
    output = row.output_token_ids
    for ids in params.bad_words_token_ids or ():
        prefix = ids[:-1]
        if len(prefix) <= len(output) and (not prefix or output[len(output) - len(prefix) :] == prefix):
            masked.append(ids[-1])
    return masked


def apply_logits_processors(
    logits: torch.Tensor, processors: dict[int, tuple[tuple[Any, ...], RowTokens]]
) -> tuple[torch.Tensor, dict[int, str]]:
    """Run each row's per-request callables (`SamplingParams.logits_processors`) on its logits row, in order.

    Args:
        logits: [num_reqs, vocab_size] float32 (not modified).
        processors: row -> (callables, the row's tokens). A callable takes `(output_token_ids, logits_row)` or
            `(prompt_token_ids, output_token_ids, logits_row)` (by its number of parameters, as vLLM v0) and
            returns a [vocab_size] tensor.
    Returns:
        A new [num_reqs, vocab_size] tensor, and row -> error message for rows whose callable raised or returned
        something else than a [vocab_size] tensor (those rows are left unprocessed; their requests are failed).
    """
    logits = logits.clone()
    failed: dict[int, str] = {}
    for row, (functions, tokens) in processors.items():
        values = logits[row].clone()
        try:
            for function in functions:
                values = _call_processor(function, tokens, values)
        except Exception as e:  # the user's code: fail its request alone
            failed[row] = f"a logits processor raised {type(e).__name__}: {e}"
            continue
        logits[row] = values
    return logits, failed


def _call_processor(function: Any, tokens: RowTokens, values: torch.Tensor) -> torch.Tensor:
    """One processor call; its result checked to be a [vocab_size] tensor (TypeError otherwise)."""
    output_ids = list(tokens.output_token_ids)
    if _num_positional_parameters(function) >= 3:
        result = function(list(tokens.prompt_token_ids), output_ids, values)
    else:
        result = function(output_ids, values)
    if not isinstance(result, torch.Tensor) or result.shape != values.shape:
        shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise TypeError(f"it must return a tensor of shape {tuple(values.shape)}, returned {shape}")
    return result.to(torch.float32)


def _num_positional_parameters(function: Any) -> int:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 2
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in kinds)
