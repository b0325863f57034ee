"""Rotary position embedding tables: plain RoPE, Llama 3 frequency scaling and Phi-3's LongRoPE (read from the config
by `loading/hf_config.py` and `loading/gguf_config.py`; LongRoPE as HF's `_compute_longrope_parameters`: frequencies
divided by the short factors below the original context and by the long factors from it on (`arch.LongRopeScaling`
says why per position), cos and sin times the attention factor).

Sources: RoFormer (Su et al., 2021) for the inverse frequencies `theta ** (-2i / head_dim)`; the Llama 3.1 rule for
stretching them to a longer context, as published with Meta's Llama 3.1 reference code (`apply_scaling` in
meta-llama/llama-models, models/llama3/reference_impl/model.py): with wavelength `2*pi / f`, frequencies whose
wavelength is shorter than `original_max_position_embeddings / high_freq_factor` are kept, those longer than
`original_max_position_embeddings / low_freq_factor` are divided by `factor`, and those between are interpolated
with `smooth = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor -
low_freq_factor)` as `(1 - smooth) * f / factor + smooth * f`.
"""

from __future__ import annotations

import math

import torch

from asyncllm.model.arch import Llama3RopeScaling, LongRopeScaling, ModelArchConfig


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Llama3RopeScaling | LongRopeScaling | None = None, long: bool = False
) -> torch.Tensor:
    """Inverse frequencies, [head_dim // 2] float64, radians per token (Llama 3.1 rule when `scaling` is Llama 3's;
    divided by the short factors when it is LongRoPE's, by the long ones with `long`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LongRopeScaling):
        factors = scaling.long_factor if long else scaling.short_factor
        return inv_freq / torch.tensor(factors, dtype=torch.float64)
    old_context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    smooth = (old_context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelength > old_context / scaling.low_freq_factor, inv_freq / scaling.factor, interpolated)
    return torch.where(wavelength < old_context / scaling.high_freq_factor, inv_freq, scaled)


def arch_inv_freq(arch: ModelArchConfig, long: bool = False) -> torch.Tensor:
    """A checkpoint's RoPE inverse frequencies, [head_dim // 2] float64, radians per token: its Llama 3 scaling,
    LongRoPE factors (the long ones with `long`) or GGUF `rope_freqs` divisors applied. Over the rotated dims only
    (`arch.rotary_dim`, [rotary_dim // 2]) when rotary is partial."""
    inv_freq = rope_inv_freq(arch.rotary_dim or arch.head_dim, arch.rope_theta, arch.rope_scaling, long)
    if arch.rope_freq_divisors is not None:
        inv_freq = inv_freq / torch.tensor(arch.rope_freq_divisors, dtype=torch.float64)
    return inv_freq


def arch_cos_sin(arch: ModelArchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's cos and sin tables over its context (`rotary_cos_sin` of `arch_inv_freq`): each
    [max_position_embeddings, rotated dims] float32, row p for position p.

    LongRoPE: rows below `original_max_position_embeddings` from the short factors, the rest from the long ones,
    all times the attention factor.
    """
    cos, sin = rotary_cos_sin(arch_inv_freq(arch), arch.max_position_embeddings)
    scaling = arch.rope_scaling
    if not isinstance(scaling, LongRopeScaling):
        return cos, sin
    original = scaling.original_max_position_embeddings
    if original < arch.max_position_embeddings:
        long_cos, long_sin = rotary_cos_sin(arch_inv_freq(arch, long=True), arch.max_position_embeddings)
        cos[original:], sin[original:] = long_cos[original:], long_sin[original:]
    return cos * scaling.attention_factor, sin * scaling.attention_factor


def rotary_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables `kernels.rotary.apply_rotary` takes, from `[head_dim // 2]` inverse frequencies.

    Returns:
        `[cos, cos]` and `[-sin, sin]` (halves concatenated on the last axis), each [max_positions, head_dim]
        float32: the "rotate half" layout of HF Llama with rotate_half's sign folded into the sin table.
    """
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
