"""Pooling parameters of one embedding request (`AsyncLLM.encode`), validated at submission.

A msgspec Struct, so it crosses the engine-process boundary without pickle. Names and meaning follow vLLM's
`PoolingParams` (`dimensions`, `normalize`) and its pooler (vllm/model_executor/layers/pooler.py: "last", "mean",
"cls" pooling over the final-norm hidden states of the prompt tokens). vLLM fixes the pooling kind per model;
here each request names it.
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from asyncllm.errors import InvalidRequestError

PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES: tuple[str, ...] = get_args(PoolingType)


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True, gc=False):
    """How one prompt's hidden states become its embedding.

    Fields:
        pooling: "last" (the last prompt token's hidden state), "mean" (the mean over every prompt token) or
            "cls" (the first prompt token's).
        normalize: divide the (truncated) vector by its L2 norm, so it has norm 1.
        dimensions: keep only the first `dimensions` components (Matryoshka truncation, OpenAI's `dimensions`),
            before normalizing; None keeps all `hidden_size`. In [1, hidden_size].
    """

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def validate(self, hidden_size: int | None = None) -> None:
        """Check every field (and `dimensions` against the model's `hidden_size` when known).

        Raises:
            InvalidRequestError: naming the field and what it must be.
        """
        if self.pooling not in POOLING_TYPES:
            raise InvalidRequestError(
                f"PoolingParams.pooling={self.pooling!r} is invalid: must be one of {POOLING_TYPES}"
            )
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"PoolingParams.normalize={self.normalize!r} is invalid: must be a bool")
        dims = self.dimensions
        if dims is None:
            return
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
            raise InvalidRequestError(f"PoolingParams.dimensions={dims!r} is invalid: must be None or an integer >= 1")
        if hidden_size is not None and dims > hidden_size:
            raise InvalidRequestError(
                f"PoolingParams.dimensions={dims} is invalid: the model's hidden size is {hidden_size}"
            )
