"""`POST /v1/embeddings`: an `EmbeddingRequest` -> `AsyncLLM.encode()` -> OpenAI's embeddings list.

Every input becomes one embedding request, all submitted together (so they share engine steps); the vectors
come back in input order. "base64" encodes each vector's little-endian float32 bytes, the format the official
`openai` client asks for by default and decodes.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from asyncllm.entrypoints.openai.errors import APIError
from asyncllm.entrypoints.openai.protocol import EmbeddingRequest
from asyncllm.entrypoints.openai.responses import EmbeddingData, EmbeddingResponse, EmbeddingUsage, make_id
from asyncllm.entrypoints.openai.serving_base import ServingContext
from asyncllm.outputs import PoolingRequestOutput
from asyncllm.pooling_params import PoolingParams
from asyncllm.processing.input_processor import PromptType


def embedding_prompts(request: EmbeddingRequest) -> list[PromptType]:
    """The request's inputs as `AsyncLLM.encode()` prompts.

    Raises:
        APIError: 400 for an empty input list.
    """
    inputs = request.input
    if not isinstance(inputs, list):
        return [inputs]
    if not inputs:
        raise APIError("input is empty", param="input")
    if isinstance(inputs[0], int):
        return [{"prompt_token_ids": inputs}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in inputs]


async def create_embedding(llm: Any, ctx: ServingContext, request: EmbeddingRequest) -> EmbeddingResponse:
    """Serve one embeddings request.

    Raises:
        APIError: unknown model, empty input (400).
        InvalidRequestError: bad `dimensions`, empty or too long input (400 via the error handlers).
        EngineDeadError: the engine is dead (503).
    """
    model = ctx.check(request.model)
    prompts = embedding_prompts(request)
    params = PoolingParams(pooling=request.pooling, normalize=request.normalize, dimensions=request.dimensions)
    request_id = make_id("embd")
    ids = [f"{request_id}-{i}" for i in range(len(prompts))]  # what `encode` names a list's requests
    ctx.in_flight.update(ids)  # graceful shutdown aborts them after the grace period
    try:
        outputs: list[PoolingRequestOutput] = await llm.encode(prompts, params, request_id=request_id)
    finally:
        ctx.in_flight.difference_update(ids)
    num_prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return EmbeddingResponse(
        id=request_id,
        model=model,
        data=[
            EmbeddingData(index=i, embedding=_encode_vector(out.embedding, request.encoding_format))
            for i, out in enumerate(outputs)
        ],
        usage=EmbeddingUsage(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens),
    )


def _encode_vector(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding
