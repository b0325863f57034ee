"""The prefill attention kernel (`csrc/paged_prefill_attention.cpp`): reads the paged KV cache through the block
tables like gathered float64 SDPA with the causal (and sliding-window) mask, on the head shapes of the models asyncllm
runs, fresh chunks and chunks after a cached prefix, float32 and bfloat16 caches (a bfloat16 cache with bfloat16
products where the CPU has AVX512_BF16: within `BF16_DOT_TOLERANCE` of SDPA on the same rounded queries); a
sequence's rows do not depend on the batch or the thread count; rows outside the spans are left alone; bad inputs
raise."""

from __future__ import annotations

import pytest
import torch

from asyncllm.model.kernels.attention_checks import BF16_DOT_TOLERANCE, prefill_attention_reference
from asyncllm.model.kernels.row_kernels import RowKernels
from tests.kernel_checks import require_kernels

# (query tokens, tokens in the cache) per sequence: a fresh chunk of one token, a partial block, a chunk that
# straddles blocks after a cached prefix, a long fresh chunk, and one token after a long prefix
SPANS = [(1, 1), (7, 7), (13, 34), (70, 70), (1, 300)]


@pytest.fixture(scope="module")
def kernels() -> RowKernels:
    """Built here; where they cannot be, every test of this module fails under CI (`tests/kernel_checks.py`)."""
    return require_kernels()


def make_case(
    spans: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """(query [num_tokens, num_heads, head_dim], float32 cache, shuffled block tables, (start, query tokens, tokens
    in the cache) per sequence) for `spans`."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-length // block_size) for _, length in spans]
    num_blocks = sum(used) + 3
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(spans), max(used), dtype=torch.int64)
    first = 0
    for s, count in enumerate(used):
        tables[s, :count] = order[first : first + count]
        first += count
    starts = [sum(q for q, _ in spans[:s]) for s in range(len(spans))]
    query = torch.randn(sum(q for q, _ in spans), num_heads, head_dim, generator=gen) * 3
    return query, kv_cache, tables, [(a, q, n) for a, (q, n) in zip(starts, spans, strict=True)]


def run(
    kernels: RowKernels,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    spans: list[tuple[int, int, int]],
    window: int,
    extra_rows: int = 0,
) -> torch.Tensor:
    starts, query_lens, seq_lens = (torch.tensor(column, dtype=torch.int64) for column in zip(*spans, strict=True))
    out = torch.full((query.shape[0] + extra_rows, query.shape[1] * query.shape[2]), 7.0)
    scale = query.shape[2] ** -0.5
    kernels.paged_prefill_attention_(out, query, kv_cache, tables, starts, query_lens, seq_lens, scale, window)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 256), (8, 8, 16), (2, 1, 128)])
@pytest.mark.parametrize("window", [0, 1, 20])
def test_prefill_attention_reads_the_cache_like_masked_sdpa(
    kernels: RowKernels, num_heads: int, num_kv_heads: int, head_dim: int, window: int, dtype: torch.dtype
) -> None:
    """GQA shapes of SmolLM2 (9/3 x 64), Gemma 3 270M (4/1 x 256), MHA and Llama-like heads, blocks of 16."""
    query, kv_cache, tables, spans = make_case(SPANS, num_heads, num_kv_heads, head_dim, 16, head_dim + window)
    kv_cache = kv_cache.to(dtype)
    got = run(kernels, query, kv_cache, tables, spans, window)
    widened = run(kernels, query, kv_cache.float(), tables, spans, window)
    if uses_bf16_products(kernels, kv_cache):
        want = prefill_attention_reference(query, kv_cache, tables, spans, window, bf16_queries=True)
        assert float((got - want).abs().max()) <= (BF16_DOT_TOLERANCE + 1e-5) * float(kv_cache[:, 1].abs().max())
        if window != 1:  # (a window of 1 is the value itself either way) the bfloat16 products ran
            assert not torch.equal(got, widened)
        return
    want = prefill_attention_reference(query, kv_cache, tables, spans, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if dtype == torch.bfloat16:  # widening in registers is exact: the same bits as the widened float32 cache
        assert torch.equal(got, widened)


def uses_bf16_products(kernels: RowKernels, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel multiplies this cache in bfloat16 (`paged_prefill_attention_bf16_dot`)."""
    head_dim = kv_cache.shape[-1]
    return kv_cache.dtype == torch.bfloat16 and kernels.paged_prefill_attention_bf16_dot() and head_dim % 32 == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 23])
def test_a_sequences_rows_do_not_depend_on_its_batch_or_the_thread_count(
    kernels: RowKernels, window: int, dtype: torch.dtype
) -> None:
    """Blocks of 5 tokens (tiles of keys straddle them); every sequence alone, and the batch at 1 and 2 threads,
    give the same bits."""
    query, kv_cache, tables, spans = make_case(SPANS, 9, 3, 64, 5, 11)
    kv_cache = kv_cache.to(dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(run(kernels, query, kv_cache, tables, spans, window))
        assert torch.equal(results[0], results[1])
        for s, (start, query_len, seq_len) in enumerate(spans):
            rows = query[start : start + query_len]
            alone = run(kernels, rows, kv_cache, tables[s : s + 1], [(0, query_len, seq_len)], window)
            assert torch.equal(alone, results[0][start : start + query_len])
    finally:
        torch.set_num_threads(threads)
    bf16_products = uses_bf16_products(kernels, kv_cache)
    want = prefill_attention_reference(query, kv_cache, tables, spans, window, bf16_queries=bf16_products)
    tolerance = BF16_DOT_TOLERANCE * float(kv_cache[:, 1].abs().max()) if bf16_products else 0.0
    torch.testing.assert_close(results[0], want, rtol=1e-5, atol=1e-5 + tolerance)


def test_rows_outside_the_spans_are_left_alone(kernels: RowKernels) -> None:
    """The decodes' rows of a mixed step and the scratch row after the last token keep what they held."""
    query, kv_cache, tables, spans = make_case([(4, 9), (6, 6)], 9, 3, 64, 16, 3)
    starts, query_lens, seq_lens = (torch.tensor(c, dtype=torch.int64) for c in ([2, 6], [4, 6], [9, 6]))
    padded = torch.cat([torch.zeros(2, 9, 64), query, torch.zeros(1, 9, 64)])  # 2 decode rows first, 1 scratch row
    out = torch.full((padded.shape[0], 9 * 64), 7.0)
    kernels.paged_prefill_attention_(out, padded, kv_cache, tables, starts, query_lens, seq_lens, 0.25, 0)
    assert bool((out[:2] == 7.0).all())
    assert bool((out[-1] == 7.0).all())
    # the reference's scale is 1 / sqrt(64) = 0.125: twice the query there is the kernel's 0.25 here
    want = prefill_attention_reference(query * 2, kv_cache, tables, spans)
    torch.testing.assert_close(out[2:-1], want, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_instead_of_reading_wrong_memory(kernels: RowKernels) -> None:
    cache = torch.zeros(4, 2, 16, 1, 64)
    query = torch.zeros(3, 2, 64)
    out = torch.zeros(3, 128)
    one = torch.tensor([0])

    def call(**kw: object) -> None:
        args: dict[str, object] = dict(
            out=out,
            query=query,
            kv_cache=cache,
            block_tables=torch.tensor([[0]]),
            query_starts=one,
            query_lens=torch.tensor([3]),
            seq_lens=torch.tensor([3]),
        )
        args.update(kw)
        kernels.paged_prefill_attention_(*args.values(), 0.125, 0)  # type: ignore[arg-type]

    call()  # the valid call
    with pytest.raises(IndexError, match="outside the KV cache"):
        call(block_tables=torch.tensor([[4]]))
    with pytest.raises(IndexError, match="block table holds 16"):
        call(query_lens=torch.tensor([1]), seq_lens=torch.tensor([17]))
    with pytest.raises(IndexError, match="do not fit 3 query rows"):
        call(query_starts=torch.tensor([1]))
    with pytest.raises(IndexError, match="do not fit"):
        call(seq_lens=torch.tensor([2]))  # more query tokens than tokens in the cache
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        call(kv_cache=cache.half())
    with pytest.raises(RuntimeError, match="multiple of 8"):
        call(query=torch.zeros(3, 2, 12), kv_cache=torch.zeros(4, 2, 16, 1, 12), out=torch.zeros(3, 24))
    with pytest.raises(RuntimeError, match="out must be"):
        call(out=torch.zeros(2, 128))
