"""int8 weights with per-row int8 activations (`model/kernels/int8.py`), and the int8 Llama on a tiny dummy model:
rows never depend on their batch-mates, chunked prefill equals one prefill, and bad values are rejected."""

from __future__ import annotations

import json

import pytest
import torch

from asyncllm.config import EngineArgs, ModelConfig
from asyncllm.errors import ConfigError
from asyncllm.model.kernels.int8 import Int8Weight, quantize_int8
from asyncllm.model.kernels.linear import linear
from asyncllm.model.kernels.row_quant import quantize_rows
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.loading.loader import load_model
from tests.model_weights import randomize_matrices

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def test_weight_quantization_error_is_at_most_half_a_step() -> None:
    w = torch.randn(96, 40, generator=torch.Generator().manual_seed(0))
    w[:, 3] = 0.0  # an all-zero column keeps scale 1 and stays zero
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8
    assert q.qweight.shape == (96, 40)
    assert q.qweight.is_contiguous()
    assert q.scale.shape == (40,)
    assert q.scale[3] == 1.0
    assert torch.all(q.qweight[:, 3] == 0)
    assert torch.all((q.dequantize() - w).abs() <= q.scale / 2 + 1e-7)
    assert int(q.qweight.abs().max()) == 127  # the absmax of every column maps to +-127


def test_int8_linear_is_close_to_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 256, generator=gen), torch.randn(256, 64, generator=gen) / 16
    exact = x @ w
    got = linear(x, quantize_int8(w))
    relative = (got - exact).norm() / exact.norm()
    assert relative < 0.02  # measured 0.009: two 8-bit roundings of Gaussian data
    assert torch.equal(linear(x, w), exact)  # an fp32 weight is a plain matmul


def test_each_row_is_independent_of_its_batch() -> None:
    """Per-row activation scales: a row's result is bit-identical alone or next to any other rows."""
    gen = torch.Generator().manual_seed(2)
    w = quantize_int8(torch.randn(192, 80, generator=gen))
    x = torch.randn(33, 192, generator=gen)
    x[5] *= 1000.0  # an outlier row must not change the others' scales
    x[7] = 0.0
    batched = linear(x, w)
    for i in range(x.shape[0]):
        assert torch.equal(batched[i : i + 1], linear(x[i : i + 1], w)), i
    assert torch.all(batched[7] == 0)
    qx, _ = quantize_rows(x)
    assert torch.all(qx[7] == 0)
    assert torch.all(qx.abs().amax(1)[torch.arange(33) != 7] == 127)  # every other row uses the full range


def _tiny_model(tmp_path, quantization: str | None):  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    model = load_model(ModelConfig("tiny", str(tmp_path), load_format="dummy"))
    randomize_matrices(model)  # N(0, 1/fan) so attention and the MLP matter
    if quantization == "int8":
        model.quantize_int8([(7 * i + 3) % 512 for i in range(64)])
    return model


def _logits(model, chunks: list[list[list[int]]], kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Run steps; chunks[step][seq] are the new tokens of each sequence, in a KV cache of `kv_dtype`. Returns every
    token's logits of the last step, [num_tokens, vocab]."""
    arch, block_size = model.arch, 8
    num_seqs = len(chunks[0])
    blocks = 16
    shape = (num_seqs * blocks, 2, block_size, arch.num_key_value_heads, arch.head_dim)
    kv = [torch.zeros(shape, dtype=kv_dtype) for _ in range(2)]
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(num_seqs)]
    seq_lens = [0] * num_seqs
    for step in chunks:
        query_lens = [len(c) for c in step]
        positions = [p for i, c in enumerate(step) for p in range(seq_lens[i], seq_lens[i] + len(c))]
        seq_lens = [s + q for s, q in zip(seq_lens, query_lens, strict=True)]
        meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
        ids = torch.tensor([t for c in step for t in c])
        hidden = model(ids, torch.tensor(positions), kv, meta)
    return model.compute_logits(hidden)


def test_int8_model_quantizes_every_linear_and_the_head(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = _tiny_model(tmp_path, "int8")
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert isinstance(getattr(layer, name), Int8Weight), name
    assert isinstance(model.lm_head, Int8Weight)
    assert model.embed_tokens is not None
    assert model.embed_tokens.dtype == torch.float32


def test_int8_model_is_close_to_fp32_and_batch_equals_solo(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fp32, int8 = _tiny_model(tmp_path, None), _tiny_model(tmp_path, "int8")
    prompts = [[5, 17, 300, 41, 9, 77, 1], [400, 2, 3], [11] * 12]
    for prompt in prompts:
        a, b = _logits(fp32, [[prompt]]), _logits(int8, [[prompt]])
        assert (a - b).abs().max() <= 0.1 * a.abs().max()  # measured 0.019-0.030 on this random model
    batched = _logits(int8, [prompts])
    solo = torch.cat([_logits(int8, [[p]]) for p in prompts])
    assert torch.allclose(batched, solo, atol=1e-4, rtol=0)  # measured 5e-7: only attention sums differ


def test_int8_chunked_prefill_equals_one_prefill(tmp_path) -> None:  # type: ignore[no-untyped-def]
    int8 = _tiny_model(tmp_path, "int8")
    prompt = [(7 * i + 3) % 512 for i in range(30)]
    whole = _logits(int8, [[prompt]])[-1]
    chunked = _logits(int8, [[prompt[:11]], [prompt[11:29]], [prompt[29:]]])[-1]
    assert torch.allclose(whole, chunked, atol=1e-4, rtol=0)  # measured 0.0


def test_unknown_quantization_is_rejected() -> None:
    with pytest.raises(ConfigError, match="quantization='int4'"):
        EngineArgs(quantization="int4").validate()  # type: ignore[arg-type]
