"""Paged attention equals dense causal attention computed directly with torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncllm.model.layers.attention import paged_attention, per_sequence_prefill, write_kv_cache
from asyncllm.model.layers.attention_metadata import build_attention_metadata, decode_metadata, general_metadata

BLOCK_SIZE = 4
HEAD_DIM = 8


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """q: [q_len, heads, d]; k, v: [seq_len, kv_heads, d]; queries are the last q_len positions; with `window`, a
    query at position p sees keys p - window + 1 .. p only."""
    q_len, heads, d = q.shape
    seq_len, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / d**0.5
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    if window is not None:
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] <= q_pos - window, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())
    return out.reshape(q_len, heads * d).float()


def _run_case(
    query_lens: list[int],
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    seed: int,
    window: int | None = None,
    pass_new_kv: bool = False,
    dtype: torch.dtype = torch.float32,
) -> None:
    """With `pass_new_kv`, attention is given this step's K/V as the model gives them, which routes full-attention
    prefill groups one sequence at a time (`sequence_prefill_attention`); without, they run padded SDPA. With a
    bfloat16 cache, the reference takes query, keys and values rounded to bfloat16 and the output may differ by
    bfloat16's rounding of SDPA's output (2**-9 relative)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in seq_lens) + 5
    block_ids = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous
    tables, cursor = [], 0
    for s in seq_lens:
        n = -(-s // BLOCK_SIZE)
        tables.append(block_ids[cursor : cursor + n])
        cursor += n
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
    cache = torch.randn(num_blocks, 2, BLOCK_SIZE, kv_heads, HEAD_DIM, generator=gen).to(dtype)  # garbage elsewhere
    keys = [torch.randn(s, kv_heads, HEAD_DIM, generator=gen) for s in seq_lens]
    values = [torch.randn(s, kv_heads, HEAD_DIM, generator=gen) for s in seq_lens]
    queries = [torch.randn(q, heads, HEAD_DIM, generator=gen) for q in query_lens]

    # Cached prefixes go in by their slots; this step's tokens through meta.slot_mapping.
    for table, k, v, q_len in zip(tables, keys, values, query_lens, strict=True):
        prefix = torch.arange(k.shape[0] - q_len)
        slots = torch.tensor(table)[prefix // BLOCK_SIZE] * BLOCK_SIZE + prefix % BLOCK_SIZE
        write_kv_cache(cache, k[: len(prefix)], v[: len(prefix)], slots)
    new_k = torch.cat([k[k.shape[0] - q :] for k, q in zip(keys, query_lens, strict=True)])
    new_v = torch.cat([v[v.shape[0] - q :] for v, q in zip(values, query_lens, strict=True)])
    write_kv_cache(cache, new_k, new_v, meta.slot_mapping)

    new_kv = (new_k, new_v) if pass_new_kv else None
    out = paged_attention(torch.cat(queries), cache, meta, window=window, new_kv=new_kv)
    if dtype != torch.float32:
        queries, keys, values = ([t.to(dtype).float() for t in ts] for ts in (queries, keys, values))
    expected = torch.cat([_dense_reference(q, k, v, window) for q, k, v in zip(queries, keys, values, strict=True)])
    assert out.shape == (sum(query_lens), heads * HEAD_DIM)
    assert out.dtype == torch.float32
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        pytest.param([1, 1, 1], [1, 7, 13], id="decodes"),  # the decode-only path (`_decode_attention`)
        pytest.param([1], [16], id="one-decode-full-blocks"),
        pytest.param([1, 1, 1], [6, 6, 6], id="decodes-of-one-length"),  # runs without a mask
        pytest.param([5, 9], [5, 9], id="prefills"),
        pytest.param([3, 6], [11, 6], id="prefill-with-cached-prefix"),
        pytest.param([1, 5, 1, 7, 3], [10, 5, 1, 9, 12], id="mixed"),
        pytest.param([4, 8, 5], [4, 17, 9], id="prefills-fresh-and-cached-across-blocks"),
    ],
)
@pytest.mark.parametrize("pass_new_kv", [False, True], ids=["padded", "per-sequence"])
def test_paged_attention_matches_dense(
    query_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, pass_new_kv: bool
) -> None:
    for seed in range(3):
        _run_case(query_lens, seq_lens, heads, kv_heads, seed, pass_new_kv=pass_new_kv)


@pytest.mark.parametrize("window", [1, 3, 5, 13])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        pytest.param([1, 1, 1], [1, 7, 13], id="decodes"),
        pytest.param([1, 1, 1], [6, 6, 6], id="decodes-of-one-length"),
        pytest.param([5, 9], [5, 9], id="prefills"),
        pytest.param([3, 6], [11, 6], id="prefill-with-cached-prefix"),
        pytest.param([1, 5, 1, 7, 3], [10, 5, 1, 9, 12], id="mixed"),
    ],
)
@pytest.mark.parametrize("pass_new_kv", [False, True], ids=["padded", "per-sequence"])
def test_sliding_window_attention_matches_dense(
    query_lens: list[int], seq_lens: list[int], window: int, pass_new_kv: bool
) -> None:
    """A layer with a sliding window sees only the last `window` keys of each query (itself included)."""
    for seed in range(2):
        _run_case(query_lens, seq_lens, 6, 2, seed, window, pass_new_kv)


@pytest.mark.parametrize("window", [None, 3, 13])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        pytest.param([1, 1, 1], [1, 7, 13], id="decodes"),
        pytest.param([1, 1, 1], [6, 6, 6], id="decodes-of-one-length"),
        pytest.param([5, 9], [5, 9], id="prefills"),
        pytest.param([3, 6], [11, 6], id="prefill-with-cached-prefix"),
        pytest.param([1, 5, 1, 7, 3], [10, 5, 1, 9, 12], id="mixed"),
    ],
)
@pytest.mark.parametrize("pass_new_kv", [False, True], ids=["padded", "per-sequence"])
def test_a_bfloat16_cache_matches_dense_attention_on_rounded_kv(
    query_lens: list[int], seq_lens: list[int], window: int | None, pass_new_kv: bool
) -> None:
    """`kv_cache_dtype="bfloat16"` on the torch paths (no kernels): writes round K/V to bfloat16, every path (decode
    gather, padded SDPA, per sequence with and without a cached prefix, windows) reads them and returns float32."""
    for seed in range(2):
        _run_case(query_lens, seq_lens, 9, 3, seed, window, pass_new_kv, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1], [1, 7, 13]), ([5, 9], [5, 9]), ([3, 6], [11, 6]), ([1, 5, 1, 7, 3], [10, 5, 1, 9, 12])],
    ids=["decodes", "prefills", "prefill-with-cached-prefix", "mixed"],
)
@pytest.mark.parametrize("window", [None, 3])
def test_soft_capping_on_a_bfloat16_cache_is_float32_math_on_the_rounded_kv(
    query_lens: list[int], seq_lens: list[int], window: int | None
) -> None:
    """Gemma 2's soft-capped scores are written out in float32: a bfloat16 cache's K/V are widened (exactly), so the
    result equals the float32 cache holding the same rounded values, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in seq_lens) + 2
    tables, cursor = [], 0
    for s in seq_lens:
        tables.append(list(range(cursor, cursor + -(-s // BLOCK_SIZE))))
        cursor += len(tables[-1])
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
    bf16 = torch.randn(num_blocks, 2, BLOCK_SIZE, 2, HEAD_DIM, generator=gen).to(torch.bfloat16)
    query = torch.randn(sum(query_lens), 6, HEAD_DIM, generator=gen)
    got = paged_attention(query, bf16, meta, window=window, softcap=2.0)
    want = paged_attention(query, bf16.float(), meta, window=window, softcap=2.0)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


def test_write_kv_cache_rounds_into_a_bfloat16_cache() -> None:
    cache = torch.zeros(3, 2, BLOCK_SIZE, 1, 2, dtype=torch.bfloat16)
    k = torch.tensor([[[1 + 2**-8, 1 + 3 * 2**-8]], [[0.1, -0.1]]])
    write_kv_cache(cache, k, -k, torch.tensor([5, 8]))
    assert torch.equal(cache[1, 0, 1, 0], k[0, 0].to(torch.bfloat16))
    assert cache[1, 0, 1, 0].float().tolist() == [1.0, 1 + 2**-6]  # ties to even
    assert torch.equal(cache[2, 1, 0, 0], (-k[1, 0]).to(torch.bfloat16))


def test_prefills_run_per_sequence_only_for_full_attention_given_the_new_kv() -> None:
    """The per-sequence prefill path takes full attention (or a window wider than every sequence) with this step's
    K/V; a window that drops keys, soft-capping, or no K/V keep padded SDPA."""
    meta = build_attention_metadata([5, 3], [5, 11], [[0, 1], [2, 3, 4]], BLOCK_SIZE)
    group = meta.groups[0]
    assert group.spans == [(0, 5, 5), (5, 3, 11)]
    new_kv = (torch.zeros(8, 2, HEAD_DIM), torch.zeros(8, 2, HEAD_DIM))
    assert per_sequence_prefill(group, new_kv, None, None)
    assert per_sequence_prefill(group, new_kv, 11, None)
    assert not per_sequence_prefill(group, new_kv, 10, None)
    assert not per_sequence_prefill(group, new_kv, None, 50.0)
    assert not per_sequence_prefill(group, None, None, None)


def test_write_kv_cache_writes_only_mapped_slots() -> None:
    cache = torch.zeros(3, 2, BLOCK_SIZE, 1, 2)
    k, v = torch.ones(2, 1, 2), torch.full((2, 1, 2), 2.0)
    write_kv_cache(cache, k, v, torch.tensor([5, 8]))  # block 1 offset 1; block 2 offset 0
    assert cache[1, 0, 1].eq(1).all()
    assert cache[2, 1, 0].eq(2).all()
    assert cache.count_nonzero() == 8


def test_only_decodes_of_one_length_run_without_a_mask() -> None:
    tables = [[0, 1], [2, 3]]
    assert build_attention_metadata([1, 1], [6, 6], tables, BLOCK_SIZE).groups[0].masks_keys is False
    assert build_attention_metadata([1, 1], [6, 5], tables, BLOCK_SIZE).groups[0].masks_keys is True
    assert build_attention_metadata([2], [2], tables[:1], BLOCK_SIZE).groups[0].masks_keys is True  # causal


def test_the_float_mask_is_the_boolean_one_and_gives_the_same_attention() -> None:
    """Attention passes SDPA the step's mask as floats, built once per step: SDPA's own conversion of a boolean
    mask gives these values, so every output equals the boolean mask's bit for bit."""
    meta = build_attention_metadata([3, 1], [5, 7], [[0, 1], [2, 3]], BLOCK_SIZE)
    for group in meta.groups:
        want = torch.where(group.attn_mask, 0.0, float("-inf"))
        assert group.attn_bias.dtype == torch.float32
        assert torch.equal(group.attn_bias, want)
        assert group.attn_bias is group.attn_bias  # made once, shared by every layer
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(4, 1, 3, 20, generator=gen) > 0.4
    mask[..., 0] = True
    q, k, v = torch.randn(4, 3, 3, 64, generator=gen), *torch.randn(2, 4, 3, 20, 64, generator=gen)
    bias = torch.where(mask, 0.0, float("-inf"))
    assert torch.equal(
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask), F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    )


def test_the_prefix_split_is_checked_once_and_a_wrong_kernel_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The cached-prefix split passes its start-up check on this torch; a flash kernel whose log-sum-exp is wrong
    fails it with a WARNING, and prefill groups then keep padded SDPA."""
    from asyncllm.model.layers import prefill_attention

    prefill_attention.prefix_split_available.cache_clear()
    assert prefill_attention.prefix_split_available()
    real = prefill_attention._FLASH_CPU
    assert real is not None

    def wrong_lse(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = real(*args, **kwargs)
        return out, lse + 1.0 if args[4] else lse  # the causal part's log-sum-exp off by 1: a wrong merge

    monkeypatch.setattr(prefill_attention, "_FLASH_CPU", wrong_lse)
    prefill_attention.prefix_split_available.cache_clear()
    try:
        assert not prefill_attention.prefix_split_available()
        assert "disagrees with SDPA" in caplog.text
        meta = build_attention_metadata([5, 3], [5, 11], [[0, 1], [2, 3, 4]], BLOCK_SIZE)
        new_kv = (torch.zeros(8, 2, HEAD_DIM), torch.zeros(8, 2, HEAD_DIM))
        assert not per_sequence_prefill(meta.groups[0], new_kv, None, None)
    finally:
        prefill_attention.prefix_split_available.cache_clear()


@pytest.mark.parametrize(
    ("seq_lens", "tables"),
    [
        ([1], [[3]]),
        ([9], [[0, 1, 2]]),
        ([4, 5, 2], [[4], [0, 2], [7, 1, 9]]),  # a table longer than its sequence needs
        ([6, 6], [[0, 1], [2, 3]]),
        ([64, 192, 130], [[*range(16)], [*range(16, 64)], [*range(64, 97)]]),
    ],
)
def test_decode_only_metadata_equals_the_general_builders(seq_lens: list[int], tables: list[list[int]]) -> None:
    """The decode-only builder (every query length 1) gives the general builder's fields, values and dtypes."""
    fast, general = (
        decode_metadata(seq_lens, tables, BLOCK_SIZE),
        general_metadata([1] * len(seq_lens), seq_lens, tables, BLOCK_SIZE),
    )
    assert (fast.num_tokens, fast.block_size, fast.mirror) == (general.num_tokens, general.block_size, None)
    assert fast.slot_blocks is not None
    assert general.slot_blocks is not None
    pairs = [(fast.slot_mapping, general.slot_mapping), *zip(fast.slot_blocks, general.slot_blocks, strict=True)]
    assert len(fast.groups) == len(general.groups) == 1
    a, b = fast.groups[0], general.groups[0]
    for name in ("block_tables", "seq_lens", "query_index", "attn_mask", "query_positions"):
        pairs.append((getattr(a, name), getattr(b, name)))
    for got, want in pairs:
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert torch.equal(got, want)
        assert got.is_contiguous() == want.is_contiguous()
    assert (a.masks_keys, a.causal_only) == (b.masks_keys, b.causal_only)
    routed = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, BLOCK_SIZE).groups[0]
    assert torch.equal(routed.attn_mask, a.attn_mask)  # decode-only steps take the decode builder


def test_decode_only_metadata_refuses_a_table_too_short() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([1], [5], [[0]], BLOCK_SIZE)
