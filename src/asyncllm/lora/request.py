"""`LoRARequest`: the adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest` fields).

A msgspec Struct, so it rides on the engine request across the process boundary without pickle. The engine
knows an adapter by `lora_int_id`: one id names one adapter directory for the engine's life (the frontend and
the engine core reject a request that gives a known id another path).
"""

from __future__ import annotations

import os

import msgspec

from asyncllm.errors import InvalidRequestError

MAX_LORA_INT_ID = 2**31 - 1


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A PEFT LoRA adapter to apply to one request.

    Fields:
        lora_name: a label (the server's model name for it); not used to find the adapter.
        lora_int_id: the adapter's id in the engine's adapter cache and prefix cache, an integer >= 1.
        lora_path: a local directory with `adapter_config.json` and `adapter_model.safetensors` (PEFT's
            `save_pretrained` layout); str or `os.PathLike` (stored as str).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_path, os.PathLike):
            self.lora_path = os.fspath(self.lora_path)
        self.validate()

    def validate(self) -> None:
        """Check the field types and ranges (not the directory: see `asyncllm.lora.peft.read_adapter`).

        Raises:
            InvalidRequestError: naming the field.
        """
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(f"LoRARequest.lora_name={self.lora_name!r} is invalid: must be a non-empty str")
        lora_id = self.lora_int_id
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or not 1 <= lora_id <= MAX_LORA_INT_ID:
            raise InvalidRequestError(
                f"LoRARequest.lora_int_id={lora_id!r} is invalid: must be an integer in [1, {MAX_LORA_INT_ID}]"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError(f"LoRARequest.lora_path={self.lora_path!r} is invalid: must be a non-empty path")
