"""`LoRAChecker`: the submission-time check of a request's `lora_request` (frontend and engine core).

The frontend checks the adapter directory's config and tensor header (`peft.read_adapter`) without the model's
shapes (it never imports torch); the engine core checks again with them, so an adapter that does not fit the model
fails its request alone instead of a worker's step. Both keep each adapter id's path: one id names one adapter.
"""

from __future__ import annotations

import os

import msgspec

from asyncllm.engine_config import LoRAConfig
from asyncllm.errors import InvalidRequestError
from asyncllm.lora.peft import read_adapter
from asyncllm.lora.request import LoRARequest


class LoRAChecker:
    """Checks `lora_request`s against an engine's LoRA settings.

    Args:
        lora_config: the engine's `LoRAConfig`; None = the engine was started without `enable_lora`.
        module_shapes: the model's (in, out) per module path (`peft.model_module_shapes`); None skips shapes.
        num_layers: the model's decoder layers; None skips the layer check.
    """

    def __init__(
        self,
        lora_config: LoRAConfig | None,
        module_shapes: dict[str, tuple[int, int]] | None = None,
        num_layers: int | None = None,
    ) -> None:
        self.lora_config = lora_config
        self.module_shapes = module_shapes
        self.num_layers = num_layers
        self._paths: dict[int, str] = {}  # lora_int_id -> the directory it was first checked with

    def check(self, lora_request: object) -> LoRARequest:
        """The request's adapter with an absolute `lora_path`, after reading and checking its directory.

        Raises:
            InvalidRequestError: LoRA is off, not a `LoRARequest`, bad fields, an id already used with another
                path, or a missing, malformed or refused adapter (naming the field or file).
        """
        if self.lora_config is None:
            raise InvalidRequestError("lora_request needs an engine started with EngineArgs(enable_lora=True)")
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, not {type(lora_request).__name__}")
        lora_request.validate()
        path = os.path.abspath(lora_request.lora_path)
        known = self._paths.get(lora_request.lora_int_id)
        if known is not None and known != path:
            raise InvalidRequestError(
                f"LoRARequest.lora_int_id={lora_request.lora_int_id} already names the adapter at {known!r}, "
                f"not {path!r}: give each adapter its own id"
            )
        read_adapter(path, self.lora_config.max_lora_rank, self.module_shapes, self.num_layers)
        self._paths[lora_request.lora_int_id] = path
        if path == lora_request.lora_path:
            return lora_request
        return msgspec.structs.replace(lora_request, lora_path=path)
