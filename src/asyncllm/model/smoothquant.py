"""SmoothQuant (Xiao et al., 2023): per-channel factors that move activation outliers into the weights before int8.

Activation outliers (a few input channels far larger than the rest) would waste a per-row int8 scale, so before
quantizing, the model is smoothed: per input channel j of each linear layer, `s_j = max|X_j|^alpha /
max|W_j|^(1 - alpha)` over a short calibration text (`kernels.linear.record_input_absmax` records `max|X_j|`); X is
divided by s (folded into the preceding RMSNorm weight, V projection or up projection, so it costs nothing at run
time) and W's row j multiplied by it. alpha is `SMOOTHING_ALPHA`; the accuracy it gives: `benchmarks/analysis.md`,
"int8 accuracy".
"""

from __future__ import annotations

import torch

SMOOTHING_ALPHA = 0.7  # SmoothQuant migration strength


def smoothing_scale(input_absmax: torch.Tensor, weight_absmax: torch.Tensor) -> torch.Tensor:
    """SmoothQuant per-input-channel factors `s = a^alpha / w^(1 - alpha)`, [in_features] float32 (> 0).

    Args:
        input_absmax: [in_features] max |activation| per channel over the calibration text.
        weight_absmax: [in_features] max |weight| per input row (over every output column).
    """
    a, w = input_absmax.clamp(min=1e-5), weight_absmax.clamp(min=1e-5)
    return (a.pow(SMOOTHING_ALPHA) / w.pow(1 - SMOOTHING_ALPHA)).clamp(min=1e-5)
