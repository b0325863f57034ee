"""The int8 decode stack (`model/decode_stack.py`, `Int8DecodeStack` in `csrc/row_kernels.cpp`) on a tiny random
Qwen2 (q/k/v biases): a decode-only step in one call equals the per-layer calls (`_forward_fused_int8`) bit for
bit, on each kernel the stack calls; a row class whose kernel it cannot call keeps the per-layer calls."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import pytest
import torch

from asyncllm.config import ModelConfig
from asyncllm.model import llama
from asyncllm.model.kernels.choice import ROW_CLASSES, row_class
from asyncllm.model.kernels.int8 import Int8Weight, int8_chooser
from asyncllm.model.kernels.row_kernels import RowKernels
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.llama_weights import LINEAR_WEIGHTS
from asyncllm.model.loading.loader import load_model
from tests.kernel_checks import require_kernels
from tests.model_weights import randomize_matrices
from tests.unit.test_quant import TINY_LLAMA

CALIBRATION_IDS = list(range(3, 99))
SEQ_LENS = {1: [29], 3: [13, 29, 21]}  # tokens per sequence (with this step's) by decode rows


@pytest.fixture(scope="module")
def kernels() -> RowKernels:
    return require_kernels()


def _available(kernels: RowKernels, name: str) -> bool:
    return kernels.int8_vnni_available() if name == "vnni" else kernels.int8_avx2_available()


def _tiny_int8_qwen2(tmp_path: pathlib.Path, kernel: str) -> llama.LlamaForCausalLM:
    """2 layers, random weights and q/k/v biases, int8 on `kernel` for every row count."""
    config = {**TINY_LLAMA, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(ModelConfig("tiny", str(tmp_path), load_format="dummy"))
    assert isinstance(model, llama.LlamaForCausalLM)
    randomize_matrices(model)
    gen = torch.Generator().manual_seed(2)
    for layer in model.layers:
        assert layer.qkv_bias is not None
        layer.qkv_bias.copy_(torch.randn(layer.qkv_bias.shape, generator=gen))
    model.quantize_int8(CALIBRATION_IDS, int8_chooser(kernel))
    return model


def _decode(model: llama.LlamaForCausalLM, caches: list[torch.Tensor], rows: int) -> torch.Tensor:
    """Final hidden states of one decode step of `rows` sequences (`SEQ_LENS`), sequence i in blocks 4i..4i+3."""
    seq_lens = SEQ_LENS[rows]
    meta = build_attention_metadata([1] * rows, seq_lens, [list(range(4 * i, 4 * i + 4)) for i in range(rows)], 8)
    with torch.inference_mode():
        return model(torch.tensor([5, 300, 77][:rows]), torch.tensor(seq_lens) - 1, caches, meta)


def _random_caches(model: llama.LlamaForCausalLM, dtype: torch.dtype) -> list[torch.Tensor]:
    arch, gen = model.arch, torch.Generator().manual_seed(4)
    shape = (12, 2, 8, arch.num_key_value_heads, arch.head_dim)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in model.layers]


@pytest.mark.parametrize("kernel", ["vnni", "avx2"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_an_int8_decode_step_in_one_stack_call_equals_the_per_layer_calls_bit_for_bit(
    tmp_path: pathlib.Path, kernels: RowKernels, kernel: str, kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 and 3 sequences, full attention and a sliding window, 1 and 2 threads: the stack's hidden states and KV
    caches equal the per-layer calls' bit for bit, and the per-layer calls do not run."""
    if not _available(kernels, kernel):
        pytest.skip(f"this CPU or build has no {kernel} int8 product")
    model = _tiny_int8_qwen2(tmp_path, kernel)
    calls: list[int] = []
    per_layer = llama.LlamaDecoderLayer._forward_fused_int8
    monkeypatch.setattr(llama.LlamaDecoderLayer, "_forward_fused_int8", lambda *a: calls.append(1) or per_layer(*a))
    base = _random_caches(model, kv_dtype)
    threads = torch.get_num_threads()
    try:
        for window in (None, 11):
            for layer in model.layers:
                monkeypatch.setattr(layer, "window", window)
            monkeypatch.setattr(model, "_decode_stacks", llama.DecodeStacks())  # built again with the windows
            for rows in SEQ_LENS:
                model.fuse_decode_layers = False
                want_caches = [c.clone() for c in base]
                want = _decode(model, want_caches, rows)
                assert len(calls) == len(model.layers)
                calls.clear()
                model.fuse_decode_layers = True
                for num_threads in (1, 2):
                    torch.set_num_threads(num_threads)
                    caches = [c.clone() for c in base]
                    got = _decode(model, caches, rows)
                    assert model._decode_stacks.last is not None  # the stack ran...
                    assert not calls  # ...alone
                    assert torch.equal(got, want), (window, rows, num_threads)
                    assert all(torch.equal(c, w) for c, w in zip(caches, want_caches, strict=True))
                    assert not all(torch.equal(c, b) for c, b in zip(caches, base, strict=True))  # K/V written
    finally:
        torch.set_num_threads(threads)


def test_a_row_class_on_a_kernel_the_stack_cannot_call_keeps_the_per_layer_calls(
    tmp_path: pathlib.Path, kernels: RowKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Choices naming a C++ kernel for 1 row and `torch._int_mm` for every other class: a 1-row decode step runs
    the stack, a 3-row one the per-layer calls (one stack was built per row class, and the second is None)."""
    kernel = next((name for name in ("vnni", "avx2") if _available(kernels, name)), None)
    if kernel is None:
        pytest.skip("this CPU or build has neither int8 product the stack calls")
    model = _tiny_int8_qwen2(tmp_path, kernel)
    for layer in model.layers:
        for name in LINEAR_WEIGHTS:
            weight = getattr(layer, name)
            assert isinstance(weight, Int8Weight)
            assert weight.choice is not None
            per_class = tuple(kernel if first == 1 else "int_mm" for first, _ in ROW_CLASSES)
            weight.choice = dataclasses.replace(weight.choice, kernels=per_class)
            weight.operands["int_mm"] = weight
    calls: list[Any] = []
    per_layer = llama.LlamaDecoderLayer._forward_fused_int8
    monkeypatch.setattr(llama.LlamaDecoderLayer, "_forward_fused_int8", lambda *a: calls.append(1) or per_layer(*a))
    caches = _random_caches(model, torch.float32)
    _decode(model, caches, 1)
    assert model._decode_stacks.last is not None
    assert not calls
    _decode(model, caches, 3)
    assert model._decode_stacks.last is None
    assert len(calls) == len(model.layers)
    assert row_class(1) != row_class(3)
