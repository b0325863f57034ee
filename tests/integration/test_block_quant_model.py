"""`quantization="gguf" | "q8_0" | "q4_0"` on the real SmolLM2-135M-Instruct (a Q4_1 GGUF with a Q8_0 token
embedding): weights kept in blocks of 32 (`model/kernels/block_quant.py`), products on our own C++ kernels.

Logit error against the float32 model (the file dequantized), every prompt position, max |diff| / max |fp32 logit|
per position, worst over the prompts of each corpus (measured on this file, 2 busy cores; `-rP` prints them):
- "gguf" (the file's Q4_1 layers and Q8_0 head kept exactly: the error is the int8 activation blocks alone):
  held-out chats last 0.046, mean 0.039, max 0.086, top-1 >= 0.947; held-out prose 0.040 / 0.034 / 0.078 / 0.95.
- "q8_0" (requantized from the Q4_1 values): chats 0.048 / 0.042 / 0.078 / 0.947; prose 0.074 / 0.059 / 0.104 /
  0.95.
- "q4_0" (layers Q4_0, head Q8_0, from Q4_1 values: rounded twice): chats 0.21 / 0.42 / 0.77 / 0.568; prose
  0.45 / 0.38 / 0.74 / 0.59. Not a mode for this already-4-bit file ("gguf" is); its bounds would still catch a
  broken product (a swapped nibble or a scale on the wrong axis: top-1 near 0).
Bounds leave a margin of ~1.3-1.5x. Then the engine: greedy text through `AsyncLLM`, and batched runs equal alone
ones token for token (the block products of a row never depend on its batch).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch

from asyncllm import AsyncLLM, SamplingParams
from asyncllm.config import ModelConfig
from asyncllm.model.decode_stack import DecodeStacks
from asyncllm.model.kernels.block_quant import BlockQuantWeight
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.loading.loader import load_model
from asyncllm.model.loading.tokenizer import Tokenizer
from tests.integration.executor_helpers import PROMPTS, engine_args, greedy_ids
from tests.integration.test_int8 import HELD_OUT_CHATS, HELD_OUT_PROSE, Bounds
from tests.kernel_checks import require_kernels
from tests.reference import dense_greedy, next_token_logits

BOUNDS = {  # mode -> corpus -> bounds (measured worst values in the module doc)
    "gguf": {
        "chats": Bounds(last=0.07, mean=0.06, max=0.13, min_top1=0.90),
        "prose": Bounds(last=0.07, mean=0.06, max=0.13, min_top1=0.90),
    },
    "q8_0": {
        "chats": Bounds(last=0.08, mean=0.07, max=0.13, min_top1=0.90),
        "prose": Bounds(last=0.11, mean=0.09, max=0.16, min_top1=0.90),
    },
    "q4_0": {
        "chats": Bounds(last=0.40, mean=0.60, max=1.0, min_top1=0.45),
        "prose": Bounds(last=0.65, mean=0.55, max=1.0, min_top1=0.45),
    },
}


@pytest.fixture(scope="module", params=list(BOUNDS))
def block_model(request: pytest.FixtureRequest, model_path: str) -> tuple[str, Any]:
    require_kernels()  # fails under CI where they do not build, skips elsewhere (tests/kernel_checks.py)
    mode = request.param
    return mode, load_model(ModelConfig(model=model_path, model_path=model_path, quantization=mode))


@pytest.mark.timeout(900)  # loading and three corpora on a busy 2-core host
def test_block_model_weights_and_logit_error_against_fp32(
    model_path: str, reference_model: Any, block_model: tuple[str, Any]
) -> None:
    mode, model = block_model
    kinds = {getattr(layer, name).kind for layer in model.layers for name in ("qkv_proj", "o_proj", "gate_up_proj")}
    kinds |= {layer.down_proj.kind for layer in model.layers}
    assert kinds == {"gguf": {"q4_1"}, "q8_0": {"q8_0"}, "q4_0": {"q4_0"}}[mode]
    assert isinstance(model.lm_head, BlockQuantWeight)
    assert model.lm_head.kind == "q8_0"
    assert model.embed_tokens is None  # tied: looked up in the block head, no float32 copy
    ids = torch.tensor([0, 17, 4000, 49151])
    if mode == "gguf":  # the file's own Q8_0 token embedding, exactly as the fp32 model dequantized it
        assert torch.equal(model.embed(ids), reference_model.embed(ids))
    tokenizer = Tokenizer.load(model_path)
    for corpus, prompts, chat in (("chats", HELD_OUT_CHATS, True), ("prose", HELD_OUT_PROSE, False)):
        bounds = BOUNDS[mode][corpus]
        for prompt in prompts:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
            token_ids = tokenizer.encode(text)
            ref, got = next_token_logits(reference_model, token_ids), next_token_logits(model, token_ids)
            relative = (ref - got).abs().amax(-1) / ref.abs().amax(-1)
            top1 = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
            measured = (
                f"last {relative[-1]:.3f}, mean {relative.mean():.3f}, max {relative.max():.3f}, top-1 {top1:.3f}"
            )
            print(f"{mode} {corpus}: {prompt[:40]!r}: {measured}")
            assert relative[-1] <= bounds.last, (prompt, measured)
            assert relative.mean() <= bounds.mean, (prompt, measured)
            assert relative.max() <= bounds.max, (prompt, measured)
            assert top1 >= bounds.min_top1, (prompt, measured)
    if mode != "q4_0":
        answer = tokenizer.decode(dense_greedy(model, tokenizer.encode("The capital of France is"), 3))
        assert answer.startswith(" Paris"), answer


def _prefill_then_decode(model: Any, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Final hidden states `[len(token_ids), hidden]`: a prefill of all but the last token, then a decode step of
    it reading the cache the prefill wrote."""
    arch, n = model.arch, len(token_ids)
    tables = [list(range(-(-n // block_size)))]
    shape = (len(tables[0]), 2, block_size, arch.num_key_value_heads, arch.head_dim)
    kv_caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]
    with torch.inference_mode():
        meta = build_attention_metadata([n - 1], [n - 1], tables, block_size)
        first = model(torch.tensor(token_ids[:-1]), torch.arange(n - 1), kv_caches, meta)
        meta = build_attention_metadata([1], [n], tables, block_size)
        return torch.cat([first, model(torch.tensor(token_ids[-1:]), torch.tensor([n - 1]), kv_caches, meta)])


def test_the_block_layer_path_equals_the_generic_one_bit_for_bit(
    block_model: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LlamaDecoderLayer._forward_blocks` (the products straight on the block kernels, residuals added in place)
    gives the generic `forward`'s hidden states bit for bit, in a prefill and in a decode step."""
    from asyncllm.model import llama

    _, model = block_model
    monkeypatch.setattr(model, "fuse_decode_layers", False)  # the decode step through the layers too
    token_ids = [1, 504, 3458, 282, 4649, 314, 17, 4000, 49151, 28, 9, 260, 2114, 30, 1001, 77, 5]
    fused = _prefill_then_decode(model, token_ids)

    def generic(layer: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: Any, meta: Any, _: Any):
        hidden = hidden + layer._attention(layer._rms_norm(hidden, layer.input_norm), cos, sin, kv, meta)
        return hidden + layer._mlp(layer._rms_norm(hidden, layer.post_attention_norm))

    calls: list[int] = []
    monkeypatch.setattr(llama.LlamaDecoderLayer, "_forward_blocks", lambda *a: calls.append(1) or generic(*a))
    assert torch.equal(_prefill_then_decode(model, token_ids), fused)
    assert len(calls) == 2 * model.arch.num_hidden_layers  # the fused path ran in both steps, on every layer


def _decode_rows(model: Any, kv_caches: list[torch.Tensor], seq_lens: list[int], block_size: int = 16) -> torch.Tensor:
    """Final hidden states of one decode step of `len(seq_lens)` sequences (sequence i: `seq_lens[i]` tokens with
    this one, its blocks after sequence i - 1's), writing into `kv_caches`."""
    per_seq = -(-max(seq_lens) // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(seq_lens))]
    meta = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
    ids = torch.tensor([17, 4000, 49151, 260][: len(seq_lens)])
    with torch.inference_mode():
        return model(ids, torch.tensor(seq_lens) - 1, kv_caches, meta)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_in_one_stack_call_equals_the_per_layer_calls_bit_for_bit(
    block_model: tuple[str, Any], kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode stack (every layer of a decode-only step in one kernel call) gives the per-layer calls'
    (`_forward_blocks`) hidden states and KV caches bit for bit: 1 and 3 sequences of different lengths over random
    cache contents, full attention and a sliding window, at 1 and 2 threads; and the per-layer calls do not run."""
    from asyncllm.model import llama

    _, model = block_model
    arch, block_size = model.arch, 16
    gen = torch.Generator().manual_seed(3)
    shape = (4 * 5, 2, block_size, arch.num_key_value_heads, arch.head_dim)  # 4 sequences x 5 blocks of room
    base = [torch.randn(shape, generator=gen).to(kv_dtype) for _ in range(arch.num_hidden_layers)]
    calls: list[int] = []
    per_layer = llama.LlamaDecoderLayer._forward_blocks
    monkeypatch.setattr(llama.LlamaDecoderLayer, "_forward_blocks", lambda *a: calls.append(1) or per_layer(*a))
    threads = torch.get_num_threads()
    try:
        for window in (None, 24):
            for layer in model.layers:
                monkeypatch.setattr(layer, "window", window)
            monkeypatch.setattr(model, "_decode_stacks", DecodeStacks())  # built again with the windows
            for seq_lens in ([70], [41, 70, 57]):
                monkeypatch.setattr(model, "fuse_decode_layers", False)
                want_caches = [c.clone() for c in base]
                want = _decode_rows(model, want_caches, seq_lens, block_size)
                assert len(calls) == arch.num_hidden_layers
                calls.clear()
                monkeypatch.setattr(model, "fuse_decode_layers", True)
                for num_threads in (1, 2):
                    torch.set_num_threads(num_threads)
                    caches = [c.clone() for c in base]
                    got = _decode_rows(model, caches, seq_lens, block_size)
                    assert model._decode_stacks.last is not None  # the stack ran...
                    assert not calls  # ...alone
                    assert torch.equal(got, want), (window, seq_lens, num_threads)
                    assert all(torch.equal(c, w) for c, w in zip(caches, want_caches, strict=True))
                    assert not all(torch.equal(c, b) for c, b in zip(caches, base, strict=True))  # K/V written
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(900)
async def test_the_default_engine_runs_the_files_blocks_answers_and_batched_equals_alone(
    model_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`EngineArgs`' default `quantization="auto"` on the default model: the engine loads the file's Q4_1 blocks
    ("gguf") and its start-up log says so and why; greedy text, and batched runs equal alone ones."""
    require_kernels()
    caplog.set_level(logging.INFO, logger="asyncllm.model.loading.loader")
    args = engine_args(model_path, quantization="auto", engine_process=False)
    async with AsyncLLM.create(args) as llm:
        logged = [r.getMessage() for r in caplog.records if r.name == "asyncllm.model.loading.loader"]
        assert any(m.startswith("quantization='auto' -> 'gguf': ") and "(210 Q4_1)" in m for m in logged), logged
        assert any(m.startswith("block-quantized weights (gguf; ") and "layers 120 kept q4_1" in m for m in logged)
        final = await llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0)).collect()
        assert final.outputs[0].text.startswith(" Paris"), final.outputs[0].text
        batched = await greedy_ids(llm, PROMPTS)
        alone = [(await greedy_ids(llm, [prompt]))[0] for prompt in PROMPTS]
    assert batched == alone
    assert all(len(ids) > 0 for ids in batched)
    await asyncio.sleep(0)


@pytest.mark.timeout(900)
def test_gemma3_gguf_requantizes_its_k_quants_to_q8_0_and_keeps_its_q8_0_head(
    gemma_path: str, gemma_model: Any
) -> None:
    """Gemma 3 270M's file: Q5_0 q/k/gate/up, Q8_0 or Q5_0 v, Q4_K / Q6_K o and down, a Q8_0 token embedding. No
    fused weight is one kernel type, so every layer weight is requantized to Q8_0; the head is kept. Measured:
    relative logit error max 0.042 / 0.034 on two prose prompts, top-1 1.000, the same greedy words."""
    require_kernels()
    path, fp32 = gemma_path, gemma_model
    model = load_model(ModelConfig(model=path, model_path=path, quantization="gguf"))
    assert "72 requantized q8_0; LM head kept q8_0" in model.linear_kernels
    tokenizer = Tokenizer.load(path)
    for prompt in (
        "The recipe calls for two cups of flour, a pinch of salt and a spoonful of honey.",
        HELD_OUT_PROSE[2],
    ):
        ids = tokenizer.encode(prompt)
        ref, got = next_token_logits(fp32, ids), next_token_logits(model, ids)
        relative = (ref - got).abs().amax(-1) / ref.abs().amax(-1)
        assert float(relative.max()) <= 0.07, prompt
        assert float((ref.argmax(-1) == got.argmax(-1)).float().mean()) >= 0.9, prompt
    ids = tokenizer.encode("The capital of France is")
    assert dense_greedy(model, ids, 5) == dense_greedy(fp32, ids, 5)


def _count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[tuple[Any, ...]]:
    """Replace `owner.name` by a wrapper that records each call's positional arguments."""
    calls: list[tuple[Any, ...]] = []
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.timeout(900)
def test_gguf_mode_builds_the_files_blocks_from_their_bytes_as_the_values_route_did(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`quantization="gguf"` takes the file's Q4_1 / Q8_0 tensors as their bytes (`FileBlocks`): no block tensor is
    dequantized and the header is read once. Every layer weight and the head equal, kind and bits, what the values
    route gives (the file dequantized, then `block_weight_for(..., "gguf")` found the blocks again), and their
    values are the float32 load's."""
    import gguf.quants

    from asyncllm.model.kernels.block_quant import GGUF_BLOCK_KINDS
    from asyncllm.model.llama_weights import LINEAR_WEIGHTS
    from asyncllm.model.loading import gguf_config, loader
    from asyncllm.model.registry import get_model_class

    require_kernels()
    headers = _count_calls(monkeypatch, gguf_config, "read_gguf_header")
    dequantized = _count_calls(monkeypatch, gguf.quants, "dequantize")
    model = load_model(ModelConfig(model=model_path, model_path=model_path, quantization="gguf"))
    assert len(headers) == 1
    assert [int(qtype) for _, qtype in dequantized if int(qtype) in GGUF_BLOCK_KINDS] == []
    assert "layers 120 kept q4_1; LM head kept q8_0" in model.linear_kernels

    header = gguf_config.read_checked_gguf_header(model_path)  # the values route, as every load was before
    values = get_model_class(model.arch.architecture)(model.arch)
    values.load_weights(loader._iter_gguf_weights(model_path, model.arch, header, keep_blocks=False))
    assert values.quantize_blocks("gguf") == model.linear_kernels
    pairs = [
        (getattr(a, n), getattr(b, n)) for a, b in zip(model.layers, values.layers, strict=True) for n in LINEAR_WEIGHTS
    ]
    pairs.append((model.lm_head, values.lm_head))
    for got, want in pairs:
        assert (got.kind, got.in_features, got.out_features) == (want.kind, want.in_features, want.out_features)
        assert torch.equal(got.qs, want.qs)
        assert torch.equal(got.d.view(torch.int16), want.d.view(torch.int16))  # the float16 bits
        assert (got.m is None) == (want.m is None)
        if got.m is not None:
            assert torch.equal(got.m.view(torch.int16), want.m.view(torch.int16))

    headers.clear()
    fp32 = load_model(ModelConfig(model=model_path, model_path=model_path))  # float32: one header read too
    assert len(headers) == 1
    for layer, blocks in zip(fp32.layers, model.layers, strict=True):
        for name in LINEAR_WEIGHTS:
            assert torch.equal(getattr(layer, name), getattr(blocks, name).dequantize()), name
    assert torch.equal(fp32.lm_head, model.lm_head.dequantize())
