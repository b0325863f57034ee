"""Gemma 3 with random weights against HF transformers' `Gemma3ForCausalLM` (test-only reference) on a small config
written as an HF directory: local (sliding-window) and global layers with their own rotary bases, a
`query_pre_attn_scalar` unlike head_dim, GQA, random norm weights; prefill, chunked prefill, decode and batching,
on sequences several windows long.

Tolerance: max |logit difference| <= 1e-4 * max |reference logit| (float32 summation order only; a window, norm
or rotary base error is > 1e-1 relative here, `test_the_window_and_local_rope_matter`).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from asyncllm.config import EngineArgs, ModelConfig
from asyncllm.errors import ConfigError
from asyncllm.model.gemma3 import Gemma3ForCausalLM
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.loading.arch_config import check_max_model_len, read_arch_config
from asyncllm.model.loading.loader import load_model

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
WINDOW = 8
TOLERANCE = 1e-4
CONFIG = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 128,
    "query_pre_attn_scalar": 20,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
    },
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    ref = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**CONFIG))
    with torch.no_grad():
        for param in ref.parameters():
            if param.dim() == 1:  # HF initializes norms to 0 (a multiplier of 1): draw them so (1 + w) is tested
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 1 / param.shape[-1] ** 0.5)
    ref.save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")  # not read here
    return path


@pytest.fixture(scope="module")
def reference(hf_dir: pathlib.Path) -> Any:
    return transformers.Gemma3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(hf_dir: pathlib.Path) -> Gemma3ForCausalLM:
    loaded = load_model(ModelConfig(model=str(hf_dir), model_path=str(hf_dir)))
    assert isinstance(loaded, Gemma3ForCausalLM)
    return loaded


def _reference_logits(ref: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


class _Runner:
    """A fresh paged KV cache; each sequence's blocks are contiguous ids, reversed (so block order matters)."""

    def __init__(self, model: Any, num_seqs: int, max_len: int) -> None:
        arch = model.arch
        self.model = model
        self.blocks = -(-max_len // BLOCK_SIZE)
        shape = (num_seqs * self.blocks, 2, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]
        self.seq_lens = [0] * num_seqs

    def step(self, chunks: list[list[int]]) -> list[torch.Tensor]:
        """Run one step with `chunks[i]` new tokens for sequence i; returns each sequence's logits of its chunk."""
        query_lens = [len(c) for c in chunks]
        positions = [p for i, c in enumerate(chunks) for p in range(self.seq_lens[i], self.seq_lens[i] + len(c))]
        self.seq_lens = [s + q for s, q in zip(self.seq_lens, query_lens, strict=True)]
        tables = [list(range((i + 1) * self.blocks - 1, i * self.blocks - 1, -1)) for i in range(len(chunks))]
        meta = build_attention_metadata(query_lens, self.seq_lens, tables, BLOCK_SIZE)
        hidden = self.model(torch.tensor([t for c in chunks for t in c]), torch.tensor(positions), self.kv_caches, meta)
        return list(self.model.compute_logits(hidden).split(query_lens))


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= TOLERANCE * ref.abs().max().item(), f"max |diff| {diff} of max |logit| {ref.abs().max().item()}"


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, CONFIG["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_is_read(hf_dir: pathlib.Path) -> None:
    arch = read_arch_config(hf_dir)
    assert (arch.architecture, arch.sliding_window, arch.hidden_act) == ("gemma3", WINDOW, "gelu_pytorch_tanh")
    assert (arch.rope_theta, arch.rope_local_theta, arch.query_pre_attn_scalar) == (1000.0, 50.0, 20.0)
    assert [arch.layer_window(i) for i in range(6)] == [WINDOW, WINDOW, None] * 2
    check_max_model_len(arch, 128)  # the window is applied: a longer sequence is fine


def test_prefill_matches_transformers(model: Gemma3ForCausalLM, reference: Any) -> None:
    prompts = [_prompt(37, 1), _prompt(5, 2), _prompt(20, 3)]
    runner = _Runner(model, len(prompts), 40)
    for ours, ids in zip(runner.step(prompts), prompts, strict=True):  # one batched step
        _assert_close(ours, _reference_logits(reference, ids))


def test_chunked_prefill_then_decode_matches(model: Gemma3ForCausalLM, reference: Any) -> None:
    prompts = [_prompt(30, 4), _prompt(26, 5)]
    runner = _Runner(model, 2, 32)
    got: list[list[torch.Tensor]] = [[], []]
    for start in range(0, 24, 6):  # chunks of 6 tokens on a growing cached prefix, both sequences batched
        for seq, logits in zip(got, runner.step([p[start : start + 6] for p in prompts]), strict=True):
            seq.append(logits)
    for k in range(24, 26):  # then decode one token per step
        for seq, logits in zip(got, runner.step([[p[k]] for p in prompts]), strict=True):
            seq.append(logits)
    for seq, ids in zip(got, prompts, strict=True):
        _assert_close(torch.cat(seq), _reference_logits(reference, ids[:26]))


def test_batch_equals_solo(model: Gemma3ForCausalLM) -> None:
    long, short = _prompt(33, 6), _prompt(9, 7)
    batched = _Runner(model, 2, 36).step([long, short])
    for ids, logits in zip((long, short), batched, strict=True):
        solo = _Runner(model, 1, 36).step([ids])[0]
        torch.testing.assert_close(logits, solo, rtol=0, atol=1e-5 * solo.abs().max().item())


def test_the_window_and_local_rope_matter(model: Gemma3ForCausalLM, reference: Any) -> None:
    """Without the window (or with the global rotary base on local layers) the logits beyond the window differ by
    far more than the tolerance: the parity above checks both."""
    ids = _prompt(30, 8)
    expected = _reference_logits(reference, ids)
    layers = list(model.layers)
    windows = [layer.window for layer in layers]
    try:
        for layer in layers:
            layer.window = None
        full = _Runner(model, 1, 30).step([ids])[0]
    finally:
        for layer, window in zip(layers, windows, strict=True):
            layer.window = window
    assert (full[:WINDOW] - expected[:WINDOW]).abs().max() <= TOLERANCE * expected.abs().max()  # inside: the same
    assert (full[WINDOW:] - expected[WINDOW:]).abs().max() > 100 * TOLERANCE * expected.abs().max()
    local = [layer.local_rope for layer in layers]
    try:
        for layer in layers:
            layer.local_rope = False
        global_rope = _Runner(model, 1, 30).step([ids])[0]
    finally:
        for layer, flag in zip(layers, local, strict=True):
            layer.local_rope = flag
    assert (global_rope - expected).abs().max() > 100 * TOLERANCE * expected.abs().max()


def test_unsupported_gemma3_configs_are_refused(hf_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    base = json.loads((hf_dir / "config.json").read_text())
    changes: list[tuple[dict[str, Any], str]] = [
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            {
                "rope_parameters": {
                    **CONFIG["rope_parameters"],
                    "full_attention": {"rope_type": "linear", "factor": 8.0},
                }
            },
            "full_attention",
        ),
    ]
    for i, (change, key) in enumerate(changes):
        path = tmp_path / str(i)
        path.mkdir()
        for name in ("model.safetensors", "tokenizer.json"):
            (path / name).symlink_to(hf_dir / name)
        (path / "config.json").write_text(json.dumps({**base, **change}))
        with pytest.raises(ConfigError, match=key):
            read_arch_config(path)


GEMMA2_CONFIG = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,  # sliding, full, sliding, full (HF's default alternation)
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "sliding_window": WINDOW,
    "max_position_embeddings": 128,
    "query_pre_attn_scalar": 24,
    "attn_logit_softcapping": 2.0,  # small caps, so they change these random-weight logits a lot
    "final_logit_softcapping": 3.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
}


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("gemma2")
    torch.manual_seed(1)
    ref = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**GEMMA2_CONFIG))
    with torch.no_grad():
        for param in ref.parameters():
            if param.dim() == 1:
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 1 / param.shape[-1] ** 0.5)
    ref.save_pretrained(path)
    return path


def test_gemma2_matches_transformers(gemma2_dir: pathlib.Path) -> None:
    """Gemma 2 (no q/k norms, one rotary base, attention and final logit soft-capping, alternating windows):
    prefill, chunked prefill + decode, batched, against HF's eager Gemma 2; the caps matter."""
    ref = transformers.Gemma2ForCausalLM.from_pretrained(gemma2_dir, dtype=torch.float32).eval()
    model = load_model(ModelConfig(model=str(gemma2_dir), model_path=str(gemma2_dir)))
    arch = model.arch
    assert (arch.architecture, arch.attn_logit_softcapping, arch.final_logit_softcapping) == ("gemma2", 2.0, 3.0)
    assert [arch.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    prompts = [_prompt(30, 11), _prompt(7, 12)]
    expected = [_reference_logits(ref, ids) for ids in prompts]
    for ours, ref_logits in zip(_Runner(model, 2, 32).step(prompts), expected, strict=True):
        _assert_close(ours, ref_logits)
    runner = _Runner(model, 2, 32)
    first = runner.step([prompts[0][:20], prompts[1][:5]])
    rest = [runner.step([[prompts[0][k]], [prompts[1][5 + k - 20]]]) for k in (20, 21)]
    _assert_close(torch.cat([first[0], rest[0][0], rest[1][0]]), expected[0][:22])
    _assert_close(torch.cat([first[1], rest[0][1], rest[1][1]]), expected[1][:7])
    caps = [layer.softcap for layer in model.layers]
    try:
        for layer in model.layers:
            layer.softcap = None
        uncapped = _Runner(model, 1, 32).step([prompts[0]])[0]
    finally:
        for layer, cap in zip(model.layers, caps, strict=True):
            layer.softcap = cap
    assert (uncapped - expected[0]).abs().max() > 100 * TOLERANCE * expected[0].abs().max()


def test_lora_on_gemma_is_a_config_error(hf_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="enable_lora is not supported for gemma3"):
        EngineArgs(model=str(hf_dir), enable_lora=True, load_format="dummy").create_engine_config()
