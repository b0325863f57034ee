"""Shared fixtures: the real default model, resolved once per session (downloaded into the user cache)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_path() -> str:
    """Local path of the default SmolLM2-135M-Instruct GGUF (fetched once into ~/.cache/asyncllm)."""
    from asyncllm.config import DEFAULT_MODEL
    from asyncllm.model.resolve import resolve_model_path

    return str(resolve_model_path(DEFAULT_MODEL))
