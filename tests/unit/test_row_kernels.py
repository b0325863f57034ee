"""The fused row kernels (`model/kernels/row_kernels.py`): built here, equal to the eager ops they replace bit for
bit over many shapes, rows independent of their batch, bad inputs rejected, the switch honoured, and fp32, int8 and
Qwen2-style (q/k/v bias) models giving the same logits with and without them."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import time
import types
from typing import cast

import pytest
import torch
import torch.nn.functional as F

from asyncllm.model.kernels import row_kernels
from asyncllm.model.kernels.attention_checks import decode_attention_reference
from asyncllm.model.kernels.rotary import apply_rotary
from asyncllm.model.kernels.row_kernels import RowKernels, load_kernels
from asyncllm.model.kernels.row_quant import quantize_rows
from asyncllm.model.layers import attention
from asyncllm.model.layers.attention import write_kv_cache
from asyncllm.model.layers.rotary import rotary_cos_sin
from tests.kernel_checks import require_kernels
from tests.unit.test_quant import _logits, _tiny_model


@pytest.fixture(scope="module")
def kernels() -> RowKernels:
    """Built here; where they cannot be, every test of this module fails under CI (`tests/kernel_checks.py`)."""
    return require_kernels()


def test_the_kernels_build_here(kernels: RowKernels) -> None:
    """The check the issue asked for: a machine that should build them and does not fails CI, never skips."""
    assert load_kernels() is kernels
    assert set(row_kernels.KERNELS) <= set(vars(kernels))


def test_ninja_is_found_beside_the_interpreter_when_not_on_path(
    kernels: RowKernels, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pip install ninja` (an asyncllm dependency) puts ninja in the interpreter's scripts directory, which is not
    on PATH when `.venv/bin/python` runs without an activated venv (`make test`, `make run`): the build finds it
    there. PATH keeps every other program (the compiler) through a directory of links without ninja."""
    entries = []
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        directory = pathlib.Path(entry or ".")
        if (directory / "ninja").exists():  # replaced by links to all of it but ninja
            links = tmp_path / f"bin{len(entries)}"
            links.mkdir()
            for program in directory.iterdir():
                if program.name != "ninja":
                    (links / program.name).symlink_to(program)
            entry = str(links)
        entries.append(entry)
    monkeypatch.setenv("PATH", os.pathsep.join(entries))
    assert shutil.which("ninja") is None
    load_kernels.cache_clear()
    try:
        assert load_kernels() is not None
        assert os.environ["PATH"] == os.pathsep.join(entries)  # the build's PATH is put back
    finally:
        monkeypatch.undo()
        load_kernels.cache_clear()
    assert load_kernels() is not None


def _rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, rows).unsqueeze(1)  # 1e-3 .. 1e3 per row
    x[rows // 2] = 0.0
    return x


@pytest.mark.parametrize("cols", [6, 70, 576, 1536, 2048, 4099])
@pytest.mark.parametrize("rows", [1, 5, 64, 257])
def test_kernels_equal_the_eager_ops_bit_for_bit(kernels: RowKernels, rows: int, cols: int) -> None:
    torch.set_num_threads(2)  # 64 and 257 rows of the wider shapes run on both threads
    x = _rows(rows, cols, seed=rows * cols)
    weight = torch.rand(cols, generator=torch.Generator().manual_seed(cols)) + 0.5
    q, scale = kernels.quantize_rows(x)
    q_ref, scale_ref = quantize_rows(x)
    assert torch.equal(q, q_ref)
    assert torch.equal(scale, scale_ref)
    assert torch.all(q[rows // 2] == 0)

    q, scale = kernels.rms_norm_quantize(x, weight, 1e-6)
    q_ref, scale_ref = quantize_rows(F.rms_norm(x, (cols,), weight, 1e-6))
    assert torch.equal(q, q_ref)
    assert torch.equal(scale, scale_ref)

    normed = F.rms_norm(x, (cols,), weight, 1e-6)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), normed)

    residual = _rows(rows, cols, seed=1)
    assert torch.equal(kernels.add_scaled_(residual, x.clone(), scale_ref), residual + x * scale_ref)

    if cols % 2 == 0:
        assert torch.equal(kernels.silu_mul(x), F.silu(x[:, : cols // 2]) * x[:, cols // 2 :])
        gate, up = (x * scale_ref).chunk(2, dim=-1)
        q, scale = kernels.silu_mul_quantize(x, scale_ref)
        q_ref, scale_ref = quantize_rows(F.silu(gate) * up)
        assert torch.equal(q, q_ref)
        assert torch.equal(scale, scale_ref)


@pytest.mark.parametrize(("head_dim", "heads", "extra"), [(64, 12, 192), (48, 3, 0), (6, 5, 6), (128, 2, 128)])
@pytest.mark.parametrize("with_scale", [False, True])
def test_scale_bias_rotate_equals_the_eager_ops(
    kernels: RowKernels, head_dim: int, heads: int, extra: int, with_scale: bool
) -> None:
    rows, cols = 37, heads * head_dim + extra  # `extra` columns (V) are scaled and biased but not rotated
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(rows, cols, generator=gen) * 30
    scale = torch.rand(rows, 1, generator=gen) if with_scale else None
    bias = torch.randn(cols, generator=gen)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    cos, sin = (
        t[positions].unsqueeze(1) for t in rotary_cos_sin(10000.0 ** -(torch.arange(0, head_dim, 2) / head_dim), 4096)
    )
    want = (qkv * scale if scale is not None else qkv) + bias
    rotated = heads * head_dim
    want[:, :rotated] = apply_rotary(want[:, :rotated].view(rows, heads, head_dim), cos, sin).flatten(1)
    got = qkv.clone()
    kernels.scale_bias_rotate_(got, scale, bias, cos, sin, rotated)
    assert torch.equal(got, want)
    got = qkv.clone()
    kernels.scale_bias_rotate_(got, None, None, cos, sin, rotated)
    assert torch.equal(got[:, rotated:], qkv[:, rotated:])
    assert torch.equal(
        got[:, :rotated], apply_rotary(qkv[:, :rotated].view(rows, heads, head_dim), cos, sin).flatten(1)
    )


def test_a_rows_result_does_not_depend_on_its_batch(kernels: RowKernels) -> None:
    x = _rows(40, 576, seed=3)
    weight = torch.rand(576) + 0.5
    q, scale = kernels.rms_norm_quantize(x, weight, 1e-5)
    for i in (0, 17, 39):
        alone = kernels.rms_norm_quantize(x[i : i + 1].clone(), weight, 1e-5)
        assert torch.equal(alone[0], q[i : i + 1])
        assert torch.equal(alone[1], scale[i : i + 1])


def test_bad_inputs_raise_instead_of_reading_wrong_memory(kernels: RowKernels) -> None:
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        kernels.quantize_rows(x.t())
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        kernels.quantize_rows(x.double())
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm_quantize(x, torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="row_scale"):
        kernels.silu_mul_quantize(x, torch.ones(3, 1))
    with pytest.raises(RuntimeError, match="one shape"):
        kernels.add_scaled_(x, torch.randn(4, 32), torch.ones(4, 1))
    with pytest.raises(RuntimeError, match="whole heads"):
        kernels.scale_bias_rotate_(x, None, None, torch.ones(4, 1, 8), torch.ones(4, 1, 8), 12)
    with pytest.raises(RuntimeError, match="cos and sin"):
        kernels.scale_bias_rotate_(x, None, None, torch.ones(3, 1, 8), torch.ones(3, 1, 8), 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim", "block_size"), [(3, 64, 16), (1, 2, 1), (8, 128, 4)])
def test_kv_stores_equal_torchs_indexed_writes(
    kernels: RowKernels, heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    rows, width = 7, heads * head_dim
    qkv = _rows(rows, 3 * width + 5, seed=4)  # key and value are strided views of a wider product, as in the model
    key = qkv[:, width : 2 * width].view(rows, heads, head_dim)
    value = qkv[:, 2 * width : 3 * width].view(rows, heads, head_dim)
    slots = torch.tensor([0, 5, 6, 13, 2, 31, 17]) % (8 * block_size)
    got = torch.randn(8, 2, block_size, heads, head_dim).to(dtype)
    want, want_float32 = got.clone(), got.float()
    kernels.store_kv_cache_(got, key, value, slots // block_size, slots % block_size)
    write_kv_cache(want, key, value, slots)
    assert torch.equal(got, want)
    write_kv_cache(want_float32, key, value, slots)  # a float32 cache rounded afterwards: `.to(torch.bfloat16)`
    assert torch.equal(got, want_float32.to(dtype))
    positions = torch.tensor([0, 3, 1, 9, 9, 2, 4])
    got = torch.randn(2, rows, 10, heads, head_dim)
    want = got.clone()
    kernels.store_kv_rows_(got[0], got[1], key, value, positions)
    want[0][torch.arange(rows), positions], want[1][torch.arange(rows), positions] = key, value
    assert torch.equal(got, want)


def test_the_bfloat16_cache_store_rounds_to_nearest_even(kernels: RowKernels) -> None:
    """Ties between two bfloat16 values go to the even one (1 + 2**-8 -> 1, 1 + 3 * 2**-8 -> 1 + 2**-6), others
    to the nearest; infinities, zeros, subnormals and huge values as torch's `.to(torch.bfloat16)` gives them; NaN
    stays NaN (its payload bits differ: torch's vectorized conversion gives 0xFFFF, c10::BFloat16 0x7FC0)."""
    values = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.0e38, float("inf"), float("-inf"), -0.0]
    row = torch.tensor([*values, float("nan"), 0.0, 1e-40, 65504.0, -7.25, 2**-130, 123.456, 1.0])  # 16 values
    key = row.view(1, 1, 16)
    cache = torch.zeros(1, 2, 1, 1, 16, dtype=torch.bfloat16)
    kernels.store_kv_cache_(cache, key, -key, torch.tensor([0]), torch.tensor([0]))
    numbers = ~row.isnan()
    for got, want in ((cache[0, 0, 0, 0], row.to(torch.bfloat16)), (cache[0, 1, 0, 0], (-row).to(torch.bfloat16))):
        assert torch.equal(got[numbers].view(torch.int16), want[numbers].view(torch.int16))  # bit for bit
        assert got[~numbers].isnan().all()
    assert cache[0, 0, 0, 0, :2].float().tolist() == [1.0, 1 + 2**-6]


def test_kv_stores_reject_slots_outside_without_writing(kernels: RowKernels) -> None:
    cache = torch.zeros(4, 2, 16, 3, 64)
    key = value = torch.ones(2, 3, 64)
    with pytest.raises(IndexError, match="outside the KV cache"):
        kernels.store_kv_cache_(cache, key, value, torch.tensor([1, 4]), torch.tensor([0, 0]))
    with pytest.raises(IndexError, match="outside the KV cache"):
        kernels.store_kv_cache_(cache, key, value, torch.tensor([1, 1]), torch.tensor([0, -1]))
    assert not cache.any()  # rows are checked before any is written
    with pytest.raises(RuntimeError, match="key must be"):
        kernels.store_kv_cache_(cache, torch.ones(2, 3, 32), value, torch.tensor([1, 1]), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="blocks must be"):
        kernels.store_kv_cache_(cache, key, value, torch.tensor([1, 1], dtype=torch.int32), torch.tensor([0, 1]))
    mirror = torch.zeros(2, 2, 5, 3, 64)
    with pytest.raises(IndexError, match="outside the mirror"):
        kernels.store_kv_rows_(mirror[0], mirror[1], key, value, torch.tensor([4, 5]))
    with pytest.raises(RuntimeError, match="one shape"):
        kernels.store_kv_rows_(mirror[0], torch.zeros(2, 6, 3, 64), key, value, torch.tensor([0, 1]))
    assert not mirror.any()


def test_the_switch_turns_them_off(kernels: RowKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(row_kernels.ENV_SWITCH, "0")
    load_kernels.cache_clear()
    try:
        assert load_kernels() is None
    finally:
        monkeypatch.delenv(row_kernels.ENV_SWITCH)
        load_kernels.cache_clear()
    assert load_kernels() is not None


@pytest.mark.parametrize(("quantization", "qkv_bias"), [(None, False), ("int8", False), (None, True), ("int8", True)])
def test_models_give_the_same_logits_with_and_without_them(
    kernels: RowKernels, tmp_path, quantization: str | None, qkv_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    model = _tiny_model(tmp_path, quantization)
    if qkv_bias:  # Qwen2's q/k/v biases, through the kernel's bias add
        for layer in model.layers:
            layer.qkv_bias = torch.nn.Parameter(torch.randn(layer.q_size + 2 * layer.kv_size) / 4, requires_grad=False)
    assert model.fused_kernels is not None
    assert model.fused_kernels is load_kernels()  # one instance per process
    assert all(layer.fused_kernels is model.fused_kernels for layer in model.layers)
    chunks = [[[5, 9, 200, 31, 7, 7, 1], [7, 1, 3]], [[3], [8]], [[11], [12]]]  # a prefill of two, then decodes
    with_cache_attention = _logits(model, chunks)
    with monkeypatch.context() as patch:  # the row kernels alone: bit for bit
        patch.setattr(attention, "decode_reads_cache", lambda kernels, head_dim: False)
        patch.setattr(attention, "prefill_reads_cache", lambda kernels, group, head_dim: False)
        fused = _logits(model, chunks)
    for module in (model, *model.layers):
        module.fused_kernels = None
    eager = _logits(model, chunks)
    assert eager.abs().max() > 0.1  # the random weights give logits that are not all zero
    assert torch.equal(fused, eager)
    # decode and prefill attention read from the cache sum in another order than SDPA: equal within float32 rounding
    assert attention.decode_reads_cache(kernels, model.arch.head_dim)
    assert kernels.paged_prefill_attention_available()
    torch.testing.assert_close(with_cache_attention, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_bfloat16_cache_gives_logits_close_to_float32_with_and_without_the_kernels(
    kernels: RowKernels, tmp_path, quantization: str | None
) -> None:  # type: ignore[no-untyped-def]
    """Prefill of two sequences, then decodes, with a bfloat16 KV cache: the kernels (bf16 store, decode attention
    widening bf16 rows) against the torch ops (bf16 SDPA), and both against the float32 cache, within bfloat16's
    rounding of K/V: |diff| <= 5% of the largest logit (measured 0.3-0.4% with fp32 weights, 2.2% with int8, whose
    per-row activation quantization amplifies a small change)."""
    model = _tiny_model(tmp_path, quantization)
    chunks = [[[5, 9, 200, 31, 7, 7, 1], [7, 1, 3]], [[3], [8]], [[11], [12]]]
    float32 = _logits(model, chunks)
    bf16 = _logits(model, chunks, torch.bfloat16)
    for module in (model, *model.layers):
        module.fused_kernels = None
    bf16_eager = _logits(model, chunks, torch.bfloat16)
    scale = float(float32.abs().max())
    assert scale > 0.1
    for got in (bf16, bf16_eager):
        assert got.dtype == torch.float32
        assert float((got - float32).abs().max()) <= 0.05 * scale
    assert float((bf16 - bf16_eager).abs().max()) <= 0.05 * scale
    assert not torch.equal(bf16, float32)  # the cache really held bfloat16


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    lock = tmp_path / "lock"
    assert not row_kernels.remove_stale_lock(tmp_path)  # no lock: nothing to do
    lock.write_text("")
    assert not row_kernels.remove_stale_lock(tmp_path)  # a build in progress keeps its lock
    assert lock.exists()
    old = time.time() - row_kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert row_kernels.remove_stale_lock(tmp_path)  # left by a process that died mid-build
    assert not lock.exists()


def test_kernels_are_built_under_the_asyncllm_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    directory = row_kernels.build_directory("asyncllm_row_kernels_x")
    assert directory == tmp_path / "asyncllm" / "kernels" / "asyncllm_row_kernels_x"
    assert directory.is_dir()


def test_a_failed_build_falls_back_to_the_torch_ops(kernels, tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    broken = tmp_path / "row_kernels.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(row_kernels, "SOURCES", (broken,))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    load_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="asyncllm.model.kernels.row_kernels"):
            assert load_kernels() is None  # never raises
        assert "could not be built" in caplog.text
        assert "THE MODEL RUNS SLOWER" in caplog.text  # loud: says what it costs and how to fix it
        assert "C++ compiler" in caplog.text
    finally:
        monkeypatch.undo()
        load_kernels.cache_clear()
    assert load_kernels() is not None


def test_the_self_check_names_a_kernel_that_differs(kernels: RowKernels) -> None:
    wrong = types.SimpleNamespace(**{name: getattr(kernels, name) for name in row_kernels.KERNELS})
    wrong.rms_norm = lambda x, weight, eps: x.clone()  # forgets to normalize
    assert row_kernels.self_check(cast(RowKernels, wrong)).startswith("rms_norm differs from F.rms_norm")
    assert row_kernels.self_check(kernels) == ""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 256), (8, 8, 16), (2, 1, 128)])
@pytest.mark.parametrize("window", [0, 1, 20])
def test_decode_attention_reads_the_cache_like_gathered_sdpa(
    kernels: RowKernels, num_heads: int, num_kv_heads: int, head_dim: int, window: int, dtype: torch.dtype
) -> None:
    """GQA shapes of SmolLM2 (9/3 x 64), Gemma 3 270M (4/1 x 256), MHA and Llama-like heads; sequences of 1 token,
    a partial block, a whole block and a long one, through shuffled block tables; with and without a window; on a
    float32 and a bfloat16 cache (the reference widens it to float32 and runs float32 SDPA)."""
    gen = torch.Generator().manual_seed(head_dim + window)
    block_size, max_blocks = 16, 40
    kv_cache = torch.randn(170, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([1, 7, 16, 600])
    tables = torch.randperm(170, generator=gen)[: 4 * max_blocks].view(4, max_blocks).contiguous()
    query = torch.randn(4, num_heads, head_dim, generator=gen) * 3
    got = kernels.paged_decode_attention(query, kv_cache, tables, seq_lens, head_dim**-0.5, window)
    want = decode_attention_reference(query, kv_cache, tables, seq_lens, window)
    assert got.shape == (4, num_heads * head_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    solo = kernels.paged_decode_attention(query[3:], kv_cache, tables[3:], seq_lens[3:], head_dim**-0.5, window)
    assert torch.equal(solo, got[3:])  # a sequence's output does not depend on its batch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(
            kernels.paged_decode_attention(query, kv_cache, tables, seq_lens, head_dim**-0.5, window), got
        )
    finally:
        torch.set_num_threads(threads)
    if dtype == torch.bfloat16:  # widening in registers is exact: the same bits as the widened float32 cache
        widened = kernels.paged_decode_attention(query, kv_cache.float(), tables, seq_lens, head_dim**-0.5, window)
        assert torch.equal(got, widened)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_tiles_straddle_blocks_and_tasks_do_not_change_values(
    kernels: RowKernels, dtype: torch.dtype
) -> None:
    """The kernel walks 16-token tiles that need not start or end on a block (blocks of 5 tokens, windows starting
    mid-block) and gives a task a whole sequence when each thread gets >= 4 sequences, else one (sequence, K/V head):
    12 sequences at 1 and at 2 threads and each sequence alone take both ways; all give the same bits, within 1e-5
    of gathered SDPA."""
    gen = torch.Generator().manual_seed(5)
    block_size, num_seqs, max_blocks = 5, 12, 80
    kv_cache = torch.randn(400, 2, block_size, 3, 64, generator=gen).to(dtype)
    seq_lens = torch.tensor([1, 4, 5, 6, 15, 16, 17, 31, 33, 99, 250, 397])
    tables = torch.randint(0, 400, (num_seqs, max_blocks), generator=gen)  # shared blocks are fine to read
    query = torch.randn(num_seqs, 9, 64, generator=gen) * 3
    threads = torch.get_num_threads()
    try:
        for window in (0, 23):
            results = []
            for count in (1, 2):
                torch.set_num_threads(count)
                results.append(kernels.paged_decode_attention(query, kv_cache, tables, seq_lens, 0.125, window))
                solo = [
                    kernels.paged_decode_attention(
                        query[s : s + 1], kv_cache, tables[s : s + 1], seq_lens[s : s + 1], 0.125, window
                    )
                    for s in range(num_seqs)
                ]
                assert torch.equal(torch.cat(solo), results[-1])
            assert torch.equal(results[0], results[1])
            want = decode_attention_reference(query, kv_cache, tables, seq_lens, window)
            torch.testing.assert_close(results[0], want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_decode_attention_refuses_bad_tables_and_shapes(kernels: RowKernels) -> None:
    cache = torch.zeros(4, 2, 16, 1, 64)
    query = torch.zeros(1, 2, 64)
    with pytest.raises(IndexError, match="outside the KV cache"):
        kernels.paged_decode_attention(query, cache, torch.tensor([[4]]), torch.tensor([3]), 0.125, 0)
    with pytest.raises(IndexError, match="block table holds 16"):
        kernels.paged_decode_attention(query, cache, torch.tensor([[0]]), torch.tensor([17]), 0.125, 0)
    with pytest.raises(RuntimeError, match="multiple of the cache's K/V heads"):
        kernels.paged_decode_attention(
            torch.zeros(1, 3, 64), torch.zeros(4, 2, 16, 2, 64), torch.tensor([[0]]), torch.tensor([3]), 0.125, 0
        )
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.paged_decode_attention(query, cache.half(), torch.tensor([[0]]), torch.tensor([3]), 0.125, 0)
    with pytest.raises(RuntimeError, match="is not 1, 2, 4, 8"):
        kernels.paged_decode_attention(
            torch.zeros(1, 2, 24), torch.zeros(4, 2, 16, 1, 24), torch.tensor([[0]]), torch.tensor([3]), 0.125, 0
        )


def test_argmax_rows_gives_torch_max_indices_on_ties_nans_and_signed_zeros(kernels: RowKernels) -> None:
    """The argmax kernel (the sampler's token choice) gives `torch.max(dim=-1).indices` on the start-up check's rows
    and on a real vocabulary's width, at every row length around the vector width, at 1 and 2 threads; and the
    sampler's `argmax_rows` takes it."""
    from asyncllm.worker.sampler import argmax_rows

    gen = torch.Generator().manual_seed(5)
    x = row_kernels.argmax_check_rows(gen)
    assert x.max(dim=-1).indices[1] == 17  # the tie's first index, the first NaN: what the checks rely on
    assert x.max(dim=-1).indices[3] == 20
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for cols in (1, 2, 15, 16, 17, 31, 32, 33, 999, 1000):
                rows = x[:, :cols].contiguous()
                assert torch.equal(kernels.argmax_rows(rows), rows.max(dim=-1).indices), cols
            vocab = torch.randn(64, 49152, generator=gen)
            vocab[3, [7, 40000]] = 30.0
            assert torch.equal(kernels.argmax_rows(vocab), vocab.max(dim=-1).indices)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(argmax_rows(x), x.max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="at least one value"):
        kernels.argmax_rows(torch.zeros(2, 0))
