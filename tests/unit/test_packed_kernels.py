"""The kernels behind `linear` (`model/kernels/fp32.py`: MKL's packed GEMM, oneDNN, `x @ W`; `model/kernels/int8.py`:
oneDNN int8, `torch._int_mm`): each gives the values of the plain product it replaces, on random products and on a
whole (tiny, dummy) model."""

from __future__ import annotations

import copy
import json
import threading

import pytest
import torch

from asyncllm.config import ModelConfig
from asyncllm.model.kernels import fp32 as packed_fp32
from asyncllm.model.kernels.choice import KernelChooser
from asyncllm.model.kernels.fp32 import (
    FP32_PRODUCT,
    PackedFp32Weight,
    onednn_fp32_available,
    pack_fp32,
)
from asyncllm.model.kernels.int8 import INT8_PRODUCT, Int8Weight, onednn_int8_available, quantize_int8
from asyncllm.model.kernels.linear import linear
from asyncllm.model.kernels.row_padding import bucket_rows, row_pieces, run_in_row_pieces
from asyncllm.model.kernels.row_quant import quantize_rows
from asyncllm.model.loading.loader import load_model
from tests.kernel_checks import force_or_refused, require_mkl_packed
from tests.unit.test_quant import TINY_LLAMA, _logits

pytestmark = pytest.mark.skipif(
    not (onednn_fp32_available() and onednn_int8_available()), reason="this torch build has no oneDNN kernels"
)


@pytest.fixture(params=[candidate.name for candidate in FP32_PRODUCT.candidates])
def fp32_chooser(request, tmp_path) -> KernelChooser[torch.Tensor]:  # type: ignore[no-untyped-def]
    """A chooser that runs every product on one fp32 kernel, each in turn (this CI's torch has all three)."""
    if request.param == "mkl_packed":
        require_mkl_packed()  # fails under CI where the kernels do not build (kernel_checks.py)
    return KernelChooser(FP32_PRODUCT, forced=request.param, cache_dir=tmp_path)


@pytest.mark.parametrize("rows", [1, 2, 5, 33, 300, 600, 1100])
def test_packed_fp32_linear_equals_the_plain_product(rows: int, fp32_chooser: KernelChooser[torch.Tensor]) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(96, 200, generator=gen)
    weight = pack_fp32(w, fp32_chooser)
    assert weight.choice.kernel_for(rows) == fp32_chooser.forced
    out = linear(x, weight)
    if fp32_chooser.forced == "matmul":
        assert torch.equal(out, x @ w)
        assert weight.operands["matmul"] is weight.weight  # no second copy
    else:
        torch.testing.assert_close(out, x @ w, rtol=1e-5, atol=1e-4)
        assert out.abs().max() > 1.0  # a real product, not zeros


@pytest.mark.parametrize(("pack_threads", "run_threads"), [(1, 2), (2, 1)])
@pytest.mark.parametrize("chunk_threads", [1, 2, 3])
def test_mkl_pack_serves_any_thread_count(pack_threads: int, run_threads: int, chunk_threads: int) -> None:
    """The thread policy (`worker/thread_policy.py`) switches torch's threads after the weights were packed; the
    chunks run on torch's threads (torch at >= chunk_threads), on the pool (fewer) or on the caller (1)."""
    kernels = require_mkl_packed()
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 576, generator=gen), torch.randn(576, 1000, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(pack_threads)
        packed = kernels.sgemm_pack(w, 144)  # 7 chunks of 144 columns, then one of 136
        torch.set_num_threads(run_threads)
        alone = kernels.sgemm_packed(x, packed, 1000, 1)
        torch.testing.assert_close(alone, x @ w, rtol=1e-5, atol=1e-4)
        for _ in range(20):  # the pool's helpers are reused product after product
            assert torch.equal(kernels.sgemm_packed(x, packed, 1000, chunk_threads), alone)  # one MKL thread per chunk
    finally:
        torch.set_num_threads(threads)


def test_mkl_products_on_two_python_threads_at_once() -> None:
    """Two engines in one process may multiply at once (the GIL is released): one takes the pool, the other runs
    its chunks itself; both get their own right values."""
    kernels = require_mkl_packed()
    gen = torch.Generator().manual_seed(4)
    weights = [torch.randn(256, 900, generator=gen) for _ in range(2)]
    packs = [kernels.sgemm_pack(w, 64) for w in weights]
    inputs = [torch.randn(24, 256, generator=gen) for _ in range(2)]
    threads = torch.get_num_threads()
    errors: list[float] = []

    def multiply(i: int) -> None:
        for _ in range(200):
            out = kernels.sgemm_packed(inputs[i], packs[i], 900, 2)
            errors.append(float((out - inputs[i] @ weights[i]).abs().max()))

    try:
        torch.set_num_threads(1)  # the pool path
        workers = [threading.Thread(target=multiply, args=(i,)) for i in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        torch.set_num_threads(threads)
    assert len(errors) == 400
    assert max(errors) < 1e-3


def test_mkl_chunks_and_gemm_threads() -> None:
    assert [packed_fp32.chunk_columns(n) for n in (1, 48, 576, 960, 3072, 49152)] == [16, 16, 144, 240, 768, 4096]
    try:
        packed_fp32.set_gemm_threads(3)
        assert packed_fp32.gemm_threads() == 3
        packed_fp32.set_gemm_threads(None)
        assert packed_fp32.gemm_threads() == torch.get_num_threads()
        with pytest.raises(ValueError, match="at least 1 thread"):
            packed_fp32.set_gemm_threads(0)
    finally:
        packed_fp32.set_gemm_threads(None)


def test_mkl_pack_refuses_a_product_of_another_shape() -> None:
    kernels = require_mkl_packed()
    packed = kernels.sgemm_pack(torch.randn(64, 48), 16)
    with pytest.raises(RuntimeError, match=r"holds a \[64, 48\] weight, not \[63, 48\]"):
        kernels.sgemm_packed(torch.randn(3, 63), packed, 48, 2)
    with pytest.raises(RuntimeError, match=r"not \[64, 47\]"):
        kernels.sgemm_packed(torch.randn(3, 64), packed, 47, 2)
    with pytest.raises(RuntimeError, match="made by sgemm_pack"):
        kernels.sgemm_packed(torch.randn(3, 64), torch.zeros(10, dtype=torch.uint8), 48, 2)
    with pytest.raises(RuntimeError, match="made by sgemm_pack"):
        kernels.sgemm_packed(torch.randn(3, 64), packed[:200].clone(), 48, 2)  # cut short
    with pytest.raises(RuntimeError, match="num_threads"):
        kernels.sgemm_packed(torch.randn(3, 64), packed, 48, 0)
    with pytest.raises(RuntimeError, match="chunk_cols"):
        kernels.sgemm_pack(torch.randn(64, 48), 0)
    assert kernels.sgemm_packed(torch.randn(0, 64), packed, 48, 2).shape == (0, 48)


def test_a_copied_mkl_weight_is_packed_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """MKL's packed data must not move: a deep copy (tests copy a shared model) packs its own."""
    require_mkl_packed()
    chooser = KernelChooser(FP32_PRODUCT, forced="mkl_packed", cache_dir=tmp_path)
    weight = pack_fp32(torch.randn(96, 200, generator=torch.Generator().manual_seed(5)), chooser)
    copied = copy.deepcopy(weight)
    assert copied.operands["mkl_packed"][0].data_ptr() != weight.operands["mkl_packed"][0].data_ptr()
    x = torch.randn(7, 96)
    assert torch.equal(linear(x, copied), linear(x, weight))


def test_pack_fp32_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="2-D float32"):
        pack_fp32(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D float32"):
        pack_fp32(torch.zeros(4))


@pytest.mark.parametrize("rows", [1, 7, 40, 70, 600, 1100])
def test_every_int8_kernel_gives_the_same_values(rows: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Exact int32 sums scaled in the same order on every int8 kernel: the kernel a row class runs never changes
    a value (so batch composition cannot either)."""
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 128, generator=gen) * 3, torch.randn(128, 72, generator=gen)
    qx, x_scale = quantize_rows(x)
    plain = quantize_int8(w, KernelChooser(INT8_PRODUCT, forced="int_mm", cache_dir=tmp_path))
    reference = (qx.double() @ plain.qweight.double()).float() * plain.scale * x_scale
    assert torch.equal(linear(x, plain), reference)
    exact = []
    for candidate in INT8_PRODUCT.candidates:
        chooser = force_or_refused(INT8_PRODUCT, candidate.name, tmp_path, tuple(w.shape))
        if chooser is None:  # refused by its start-up check on this host: it never runs here
            continue
        weight = quantize_int8(w, chooser)
        assert weight.choice is not None
        assert weight.choice.kernel_for(rows) == candidate.name
        assert torch.equal(linear(x, weight), reference), candidate.name
        exact.append(candidate.name)
    assert "int_mm" in exact
    assert torch.equal(linear(x, Int8Weight(plain.qweight, plain.scale)), reference)  # no choice: torch._int_mm


def test_packed_model_gives_the_plain_models_logits(tmp_path, fp32_chooser) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = ModelConfig("tiny", str(tmp_path), load_format="dummy")
    plain = load_model(config)
    packed = load_model(
        ModelConfig("tiny", str(tmp_path), load_format="dummy", linear_kernels={"fp32": fp32_chooser.forced}),
        pack_weights=True,
    )
    assert isinstance(packed.lm_head, PackedFp32Weight)
    assert set(packed.lm_head.choice.kernels) == {fp32_chooser.forced}
    assert all(isinstance(layer.gate_up_proj, PackedFp32Weight) for layer in packed.layers)
    chunks = [[[5, 9, 200, 31], [7, 1]], [[3], [8]]]  # a prefill step with two sequences, then two decode rows
    reference = _logits(plain, chunks)
    assert reference.abs().max() > 0.1  # the dummy weights give logits that are not all zero
    torch.testing.assert_close(_logits(packed, chunks), reference, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="already converted"):
        packed.pack_fp32()


def test_products_run_at_few_row_counts_with_little_padding() -> None:
    assert [bucket_rows(r) for r in (1, 2, 8, 9, 64, 65, 75, 256, 257, 512, 513, 1024)] == [
        *(1, 2, 8, 16, 64, 80, 80, 256, 288, 512, 576, 1024)
    ]
    # 64 prefix-cached prompt tokens beside 11 decodes: the fp32 step took 244-251 ms at 128 rows, 187-216 at 80
    assert row_pieces(75) == [(75, 80)]
    assert row_pieces(576) == [(576, 576)]  # a 576-token prefill ran at 1,024 rows, ~1.9x the time
    assert row_pieces(600) == [(600, 640)]
    assert row_pieces(2048) == [(2048, 2048)]
    assert row_pieces(2100) == [(2048, 2048), (52, 56)]
    counts: set[int] = set()
    for rows in range(1, 8193):
        pieces = row_pieces(rows)
        assert sum(real for real, _ in pieces) == rows
        padding = sum(padded for _, padded in pieces) - rows
        assert padding <= (15 if rows % 1024 <= 256 else 31 if rows % 1024 <= 512 else 63)
        counts.update(padded for _, padded in pieces)
    assert len(counts) == 8 + 7 + 12 + 8 + 8 + 7  # oneDNN kernels per weight shape
    with pytest.raises(ValueError, match="at least 1 row"):
        row_pieces(0)


def test_a_product_in_pieces_runs_once_per_piece_in_row_order() -> None:
    x = torch.arange(1100 * 3, dtype=torch.float32).reshape(1100, 3)
    seen: list[int] = []

    def product(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return rows[:, :2] * 2

    assert torch.equal(run_in_row_pieces(x, product), x[:, :2] * 2)
    assert seen == [1024, 80]  # the last 76 rows padded to 80
    assert run_in_row_pieces(x[:0], product).shape == (0, 2)  # no rows: one call on the empty input, as before
    assert seen[-1] == 0
