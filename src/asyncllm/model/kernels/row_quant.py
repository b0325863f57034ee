"""Symmetric per-row int8 quantization of activations: the torch reference that the int8 products' callers use and
that the fused row kernels' quantizing steps (`row_kernels.py`) must equal bit for bit.

Source: LLM.int8() (Dettmers et al., 2022) for per-row absmax scaling; "Integer Quantization for Deep Learning
Inference" (Wu et al., 2020) for symmetric scales.
"""

from __future__ import annotations

import torch


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization of `[rows, features]` float32 activations: `scale = max |x[i]| / 127`,
    `q = round_half_even(x / scale)`, so every value is in [-127, 127].

    Returns:
        (int8 [rows, features], float32 [rows, 1] scales); a row of zeros gets a tiny scale and stays zero.
    """
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).mul_(1 / 127)
    return x.div(scale).round_().to(torch.int8), scale
