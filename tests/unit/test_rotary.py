"""`apply_rotary` on `rotary_cos_sin`'s sign-folded tables is HF Llama's rotate-half RoPE, bit for bit."""

from __future__ import annotations

import torch

from asyncllm.model.kernels.rotary import apply_rotary
from asyncllm.model.layers.rotary import rope_inv_freq, rotary_cos_sin


def _rotate_half_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF Llama's form: `x * cos + rotate_half(x) * sin` on [head_dim // 2] tables repeated twice."""
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    cos, sin = angles.cos().float()[:, None], angles.sin().float()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def test_apply_rotary_equals_rotate_half_exactly() -> None:
    head_dim, max_positions = 64, 300
    inv_freq = rope_inv_freq(head_dim, 10000.0)
    cos, sin = rotary_cos_sin(inv_freq, max_positions)
    assert cos.shape == sin.shape == (max_positions, head_dim)
    positions = torch.tensor([0, 1, 7, 150, 299])
    x = torch.randn(len(positions), 9, head_dim, generator=torch.Generator().manual_seed(0)) * 4
    out = apply_rotary(x, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    assert torch.equal(out, _rotate_half_reference(x, positions, inv_freq))
    assert torch.equal(out[0], x[0])  # position 0 is the identity
