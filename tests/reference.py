"""Reference computations for tests: dense greedy margins from our own model, no engine involved."""

from __future__ import annotations

import torch

from asyncllm.model.layers.attention_metadata import build_attention_metadata


def next_token_logits(model: torch.nn.Module, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits after every prefix of `token_ids`, from one dense prefill in a fresh KV cache.

    Returns:
        [len(token_ids), vocab_size] float32; row i predicts token i + 1.
    """
    arch = model.arch
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    shape = (num_blocks, 2, block_size, arch.num_key_value_heads, arch.head_dim)
    kv_caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]
    meta = build_attention_metadata([n], [n], [list(range(num_blocks))], block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(n), kv_caches, meta)
        return model.compute_logits(hidden)


def greedy_margins(model: torch.nn.Module, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """Top-1 minus top-2 logit at each generated position (how clear each greedy choice was).

    Returns:
        len(output_ids) margins; margin i belongs to the choice of output_ids[i].
    """
    logits = next_token_logits(model, prompt_ids + output_ids)
    rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(output_ids)]
    top2 = rows.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def clear_prefix_len(margins: list[float], threshold: float) -> int:
    """Number of leading positions whose greedy choice is clear (margin >= threshold)."""
    for i, margin in enumerate(margins):
        if margin < threshold:
            return i
    return len(margins)


def dense_greedy(model: torch.nn.Module, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """`num_tokens` greedy token ids (EOS ignored) from dense prefills of the growing sequence, no engine."""
    ids = list(prompt_ids)
    for _ in range(num_tokens):
        ids.append(int(next_token_logits(model, ids)[-1].argmax()))
    return ids[len(prompt_ids) :]
