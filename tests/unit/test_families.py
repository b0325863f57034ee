"""Each supported family against HF `transformers`' own implementation on the same random weights (issue 28):
a checkpoint with the family's shape features (Llama 3.2's llama3 rope scaling and tied head, Qwen2.5's q/k/v biases,
Qwen3's q/k norms and head_dim != hidden / heads, Phi-3's fused checkpoint modules and partial rotary) and two
layers, written by HF as a safetensors directory and loaded by asyncllm's loader.

Checked per family: logits over a prefill and 32 decode steps through the paged KV cache (max abs error in the
message), greedy ids equal wherever HF's top-2 margin is clear, a batch equal to each sequence alone, a chunked
prefill equal to the whole one, and int8 within a stated logit error of fp32 and equal to its own solo runs.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
from typing import Any

import pytest
import torch

from asyncllm import SamplingParams
from asyncllm.config import ModelConfig
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.model.arch import LongRopeScaling
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.layers.rotary import arch_cos_sin
from asyncllm.model.loading.arch_config import max_prompt_len
from asyncllm.model.loading.loader import load_model
from asyncllm.processing.no_tokenizer import NoTokenizer
from tests.family_checkpoints import (
    ARCHITECTURES,
    FAMILIES,
    write_family_checkpoint,
    write_family_gguf,
)

BLOCK_SIZE = 4
PROMPT = [5, 17, 42, 8, 8, 90, 1, 33, 150, 64, 7, 120]
OTHER = [9, 99, 3, 140, 12, 12, 60]
DECODE_STEPS = 32
LOGIT_ATOL = 1e-4  # float32 against float32: the same math in a different order (measured: 2-4e-6)
MARGIN = 1e-2  # a greedy choice is clear when HF's top-2 logits differ by this much
INT8_REL_ERROR = (
    0.1  # int8 (SmoothQuant, per-channel weights, per-row activations): max |error| / max |logit| (measured: 0.02-0.05)
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Cache:
    """A paged KV cache for our model: one block table per sequence, BLOCK_SIZE tokens a block."""

    def __init__(self, model: Any, seqs: int, tokens: int) -> None:
        arch = model.arch
        self.per_seq = -(-tokens // BLOCK_SIZE)
        shape = (seqs * self.per_seq, 2, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
        self.caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]
        self.tables = [list(range(i * self.per_seq, (i + 1) * self.per_seq)) for i in range(seqs)]
        self.model = model

    def step(self, seqs: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """One forward of `chunks[i]` (tokens at positions starts[i]...) of sequences `seqs`; logits of every row."""
        lens = [len(c) for c in chunks]
        ends = [s + n for s, n in zip(starts, lens, strict=True)]
        meta = build_attention_metadata(lens, ends, [self.tables[i] for i in seqs], BLOCK_SIZE)
        ids = torch.tensor([t for c in chunks for t in c])
        positions = torch.tensor([p for s, n in zip(starts, lens, strict=True) for p in range(s, s + n)])
        with torch.inference_mode():
            return self.model.compute_logits(self.model(ids, positions, self.caches, meta))


def prefill_then_decode(model: Any, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits after the prompt and after each continuation token, fed one decode step at a time:
    [len(continuation) + 1, vocab]."""
    cache = Cache(model, 1, len(prompt) + len(continuation))
    rows = [cache.step([0], [prompt], [0])[-1:]]
    for i, token in enumerate(continuation):
        rows.append(cache.step([0], [[token]], [len(prompt) + i]))
    return torch.cat(rows)


def hf_greedy(ref: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation (EOS ignored) and its logits after the prompt and each token: [steps + 1, vocab]."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = ref(torch.tensor([ids])).logits[0, len(prompt) - 1 :]
    return ids[len(prompt) :], logits


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Any]:
    """(family, HF's model, asyncllm's model loaded from the HF directory HF wrote)."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp(request.param)
    ref = write_family_checkpoint(request.param, path)
    return request.param, ref, load_family(request.param, path)


def load_family(family: str, path: pathlib.Path) -> Any:
    """asyncllm's model of a family's checkpoint."""
    return load_model(ModelConfig(model="m", model_path=str(path)))


def test_the_checkpoint_has_the_family_features(family: tuple[str, Any, Any]) -> None:
    name, _, model = family
    arch = model.arch
    assert arch.architecture == ARCHITECTURES.get(name, name)
    if name == "phi4mini":
        assert arch.rope_scaling is not None
        assert arch.rotary_dim == 24
    if name == "qwen3":
        assert arch.head_dim == 32 != arch.hidden_size // arch.num_attention_heads
        assert model.layers[0].q_norm is not None
    if name == "phi3":
        assert (arch.head_dim, arch.rotary_dim) == (32, 24)
        assert not arch.tie_word_embeddings
    if name == "mistral":  # the window is applied on every layer, and is shorter than the test's sequences
        assert arch.sliding_window == 8 < len(PROMPT)
        assert [layer.window for layer in model.layers] == [8, 8]
    if name == "qwen2":
        assert model.layers[0].qkv_bias is not None
        assert arch.sliding_window is None  # use_sliding_window false: HF attends to the whole sequence too


def test_logits_match_hf_over_prefill_and_32_decode_steps(family: tuple[str, Any, Any]) -> None:
    name, ref, model = family
    tokens, expected = hf_greedy(ref, PROMPT, DECODE_STEPS)
    ours = prefill_then_decode(model, PROMPT, tokens)
    error = (ours - expected).abs().max().item()
    assert error < LOGIT_ATOL, f"{name}: max abs logit error {error:.3g} over {DECODE_STEPS + 1} steps"
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1] >= MARGIN)[:-1]
    assert int(clear.sum()) >= DECODE_STEPS - 4, f"{name}: too few clear greedy choices to compare"
    ours_ids = ours[:-1].argmax(-1)
    assert ours_ids[clear].tolist() == torch.tensor(tokens)[clear].tolist(), name


def _batch_and_chunks(model: Any, chunked_rel_error: float = 0.0) -> None:
    """A batch of two prefills equals each alone; a prefill in three chunks equals the whole; then a mixed step
    (one sequence decoding, the other prefilling its last chunk) equals the solo runs.

    A chunk after a cached prefix runs a different float sum (the prefix and the chunk merged by log-sum-exp,
    `prefill_attention.py`), equal to the whole within float32 rounding. With `chunked_rel_error` > 0 (int8
    activations), such a rounding may move an activation across an int8 rounding boundary: the chunked logits
    then stay within that share of the largest logit and give the whole run's greedy token wherever its top two
    differ by `MARGIN`. Batch against solo is the same sum on every host and stays exact."""
    solo = [Cache(model, 1, 16).step([0], [seq], [0]) for seq in (PROMPT, OTHER)]
    both = Cache(model, 2, 16).step([0, 1], [PROMPT, OTHER], [0, 0])
    torch.testing.assert_close(both, torch.cat(solo), atol=1e-5, rtol=1e-5)
    cache = Cache(model, 2, 16)
    chunks = [cache.step([0], [PROMPT[:5]], [0]), cache.step([0], [PROMPT[5:9]], [5])]
    cache.step([1], [OTHER[:4]], [0])
    mixed = cache.step([0, 1], [PROMPT[9:], OTHER[4:]], [9, 4])
    chunked = torch.cat([*chunks, mixed[: len(PROMPT) - 9]])
    for got, want in ((chunked, solo[0]), (mixed[len(PROMPT) - 9 :], solo[1][4:])):
        if chunked_rel_error == 0.0:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            continue
        relative = ((got - want).abs().max() / want.abs().max()).item()
        assert relative < chunked_rel_error, f"chunked prefill: {relative:.3g} of the largest logit"
        top2 = want.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] >= MARGIN
        assert int(clear.sum()) >= len(want) // 2
        assert got[clear].argmax(-1).tolist() == want[clear].argmax(-1).tolist()


def test_batch_equals_solo_and_chunked_prefill_equals_whole(family: tuple[str, Any, Any]) -> None:
    _batch_and_chunks(family[2])


def test_int8_within_its_error_and_equal_to_its_own_solo_runs(
    family: tuple[str, Any, Any], tmp_path: pathlib.Path
) -> None:
    name, ref, model = family
    path = tmp_path / name
    write_family_checkpoint(name, path)
    int8 = load_family(name, path)
    int8.quantize_int8([(37 * i + 11) % model.arch.vocab_size for i in range(96)])
    tokens, _ = hf_greedy(ref, PROMPT, 8)
    fp32, quantized = prefill_then_decode(model, PROMPT, tokens), prefill_then_decode(int8, PROMPT, tokens)
    relative = ((quantized - fp32).abs().max() / fp32.abs().max()).item()
    assert relative < INT8_REL_ERROR, f"{name}: int8 max abs logit error {relative:.3g} of the largest logit"
    _batch_and_chunks(int8, chunked_rel_error=INT8_REL_ERROR / 2)


def test_gguf_with_llama_cpp_names_matches_hf(family: tuple[str, Any, Any], tmp_path: pathlib.Path) -> None:
    """The same weights as a GGUF file (`gguf`'s writer, llama.cpp's names and metadata, Q/K permuted for llama):
    asyncllm's logits equal HF's over a prefill and 32 decode steps. LongRoPE from GGUF is refused."""
    pytest.importorskip("gguf")
    name, ref, _ = family
    path = write_family_gguf(name, ref, tmp_path / f"{name}.gguf")
    if name == "phi4mini":
        with pytest.raises(ConfigError, match=r"phi3\.rope\.scaling\.attn_factor"):
            load_model(ModelConfig(model="m", model_path=str(path), max_model_len=64))
        return
    model = load_model(ModelConfig(model="m", model_path=str(path)))
    assert model.arch.architecture == ARCHITECTURES.get(name, name)
    tokens, expected = hf_greedy(ref, PROMPT, DECODE_STEPS)
    error = (prefill_then_decode(model, PROMPT, tokens) - expected).abs().max().item()
    assert error < LOGIT_ATOL, f"{name} GGUF: max abs logit error {error:.3g} over {DECODE_STEPS + 1} steps"


LONG_PROMPT = [(37 * i + 11) % 160 for i in range(40)]  # 40 tokens, within phi4mini's original context (64)
LONG_STEPS = 60  # decoding crosses the original context at step 24 and goes on to position 99


def hf_cached_greedy(ref: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation as its `generate` computes it: the prompt in one call, then one token per call on
    its KV cache (HF's LongRoPE picks short or long factors per call); logits after the prompt and each token:
    [steps + 1, vocab]."""
    with torch.no_grad():
        out = ref(torch.tensor([prompt]), use_cache=True)
        rows, tokens = [out.logits[0, -1]], []
        for _ in range(steps):
            tokens.append(int(rows[-1].argmax()))
            out = ref(torch.tensor([tokens[-1:]]), cache=out.cache, use_cache=True)
            rows.append(out.logits[0, -1])
    return tokens, torch.stack(rows)


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(HF's Phi-4-mini-shaped LongRoPE model, asyncllm's model of it at its whole context, 128 tokens)."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("longrope")
    ref = write_family_checkpoint("phi4mini", path)
    model = load_model(ModelConfig(model="m", model_path=str(path)))
    scaling = model.arch.rope_scaling
    assert isinstance(scaling, LongRopeScaling)
    assert scaling.original_max_position_embeddings == 64
    assert model.arch.max_position_embeddings == 128
    return ref, model


def test_longrope_decoding_past_the_original_context_matches_hf_generate(longrope: tuple[Any, Any]) -> None:
    """A 40-token prompt decoded for 60 tokens: HF switches to the long factors at position 64 and keeps the keys it
    cached under the short ones; so does asyncllm, position by position. Without the long factors (the short ones
    throughout, as before) the logits past the switch are far off: the comparison can fail."""
    ref, model = longrope
    tokens, expected = hf_cached_greedy(ref, LONG_PROMPT, LONG_STEPS)
    ours = prefill_then_decode(model, LONG_PROMPT, tokens)
    error = (ours - expected).abs().max().item()
    assert error < LOGIT_ATOL, f"LongRoPE: max abs logit error {error:.3g} over {LONG_STEPS + 1} steps"
    short_only = copy.deepcopy(model)
    scaling = short_only.arch.rope_scaling
    short_arch = dataclasses.replace(
        short_only.arch, rope_scaling=dataclasses.replace(scaling, long_factor=scaling.short_factor)
    )
    short_only.rope_cos, short_only.rope_sin = arch_cos_sin(short_arch)
    wrong = prefill_then_decode(short_only, LONG_PROMPT, tokens)
    switch = 64 - len(LONG_PROMPT)  # the row of the first token decoded at position 64
    assert (wrong[:switch] - expected[:switch]).abs().max().item() < LOGIT_ATOL
    assert (wrong[switch + 1 :] - expected[switch + 1 :]).abs().max().item() > 1000 * LOGIT_ATOL


def test_longrope_recompute_past_the_switch_equals_decoding(longrope: tuple[Any, Any]) -> None:
    """A sequence that decoded past the original context and is computed again (preemption by recompute, or a
    prefix-cache hit on its blocks) in prefill chunks of any size gets the same keys and logits: the rotation
    depends on the position alone."""
    ref, model = longrope
    tokens, _ = hf_cached_greedy(ref, LONG_PROMPT, LONG_STEPS)
    decoded = prefill_then_decode(model, LONG_PROMPT, tokens)
    ids = LONG_PROMPT + tokens[:-1]
    for size in (len(ids), 25, 7):
        cache = Cache(model, 1, len(ids))
        rows = torch.cat([cache.step([0], [ids[s : s + size]], [s]) for s in range(0, len(ids), size)])
        torch.testing.assert_close(rows[len(LONG_PROMPT) - 1 :], decoded[:-1], atol=1e-5, rtol=1e-5)


def test_longrope_prompts_longer_than_the_original_context_are_refused(longrope: tuple[Any, Any]) -> None:
    """HF rotates a prompt longer than the original context with the long factors from its first token; asyncllm
    cannot (its keys depend on the position alone), so such a prompt is refused at submission, naming the limit."""
    from asyncllm.processing.input_processor import InputProcessor

    _, model = longrope
    limit = max_prompt_len(model.arch)
    assert limit == 64
    assert max_prompt_len(dataclasses.replace(model.arch, rope_scaling=None)) is None
    processor = InputProcessor(NoTokenizer(2), 128, 160, max_prompt_len=limit)
    processor.process({"prompt_token_ids": [5] * 64}, SamplingParams(max_tokens=64))
    with pytest.raises(InvalidRequestError, match=r"at most 64 .*LongRoPE"):
        processor.process({"prompt_token_ids": [5] * 65}, SamplingParams(max_tokens=8))


def test_qwen2_used_sliding_window_is_refused_unless_it_covers_every_sequence(tmp_path: pathlib.Path) -> None:
    """Qwen2.5 with `use_sliding_window` on its upper layers: HF windows their attention, asyncllm attends to the
    whole sequence, so the checkpoint loads only with a max_model_len the window covers, and then equals HF."""
    transformers = pytest.importorskip("transformers")
    from tests.family_checkpoints import COMMON

    keys = {**FAMILIES["qwen2"][1], "use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}
    config = transformers.Qwen2Config(**COMMON, **keys)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    ref.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="sliding_window=24 < max_model_len 128"):
        load_model(ModelConfig(model="m", model_path=str(tmp_path)))
    model = load_model(ModelConfig(model="m", model_path=str(tmp_path), max_model_len=24))
    ids = (PROMPT + OTHER + PROMPT)[:24]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    error = (Cache(model, 1, 24).step([0], [ids], [0]) - expected).abs().max().item()
    assert error < LOGIT_ATOL, f"qwen2 windowed: max abs logit error {error:.3g}"


def test_a_checkpoint_missing_a_tensor_the_layout_needs_is_refused(tmp_path: pathlib.Path) -> None:
    """A Qwen3 checkpoint without one layer's k_norm: an error naming it, never a parameter left unfilled."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    write_family_checkpoint("qwen3", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) the model needs: model\.layers\.1\.self_attn\.k_norm"):
        load_model(ModelConfig(model="m", model_path=str(tmp_path)))
