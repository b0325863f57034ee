"""Rotary position embedding tables: plain RoPE and Llama 3 frequency scaling, read from either config generation.

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
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3 RoPE frequency scaling (`rope_type: "llama3"`).

    Fields:
        factor: divisor of the low frequencies (e.g. 8.0 for Llama 3.1, 32.0 for Llama 3.2).
        low_freq_factor, high_freq_factor: wavelength band edges, as fractions of the original context.
        original_max_position_embeddings: the context length the model was pre-trained with, tokens.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def read_hf_rope(cfg: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """Rotary base and scaling from an HF config.json, in either generation.

    Current transformers writes `"rope_parameters": {"rope_theta": ..., "rope_type": ..., ...}` and no top-level
    `rope_theta`; older versions write a top-level `rope_theta` and an optional `rope_scaling` dict (whose type key
    is `rope_type`, or `type` in the oldest files).

    Returns:
        (rope_theta, the Llama 3 scaling or None for plain RoPE).
    Raises:
        ValueError: no rotary base in either place, the two places disagree, a `rope_type` other than
            "default"/"llama3", or a llama3 parameter missing.
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ValueError(f"config.json: rope_parameters/rope_scaling must be objects, got {params!r}, {scaling!r}")
    thetas = {float(v) for v in (cfg.get("rope_theta"), params.get("rope_theta")) if v is not None}
    if not thetas:
        raise ValueError("config.json has no rope_theta (neither top-level nor in rope_parameters)")
    if len(thetas) > 1:
        raise ValueError(f"config.json: rope_theta and rope_parameters.rope_theta disagree: {sorted(thetas)}")
    merged = {**scaling, **params}
    key = "rope_parameters" if params else "rope_scaling"
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: {key}.rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return thetas.pop(), None
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [n for n in names if merged.get(n) is None]
    if missing:
        raise ValueError(f"config.json: {key} with rope_type 'llama3' lacks {missing}")
    return thetas.pop(), Llama3RopeScaling(
        factor=float(merged["factor"]),
        low_freq_factor=float(merged["low_freq_factor"]),
        high_freq_factor=float(merged["high_freq_factor"]),
        original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
    )


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies, [head_dim // 2] float64, radians per token (Llama 3.1 rule when `scaling` is given)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    old_context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    smooth = (old_context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelength > old_context / scaling.low_freq_factor, inv_freq / scaling.factor, interpolated)
    return torch.where(wavelength < old_context / scaling.high_freq_factor, inv_freq, scaled)


def rotary_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables `kernels.rotary.apply_rotary` takes, from `[head_dim // 2]` inverse frequencies.

    Returns:
        `[cos, cos]` and `[-sin, sin]` (halves concatenated on the last axis), each [max_positions, head_dim]
        float32: the "rotate half" layout of HF Llama with rotate_half's sign folded into the sin table.
    """
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
