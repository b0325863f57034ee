"""The oneDNN kernels behind `linear` (`model/packed_fp32.py`, `model/quant.py`): each gives the values of the
plain product it replaces, on random products and on a whole (tiny, dummy) model."""

from __future__ import annotations

import json

import pytest
import torch

from asyncllm.config import ModelConfig
from asyncllm.model.loader import load_model
from asyncllm.model.packed_fp32 import (
    MIN_PACKED_ROWS,
    PackedFp32Weight,
    bucket_rows,
    onednn_fp32_available,
    pack_fp32,
)
from asyncllm.model.quant import Int8Weight, linear, onednn_int8_available, quantize_int8, quantize_rows
from tests.unit.test_quant import TINY_LLAMA, _logits

pytestmark = pytest.mark.skipif(
    not (onednn_fp32_available() and onednn_int8_available()), reason="this torch build has no oneDNN kernels"
)


@pytest.mark.parametrize("rows", [1, 2, 5, 33])
def test_packed_fp32_linear_equals_the_plain_product(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(96, 200, generator=gen)
    out = linear(x, pack_fp32(w))
    if rows < MIN_PACKED_ROWS:
        assert torch.equal(out, x @ w)  # few rows run the plain weight
    else:
        torch.testing.assert_close(out, x @ w, rtol=1e-5, atol=1e-4)


def test_pack_fp32_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="2-D float32"):
        pack_fp32(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D float32"):
        pack_fp32(torch.zeros(4))


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_onednn_int8_equals_int_mm(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 128, generator=gen) * 3, torch.randn(128, 72, generator=gen)
    packed = quantize_int8(w)
    assert packed.packed is not None
    qx, x_scale = quantize_rows(x)
    reference = torch._int_mm(qx, packed.qweight).float() * x_scale * packed.scale
    torch.testing.assert_close(linear(x, packed), reference, rtol=1e-6, atol=1e-5)
    plain = linear(x, Int8Weight(packed.qweight, packed.scale))  # the fallback path without oneDNN
    torch.testing.assert_close(plain, reference, rtol=1e-6, atol=1e-5)
    assert torch.equal(plain, linear(x, packed))  # exact int32 sums, scaled in the same order on both paths


def test_packed_model_gives_the_plain_models_logits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = ModelConfig("tiny", str(tmp_path), load_format="dummy")
    plain, packed = load_model(config), load_model(config, pack_weights=True)
    assert isinstance(packed.lm_head, PackedFp32Weight)
    assert all(isinstance(layer.gate_up_proj, PackedFp32Weight) for layer in packed.layers)
    chunks = [[[5, 9, 200, 31], [7, 1]], [[3], [8]]]  # a prefill step with two sequences, then two decode rows
    reference = _logits(plain, chunks)
    assert reference.abs().max() > 0.1  # the dummy weights give logits that are not all zero
    torch.testing.assert_close(_logits(packed, chunks), reference, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="already converted"):
        packed.pack_fp32()


def test_rows_are_padded_to_few_sizes() -> None:
    assert [bucket_rows(r) for r in (1, 2, 8, 9, 64, 65, 512, 513, 2000)] == [1, 2, 8, 16, 64, 128, 512, 1024, 2048]
    assert len({bucket_rows(r) for r in range(1, 8193)}) == 8 + 7 + 7 + 15  # oneDNN kernels per weight shape
