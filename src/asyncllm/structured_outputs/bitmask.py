"""The grammar token bitmask's application to logits (torch only); the wire type is `messages.scheduler.GrammarBitmask`.

Bit layout (xgrammar's): row r allows token t iff bit `t % 32` of int32 word `t // 32` of row r is set;
a row has `ceil(vocab_size / 32)` words. The engine core fills one row per constrained request that samples
this step and broadcasts the packed rows to every worker (the same mask on every tensor-parallel rank).
"""

from __future__ import annotations

import torch

from asyncllm.messages.scheduler import GrammarBitmask

__all__ = ["GrammarBitmask", "apply_grammar_bitmask", "unpack_bitmask"]


_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # [256, 8]: byte -> its bits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, num_words] int32 words -> [rows, vocab_size] bool, True where the token is allowed.

    Reads the words as little-endian bytes and looks each byte's 8 bits up in a table (one gather instead of 32
    shifts of every word). Tokens past `32 * num_words` are disallowed.
    """
    rows = bitmask.shape[0]
    allowed = _BYTE_BITS[bitmask.contiguous().view(torch.uint8).long()].reshape(rows, -1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(rows, vocab_size - allowed.shape[1], dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf in the constrained rows.

    Args:
        logits: [num_reqs, vocab_size] float32 (not modified).
        rows: [num_constrained] int64 row indices into `logits`.
        allowed: [num_constrained, vocab_size] bool (see `unpack_bitmask`).
    Returns:
        A new [num_reqs, vocab_size] tensor; unconstrained rows are unchanged.
    """
    if rows.shape[0] == logits.shape[0] and bool((rows == torch.arange(rows.shape[0])).all()):
        return logits.masked_fill(~allowed, float("-inf"))  # every row constrained, in order
    constrained = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, rows, constrained)
