"""Test helper: re-initialise a loaded model's matrices so a random-weight model behaves like a language model."""

from __future__ import annotations

import math

import torch
from torch import nn

from asyncllm.model.kernels.fp32 import PackedFp32Weight, pack_fp32


@torch.no_grad()
def randomize_matrices(model: nn.Module, seed: int = 0) -> None:
    """N(0, 1/fan) for every matrix of `model`, in place: the loader's dummy N(0, 0.02) leaves attention so weak
    that the model just repeats its input token, which would hide cache and batching bugs. Weights the worker
    keeps in both float32 layouts (`PackedFp32Weight`, not `nn.Parameter`s) are drawn the same way and
    re-packed, so the kernel that runs sees the new values."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PackedFp32Weight):
                weight = value.weight.normal_(0.0, 1 / math.sqrt(min(value.shape)), generator=generator)
                setattr(module, name, pack_fp32(weight))
        for param in module.parameters(recurse=False):
            if param.dim() == 2:
                param.normal_(0.0, 1 / math.sqrt(min(param.shape)), generator=generator)
