"""`quantization="int8"` on the real SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized then requantized).

Logit error against the float32 model, every prompt position, max |diff| / max |fp32 logit| per position, on
three corpora (measured on this file, 2 cores; `-rP` prints them):
- the parity corpus (3 chat prompts; two of them share their topic and words with the SmoothQuant calibration
  text in `model/loading/loader.py`): 0.058-0.069 at the last prompt position, 0.106-0.114 on average, 0.226 at worst;
  the top-1 token agrees at 92-95% of positions.
- held-out chats (5 prompts on topics the calibration text does not touch): 0.042-0.073 last, 0.104-0.111 mean,
  0.226 worst (all chat prompts share the template's 24-token system prefix, where the worst position is);
  top-1 89-95%.
- held-out prose (3 plain-text paragraphs: a recipe, a lease clause, a football match; no chat template):
  0.067-0.112 last, 0.098-0.123 mean, 0.175-0.384 worst; top-1 82-93%. Quantization is visibly worse away from
  the calibration's chat format: the bounds are per corpus.
Following fp32's greedy answers (24 tokens each), int8 picks another token only where fp32's own top-2 gap is
<= 0.42 logits (fp32's first answer token to the France question wins by 0.08, so int8's free-running answer
there starts "L'..."). The bounds leave a margin of ~1.5x and would catch a broken quantizer (scales on the
wrong axis, a smoothing factor applied once instead of twice: errors > 1). int8 is then checked against its own
runs: batched equals alone (with chunked prefill), TP=3 equals TP=1 where the greedy choice is clear.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

from asyncllm import SamplingParams
from asyncllm.config import EngineArgs, ModelConfig
from asyncllm.engine.core import EngineCore
from asyncllm.model.decode_stack import INT8_STACK_KERNELS
from asyncllm.model.layers import attention
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.llama_weights import LINEAR_WEIGHTS
from asyncllm.model.loading.loader import load_model
from asyncllm.model.loading.tokenizer import Tokenizer
from tests.integration.conftest import EngineFactory
from tests.integration.executor_helpers import EXECUTOR_OVERRIDES, PROMPTS, greedy_ids
from tests.integration.test_engine_core import _assert_all_free, _requests, _run
from tests.integration.test_model_parity import CHATS, _Runner
from tests.kernel_checks import require_kernels
from tests.reference import greedy_margins, next_token_logits

HELD_OUT_CHATS = [  # topics and words the calibration text (model/loading/loader.py CALIBRATION_MESSAGES) does not have
    "How do bees make honey?",
    "Give me three tips for sleeping better.",
    "What does a librarian do all day?",
    "Describe how to boil an egg.",
    "Why do cats purr?",
]
HELD_OUT_PROSE = [  # plain text, no chat template: another format than the calibration's chat
    "The recipe calls for two cups of flour, a pinch of salt and a spoonful of honey. Knead the dough until it is "
    "smooth, cover it with a cloth, and let it rest in a warm corner of the kitchen for an hour before baking.",
    "Under the agreement, the tenant shall keep the premises in good repair and shall not sublet any part of them "
    "without the prior written consent of the landlord, which shall not be unreasonably withheld.",
    "The goalkeeper dived to his left, but the ball curled into the top corner. The crowd fell silent for a "
    "moment, then the away fans behind the goal began to sing as their players ran towards them.",
]


class Bounds(NamedTuple):
    """Relative logit error bounds of one corpus (measured values in the module doc; margin ~1.5x)."""

    last: float  # at the last prompt position
    mean: float  # mean over positions
    max: float  # worst position
    min_top1: float  # fraction of positions whose top-1 token agrees


# name -> (prompts, chat template?, bounds); worst measured last / mean / max / top-1: parity 0.069 / 0.114 /
# 0.226 / 0.919; held-out chats 0.073 / 0.111 / 0.226 / 0.892; held-out prose 0.112 / 0.123 / 0.384 / 0.818
CORPORA = {
    "parity": (CHATS, True, Bounds(last=0.12, mean=0.16, max=0.33, min_top1=0.88)),
    "held_out_chats": (HELD_OUT_CHATS, True, Bounds(last=0.12, mean=0.16, max=0.33, min_top1=0.85)),
    "held_out_prose": (HELD_OUT_PROSE, False, Bounds(last=0.17, mean=0.18, max=0.55, min_top1=0.72)),
}
CLEAR_MARGIN = 1.0  # logits; int8 flips fp32's greedy choice only below 0.42 (measured)
TP_TOLERANCE = 1.0  # logits: TP shards quantize partial rows of o_proj/down_proj inputs with their own scales


@pytest.fixture(scope="module")
def models(model_path: str, reference_model: Any) -> tuple[Any, Any]:
    fp32 = reference_model  # the session's dense fp32 model
    int8 = load_model(ModelConfig(model=model_path, model_path=model_path, quantization="int8"))
    return fp32, int8


@pytest.mark.parametrize("corpus", list(CORPORA))
def test_int8_logit_error_against_fp32(model_path: str, models: tuple[Any, Any], corpus: str) -> None:
    tokenizer = Tokenizer.load(model_path)
    fp32, int8 = models
    prompts, chat_template, bounds = CORPORA[corpus]
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat_template else prompt
        ids = tokenizer.encode(text)
        ref, got = next_token_logits(fp32, ids), next_token_logits(int8, ids)
        relative = (ref - got).abs().amax(-1) / ref.abs().amax(-1)
        top1 = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
        measured = f"last {relative[-1]:.3f}, mean {relative.mean():.3f}, max {relative.max():.3f}, top-1 {top1:.3f}"
        print(f"{corpus}: {prompt[:40]!r} ({len(ids)} tokens): {measured}")
        assert relative[-1] <= bounds.last, (prompt, measured)
        assert relative.mean() <= bounds.mean, (prompt, measured)
        assert relative.max() <= bounds.max, (prompt, measured)
        assert top1 >= bounds.min_top1, (prompt, measured)


def test_fused_kernels_give_the_eager_logits_bit_for_bit(
    model_path: str, models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused row kernels (`model/kernels/row_kernels.py`), where they build, change speed only: the real model's
    logits over a chat prompt, fp32 and int8, are the same with the eager ops. The attention kernels that read the
    cache sum in another order than SDPA: with them the logits stay within float32 rounding (fp32), while int8's
    per-row activation quantization turns those last bits into a rounding step here and there, which later layers
    carry on (measured on the AMD EPYC with AVX-512: fp32 2e-6, int8 0.072 of the largest logit, where int8 itself
    is 0.17 from fp32 on this prompt; the next token here is a near-tie, 0.08 logits apart in fp32, and may flip).
    int8's error against fp32 with the kernels is held to its bounds by `test_int8_logit_error_against_fp32`."""
    tokenizer = Tokenizer.load(model_path)
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": CHATS[0]}]))
    require_kernels()  # fails under CI where they do not build, skips elsewhere (tests/kernel_checks.py)
    for model, bound in zip(models, (1e-4, 0.1), strict=True):
        kernels = model.fused_kernels
        assert kernels is not None
        with_attention_kernels = next_token_logits(model, ids)
        with monkeypatch.context() as patch:  # the row kernels alone: bit for bit
            patch.setattr(attention, "decode_reads_cache", lambda kernels, head_dim: False)
            patch.setattr(attention, "prefill_reads_cache", lambda kernels, group, head_dim: False)
            fused = next_token_logits(model, ids)
        modules = (model, *model.layers)
        try:
            for module in modules:
                module.fused_kernels = None
            eager = next_token_logits(model, ids)
        finally:
            for module in modules:
                module.fused_kernels = kernels
        assert torch.equal(fused, eager)
        scale = float(eager.abs().max())
        assert float((with_attention_kernels - eager).abs().max()) <= bound * scale


def test_int8_chunked_prefill_then_decode_is_close_to_one_prefill(model_path: str, models: tuple[Any, Any]) -> None:
    """Chunking changes attention's fp32 summation order in the last bits; a per-row int8 rounding that lands
    on the other side of .5 then moves later layers by one quantization step. Measured: max |diff| 1.30-1.39
    logits (0.043-0.054 of the largest logit) against 5e-5 for fp32; the choice flips only at a near-tie."""
    _, int8 = models
    tokenizer = Tokenizer.load(model_path)
    for chat in CHATS:
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": chat}]))
        whole = next_token_logits(int8, ids)[-1]
        runner = _Runner(int8, 1, len(ids))
        runner.step([ids[:13]])
        runner.step([ids[13:-2]])
        runner.step([ids[-2:-1]])
        chunked = runner.step([ids[-1:]])[0]
        assert (whole - chunked).abs().max() <= 0.1 * whole.abs().max(), chat
        top2 = whole.topk(2).values
        if top2[0] - top2[1] > CLEAR_MARGIN:
            assert int(chunked.argmax()) == int(whole.argmax()), chat


@pytest.mark.parametrize("seq_lens", [[70], [41, 70, 57], [33 + 7 * i for i in range(32)]])
def test_int8_decode_stack_equals_the_per_layer_calls_bit_for_bit(
    models: tuple[Any, Any], seq_lens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the real model, a decode step of 1, 3 and 32 sequences over random bfloat16 cache contents in one stack call
    (`model/decode_stack.py`) gives the per-layer calls' hidden states and caches bit for bit; it runs wherever this
    host's kernel choices for that row count are the stack's C++ kernels (VNNI or AVX2)."""
    _, int8 = models
    require_kernels()
    arch, block_size, rows = int8.arch, 16, len(seq_lens)
    per_seq = -(-max(seq_lens) // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(rows)]
    meta = build_attention_metadata([1] * rows, seq_lens, tables, block_size)
    gen = torch.Generator().manual_seed(5)
    shape = (rows * per_seq, 2, block_size, arch.num_key_value_heads, arch.head_dim)
    base = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(arch.num_hidden_layers)]
    ids = torch.randint(0, arch.vocab_size, (rows,), generator=gen)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(int8, "fuse_decode_layers", fused)
        caches = [c.clone() for c in base]
        with torch.inference_mode():
            results.append((int8(ids, torch.tensor(seq_lens) - 1, caches, meta), caches))
    weights = [getattr(layer, name) for layer in int8.layers for name in LINEAR_WEIGHTS]
    stackable = all(w.choice.kernel_for(rows) in INT8_STACK_KERNELS for w in weights)
    assert (int8._decode_stacks.last is not None) == stackable
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def test_int8_follows_fp32_greedy_answers_where_the_choice_is_clear(model_path: str, models: tuple[Any, Any]) -> None:
    tokenizer = Tokenizer.load(model_path)
    fp32, int8 = models
    num_compared = 0
    for chat in CHATS:
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": chat}]))
        ids, runner = list(prompt), _Runner(fp32, 1, len(prompt) + 16)
        logits = runner.step([prompt])[0]
        for _ in range(16):  # fp32 greedy answer, decoded step by step
            ids.append(int(logits.argmax()))
            logits = runner.step([ids[-1:]])[0]
        rows = slice(len(prompt) - 1, len(ids) - 1)
        ref, got = next_token_logits(fp32, ids)[rows], next_token_logits(int8, ids)[rows]
        top2 = ref.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > CLEAR_MARGIN
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear]), chat
        num_compared += int(clear.sum())
    assert num_compared >= 24  # most answer tokens are clear choices
    assert tokenizer.decode(ids[len(prompt) :]).startswith("A CPU cache is")


async def test_int8_engine_completes_a_prompt(make_llm: EngineFactory) -> None:
    llm = make_llm(quantization="int8", engine_process=False, num_kv_blocks=64)
    final = await llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0)).collect()
    assert final.outputs[0].text.startswith(" Paris")


INT8_NEAR_TIE = 1.5  # logits: batching moves int8 logits by up to ~1.4 (see the chunked-prefill test)


def _assert_same_where_int8_clear(core: EngineCore, requests: list[Any], alone: Any, batched: Any) -> None:
    """Batched tokens equal the alone ones; a sequence may diverge only at a choice whose int8 top-2 margin is
    below INT8_NEAR_TIE (measured: 5 of 16 requests diverge, all at margins < 1.5), at most 8 times."""
    model = core.executor.worker.model  # type: ignore[attr-defined]
    num_diverged = 0
    for request in requests:
        expected, got = alone[request.request_id], batched[request.request_id]
        assert len(got) == len(expected), request.request_id
        first_diff = next((i for i, (x, y) in enumerate(zip(expected, got, strict=True)) if x != y), None)
        if first_diff is not None:
            num_diverged += 1
            margin = greedy_margins(model, request.prompt_token_ids, expected)[first_diff]
            assert margin < INT8_NEAR_TIE, (request.request_id, first_diff, margin)
    assert num_diverged <= 8


@pytest.mark.slow
@pytest.mark.timeout(300)  # 32 real-model runs: 64 s at load 5 on 2 cores (over 1,200 s on a slow kernel)
def test_int8_batched_matches_alone_where_greedy_choice_is_clear(model_path: str) -> None:
    max_num_batched_tokens = 24  # prompts of up to 108 tokens are prefilled in chunks, alone and batched
    args = EngineArgs(
        model=model_path,
        quantization="int8",
        num_kv_blocks=64,
        max_model_len=512,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    core = EngineCore(args.create_engine_config())
    try:
        requests = _requests(core.ready_info.vocab_size, seed=1)
        alone: dict[str, list[int]] = {}
        for request in requests:
            alone.update(_run(core, [request]))
        batched = _run(core, requests, join_every=2)
        _assert_all_free(core)
        _assert_same_where_int8_clear(core, requests, alone, batched)
    finally:
        core.shutdown()


@pytest.mark.slow
@pytest.mark.mp
async def test_int8_tp3_follows_tp1_within_the_shards_quantization_noise(
    make_llm: EngineFactory, models: tuple[Any, Any]
) -> None:
    """Every token the TP=3 engine (3 worker processes) picks is TP=1's greedy choice, or within `TP_TOLERANCE`
    logits of it, given the same prefix: TP=1's logits are computed along TP=3's own tokens (teacher forcing), so
    the check goes on after a near-tie sent the two apart. The TP=1 side is the module's int8 model run densely (the
    weights a TP=1 engine loads). (It compared the two sequences up to the first margin below 0.5 logits; on an AMD
    EPYC with AVX-512 VNNI a choice of margin 0.52 flipped, 2026-12-05.)"""
    llm = make_llm(**EXECUTOR_OVERRIDES, quantization="int8", distributed_executor_backend="mp", tensor_parallel_size=3)
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    tp3 = await greedy_ids(llm, PROMPTS)
    _, int8 = models
    gaps: list[float] = []
    for prompt, got in zip(prompt_ids, tp3, strict=True):
        logits = next_token_logits(int8, prompt + got)[len(prompt) - 1 : -1]  # row i predicts got[i]
        gaps += (logits.max(dim=-1).values - logits[torch.arange(len(got)), got]).tolist()
    print("TP=3 tokens' gaps below TP=1's greedy logit:", [round(g, 2) for g in gaps])
    assert max(gaps) <= TP_TOLERANCE
    assert sum(g == 0.0 for g in gaps) >= 0.75 * len(gaps)  # mostly TP=1's own choice
