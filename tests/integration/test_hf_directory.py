"""An HF directory written from the real GGUF, in each config.json generation, gives the GGUF model's greedy ids."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from asyncllm.config import ModelConfig
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.loading.gguf_metadata import read_gguf_header
from asyncllm.model.loading.loader import _iter_gguf_weights, load_model, read_arch_config
from asyncllm.model.loading.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # three loads of the real model (about a minute on a busy 2-core machine)
NUM_TOKENS = 8
BLOCK_SIZE = 16


def _write_hf_dir(model_path: str, path: pathlib.Path, generation: str) -> None:
    """config.json (current: `rope_parameters`, no top-level rope_theta; older: top-level `rope_theta`),
    model.safetensors and tokenizer files, all from the GGUF."""
    from safetensors.torch import save_file

    arch = read_arch_config(model_path)
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "rms_norm_eps": arch.rms_norm_eps,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_id,
    }
    if generation == "current":
        cfg["rope_parameters"] = {"rope_theta": arch.rope_theta, "rope_type": "default"}
    else:
        cfg["rope_theta"], cfg["rope_scaling"] = arch.rope_theta, None
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(
        {
            name: w.contiguous()
            for name, w in _iter_gguf_weights(pathlib.Path(model_path), arch, read_gguf_header(model_path))
        },
        path / "model.safetensors",
    )
    tok = Tokenizer.load(model_path)
    tok.hf.save(str(path / "tokenizer.json"))
    tok_cfg = {"chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))


def _greedy(model: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """NUM_TOKENS greedy ids (each step re-prefills the whole sequence) and the first step's logits."""
    arch, ids, first = model.arch, list(prompt), None
    for _ in range(NUM_TOKENS):
        blocks = -(-len(ids) // BLOCK_SIZE)
        caches = [torch.zeros(blocks, 2, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)] * arch.num_hidden_layers
        meta = build_attention_metadata([len(ids)], [len(ids)], [list(range(blocks))], BLOCK_SIZE)
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
        logits = model.compute_logits(hidden[-1:])[0]
        first = logits if first is None else first
        ids.append(int(logits.argmax()))
    assert first is not None
    return ids[len(prompt) :], first


@pytest.fixture(scope="module")
def prompt(model_path: str) -> list[int]:
    tok = Tokenizer.load(model_path)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))


@pytest.fixture(scope="module")
def gguf_greedy(reference_model: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    return _greedy(reference_model, prompt)  # the session's model loaded from the GGUF file


@pytest.mark.parametrize("generation", ["current", "older"])
def test_hf_directory_matches_gguf(
    model_path: str,
    prompt: list[int],
    gguf_greedy: tuple[list[int], torch.Tensor],
    generation: str,
    tmp_path: pathlib.Path,
) -> None:
    hf_dir = tmp_path / "hf"
    _write_hf_dir(model_path, hf_dir, generation)
    arch = read_arch_config(hf_dir)
    assert (arch.rope_theta, arch.rope_scaling) == (100000.0, None)
    tok = Tokenizer.load(str(hf_dir))
    assert (
        tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])) == prompt
    )
    ids, logits = _greedy(load_model(ModelConfig(model="m", model_path=str(hf_dir))), prompt)
    expected_ids, expected_logits = gguf_greedy
    assert ids == expected_ids
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert "Paris" in tok.decode(ids)
