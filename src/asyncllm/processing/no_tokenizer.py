"""The tokenizer stand-in of an engine started with `EngineArgs(skip_tokenizer_init=True)` (vLLM's switch): token
ids in, token ids out, nothing loaded. Everything that needs text raises `InvalidRequestError` saying so."""

from __future__ import annotations

from typing import Any, NoReturn

from asyncllm.errors import InvalidRequestError


class NoTokenizer:
    """Carries the EOS id (from the checkpoint's metadata) and refuses every text operation.

    Attributes:
        eos_token_id: the model's EOS id, or None.
        hf: None (no `tokenizers.Tokenizer`: outputs are not detokenized).
    """

    hf: Any = None

    def __init__(self, eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> NoReturn:
        _refuse("text")

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> NoReturn:
        _refuse("chat messages")

    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> NoReturn:
        _refuse("decoding")


def _refuse(what: str) -> NoReturn:
    raise InvalidRequestError(
        f"{what} need a tokenizer, and this engine was started with skip_tokenizer_init=True: send token ids "
        "({'prompt_token_ids': [...]}, asyncllm.inputs.TokensPrompt); outputs carry token ids only"
    )
