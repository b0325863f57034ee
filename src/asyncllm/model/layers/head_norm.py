"""RMSNorm over each attention head's vector (Qwen3's `q_norm` / `k_norm`, applied to q and k before rotary).

Source: RMSNorm (Zhang & Sennrich, 2019), per head as in Qwen3 (the QK-norm of Dehghani et al., 2023, with RMSNorm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncllm.model.kernels.row_kernels import RowKernels


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: RowKernels | None = None) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over each head's last dim.

    Args:
        x: [num_tokens, num_heads, head_dim] float32 (may be a strided view of a wider product).
        weight: [head_dim] float32, shared by every head.
        eps: the epsilon added to the mean square.
        kernels: the fused row kernels (their RMSNorm equals `F.rms_norm` bit for bit), or None for torch.
    Returns:
        [num_tokens, num_heads, head_dim], a new tensor.
    """
    if kernels is None:
        return F.rms_norm(x, weight.shape, weight, eps)
    head_dim = x.shape[-1]
    return kernels.rms_norm(x.reshape(-1, head_dim).contiguous(), weight, eps).view(x.shape)
