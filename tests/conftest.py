"""Shared fixtures: the real default model, resolved once per session (downloaded into the user cache), and the
reference models built from it, loaded once per session and shared by every module that compares with them."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest


@pytest.fixture(scope="session")
def model_path() -> str:
    """Local path of the default SmolLM2-135M-Instruct GGUF (fetched once into ~/.cache/asyncllm)."""
    from asyncllm.config import DEFAULT_MODEL
    from asyncllm.model.resolve import resolve_model_path

    return str(resolve_model_path(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def reference_model(model_path: str) -> Any:
    """Our dense fp32 SmolLM2 (`load_model`, TP=1, no engine): greedy margins and logits for many modules.

    Shared by the whole session, so read-only: a test that changes weights works on a `copy.deepcopy` of it.
    """
    from asyncllm.config import ModelConfig
    from asyncllm.model.loader import load_model

    return load_model(ModelConfig(model=model_path, model_path=model_path))


@pytest.fixture(scope="session")
def hf_reference(model_path: str) -> tuple[Any, Any]:
    """HF transformers' tokenizer and fp32 `LlamaForCausalLM` loaded from the same GGUF file (read-only, shared:
    the parity tests use both, the embedding tests its `.model`, the same weights as `AutoModel` would load)."""
    transformers = pytest.importorskip("transformers")
    import torch

    path = pathlib.Path(model_path)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return tok, ref.eval()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the fused int8 kernels (`model/row_kernels.py`, ~20 s once per machine) in the pytest process before any
    test starts an engine, so no engine process that a test stops mid-start can hold the build lock."""
    from asyncllm.model.row_kernels import load_kernels

    load_kernels()
