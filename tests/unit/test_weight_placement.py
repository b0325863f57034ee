"""Weights moved onto huge pages after loading (`model/loading/weight_placement.py`, `utils/huge_pages.py`): the
same values from the moved tensors, every holder following the move, MKL's packed data left where it is."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from asyncllm.config import ModelConfig
from asyncllm.model.kernels.fp32 import PackedFp32Weight, fp32_chooser, onednn_fp32_available
from asyncllm.model.kernels.int8 import Int8Weight, int8_chooser
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.llama_weights import LINEAR_WEIGHTS
from asyncllm.model.loading import weight_placement
from asyncllm.model.loading.loader import load_model
from asyncllm.utils import huge_pages
from tests.integration.test_kv_cache_memory import _smaps_fields
from tests.model_weights import randomize_matrices
from tests.unit.test_quant import TINY_LLAMA


def _tiny(tmp_path: pathlib.Path, mode: str) -> Any:
    """A 2-layer random Llama: "fp32" packed for the float32 kernels chosen here, "fp32-onednn" on oneDNN's reordered
    (opaque) weights, "int8" on the int8 kernels chosen here, "q8_0" in blocks."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    model = load_model(ModelConfig("tiny", str(tmp_path), load_format="dummy"))
    randomize_matrices(model)
    if mode == "fp32":
        model.pack_fp32()
    elif mode == "fp32-onednn":
        if not onednn_fp32_available():
            pytest.skip("this torch build has no oneDNN")
        model.pack_fp32(fp32_chooser("onednn"))
    elif mode == "int8":
        model.quantize_int8(list(range(3, 99)), int8_chooser())
    else:
        model.quantize_blocks(mode)
    return model


def _logits(model: Any) -> torch.Tensor:
    arch = model.arch
    caches = [torch.zeros(4, 2, 8, arch.num_key_value_heads, arch.head_dim) for _ in model.layers]
    meta = build_attention_metadata([5, 1], [5, 9], [[0], [1, 2]], 8)
    with torch.inference_mode():
        hidden = model(torch.tensor([5, 300, 77, 8, 41, 9]), torch.tensor([0, 1, 2, 3, 4, 8]), caches, meta)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("mode", ["fp32", "fp32-onednn", "int8", "q8_0"])
def test_moved_weights_give_the_same_logits_from_one_advised_private_mapping(
    tmp_path: pathlib.Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weight_placement, "transparent_huge_pages_granted", lambda: True)  # move on any host
    model = _tiny(tmp_path, mode)
    before = _logits(model)
    tensors = weight_placement.movable_tensors(model)
    assert tensors
    old = [t.data_ptr() for t in tensors]
    moving = {id(t) for t in tensors}
    operands = [op for w in _linear_weights(model, PackedFp32Weight) for op in w.operands.values()]
    # MKL's packed copies (oneDNN's reordered weights are opaque tensors without a data pointer: they stay too)
    packed = [t for op in operands for t in _tensors(op) if id(t) not in moving and t.layout == torch.strided]
    packed_ptrs = [t.data_ptr() for t in packed]
    moved = weight_placement.move_weights_to_huge_pages(model)
    assert moved >= sum(t.nbytes for t in tensors)
    assert all(t.data_ptr() != p for t, p in zip(tensors, old, strict=True))
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one mapping
    flags = _smaps_fields(tensors[0].data_ptr())["VmFlags:"]
    assert "hg" in flags
    assert "sh" not in flags
    assert [t.data_ptr() for t in packed] == packed_ptrs  # MKL's packed data stays
    assert torch.equal(_logits(model), before)  # the same bits, through every holder of the moved tensors


def test_int8_weights_move_with_their_packed_copies(tmp_path: pathlib.Path) -> None:
    model = _tiny(tmp_path, "int8")
    tensors = {id(t) for t in weight_placement.movable_tensors(model)}
    for weight in _linear_weights(model, Int8Weight):
        assert id(weight.qweight) in tensors
        for name in weight_placement.MOVABLE_INT8_OPERANDS:
            if name in weight.operands:
                assert id(weight.operands[name][0]) in tensors  # the kernel's packed copy


def test_nothing_moves_where_the_host_grants_no_huge_pages(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weight_placement, "transparent_huge_pages_granted", lambda: False)
    model = _tiny(tmp_path, "q8_0")
    pointers = [t.data_ptr() for t in weight_placement.movable_tensors(model)]
    assert weight_placement.move_weights_to_huge_pages(model) == 0
    assert [t.data_ptr() for t in weight_placement.movable_tensors(model)] == pointers


@pytest.mark.parametrize(
    ("text", "granted"),
    [("always [madvise] never\n", True), ("[always] madvise never\n", True), ("always madvise [never]\n", False)],
)
def test_the_thp_setting_is_read_from_its_file(tmp_path: pathlib.Path, text: str, granted: bool) -> None:
    setting = tmp_path / "enabled"
    setting.write_text(text)
    assert huge_pages.transparent_huge_pages_granted(setting) is granted
    assert not huge_pages.transparent_huge_pages_granted(tmp_path / "missing")


def test_huge_page_bytes_are_zero_aligned_and_private() -> None:
    block = huge_pages.huge_page_bytes(3 << 20, align=huge_pages.HUGE_PAGE_BYTES)
    assert block.numel() == 3 << 20
    assert block.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert int(torch.count_nonzero(block)) == 0
    assert "sh" not in _smaps_fields(block.data_ptr())["VmFlags:"]
    with pytest.raises(ValueError, match="nbytes >= 1"):
        huge_pages.huge_page_bytes(0)


def _linear_weights(model: Any, kind: type) -> list[Any]:
    found = [getattr(layer, name) for layer in model.layers for name in LINEAR_WEIGHTS] + [model.lm_head]
    return [w for w in found if isinstance(w, kind)]


def _tensors(operand: Any) -> list[torch.Tensor]:
    items = operand if isinstance(operand, tuple) else (operand,)
    return [t for t in items if isinstance(t, torch.Tensor)]
