"""`/v1/embeddings` of the shared server against the official `openai` client, on the real model."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from openai import AsyncOpenAI

from asyncllm.model.loading.tokenizer import Tokenizer

pytestmark = pytest.mark.mp

MODEL = "smollm2-135m-instruct"
INPUTS = ["The cat sat on the mat.", "Quantum computers use qubits.", "A cat is sitting on a rug."]


def client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


async def test_float_and_base64_give_the_same_normalized_vectors(base_url: str, model_path: str) -> None:
    async with client(base_url) as oai:
        as_float = await oai.embeddings.create(model=MODEL, input=INPUTS, encoding_format="float")
        as_base64 = await oai.embeddings.create(model=MODEL, input=INPUTS)  # the client asks for base64
    assert [d.index for d in as_float.data] == [0, 1, 2]
    floats = np.array([d.embedding for d in as_float.data])
    assert floats.shape == (3, 576)
    np.testing.assert_allclose(np.linalg.norm(floats, axis=1), 1.0, atol=1e-6)
    # Two engine runs: equal up to float32 summation order (the engine may pick another thread count).
    np.testing.assert_allclose(np.array([d.embedding for d in as_base64.data]), floats, rtol=0, atol=1e-5)
    tokenizer = Tokenizer.load(model_path)
    expected_tokens = sum(len(tokenizer.encode(text)) for text in INPUTS)
    assert (as_float.usage.prompt_tokens, as_float.usage.total_tokens) == (expected_tokens, expected_tokens)


async def test_token_ids_and_dimensions(base_url: str, model_path: str) -> None:
    ids = Tokenizer.load(model_path).encode(INPUTS[0])
    async with client(base_url) as oai:
        by_text = await oai.embeddings.create(model=MODEL, input=INPUTS[0], encoding_format="float")
        by_ids = await oai.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
        short = await oai.embeddings.create(model=MODEL, input=INPUTS[0], dimensions=64, encoding_format="float")
    assert len(by_ids.data) == 2
    np.testing.assert_allclose(by_ids.data[0].embedding, by_text.data[0].embedding, atol=1e-5)
    assert len(short.data[0].embedding) == 64
    assert np.linalg.norm(short.data[0].embedding) == pytest.approx(1.0, abs=1e-6)
    full = np.array(by_text.data[0].embedding[:64])
    np.testing.assert_allclose(short.data[0].embedding, full / np.linalg.norm(full), atol=1e-5)


async def test_bad_requests_are_400_naming_the_field(base_url: str) -> None:
    async with client(base_url) as oai:
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            await oai.embeddings.create(model=MODEL, input="hi", dimensions=10_000)
        with pytest.raises(openai.BadRequestError, match="input"):
            await oai.embeddings.create(model=MODEL, input=[])
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{base_url}/v1/embeddings", json={"input": "hi", "pooling": "max"})
    assert response.status_code == 400
    assert "pooling" in response.text
