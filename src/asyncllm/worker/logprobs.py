"""Logprobs of scored tokens and their top-k alternatives, from raw model logits.

Raw means `log_softmax` of the model's logits before temperature, penalties and masks: the model's own
distribution, as vLLM v1 returns by default (`logprobs_mode="raw_logprobs"`).
"""

from __future__ import annotations

import torch

from asyncllm.messages.engine import LogprobsLists


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int], as_logits: bool = False
) -> LogprobsLists:
    """Score `token_ids` under `logits` and list each row's top alternatives.

    Args:
        logits: [num_rows, vocab_size] float32 logits (raw, or processed by the sampler).
        token_ids: [num_rows] int64, the token scored in each row (sampled, or the next prompt token).
        num_top: [num_rows] how many top tokens to list per row (k >= 0; the vocabulary size for all).
        as_logits: report the logits themselves instead of their log_softmax (`logprobs_mode` "*_logits").
    Returns:
        Per row: ids `[token, top_1, ..., top_k]`, their logprobs, and the token's rank (1 + number of tokens
        with a strictly higher logprob).
    """
    logprobs = logits.float() if as_logits else logits.float().log_softmax(dim=-1)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    max_top = max(num_top, default=0)
    if max_top > 0:
        top_logprobs, top_ids = logprobs.topk(max_top, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1).tolist()
        values = torch.cat([token_logprobs, top_logprobs], dim=1).tolist()
    else:
        ids, values = token_ids.unsqueeze(1).tolist(), token_logprobs.tolist()
    return LogprobsLists(
        token_ids=[row[: 1 + k] for row, k in zip(ids, num_top, strict=True)],
        logprobs=[row[: 1 + k] for row, k in zip(values, num_top, strict=True)],
        ranks=ranks.tolist(),
    )
