"""vLLM's prompt schemas (`vllm.inputs.TextPrompt`, `TokensPrompt`, `EmbedsPrompt`): TypedDicts, so a prompt
built with them is the plain dict `AsyncLLM.generate()` / `encode()` / `LLM.generate()` take.

    from asyncllm.inputs import TokensPrompt
    llm.generate(TokensPrompt(prompt_token_ids=[1, 2, 3]), params)

The keys vLLM gives for multi-modal models (`multi_modal_data`, `mm_processor_kwargs`, `multi_modal_uuids`) and
cross-encoders (`token_type_ids`) are not declared here: asyncllm serves text-only decoder models, and a prompt
carrying them is refused (`InvalidRequestError` naming the key) instead of being run without them.
"""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = ["EmbedsPrompt", "PromptType", "SingletonPrompt", "TextPrompt", "TokensPrompt"]


class _TextPromptKeys(TypedDict):
    prompt: str


class TextPrompt(_TextPromptKeys, total=False):
    """A text prompt, tokenized by the engine's tokenizer (special tokens added, e.g. BOS).

    Keys:
        prompt: the text.
        cache_salt: optional; mixed into the hash of the first KV cache block (as `generate(cache_salt=)`).
    """

    cache_salt: str


class _TokensPromptKeys(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptKeys, total=False):
    """A tokenized prompt, sent as is.

    Keys:
        prompt_token_ids: token ids in [0, vocab_size).
        prompt: optional text of those tokens (shown as `RequestOutput.prompt`; not tokenized).
        cache_salt: optional, as `TextPrompt`'s.
    """

    prompt: str
    cache_salt: str


class _EmbedsPromptKeys(TypedDict):
    prompt_embeds: Any


class EmbedsPrompt(_EmbedsPromptKeys, total=False):
    """A prompt given as input embeddings: a [num_tokens, hidden_size] float32 tensor or array
    (docs/embeddings.md)."""

    cache_salt: str


SingletonPrompt = str | TextPrompt | TokensPrompt | EmbedsPrompt
"""One prompt, as vLLM's `SingletonPrompt` (encoder-decoder prompts are not supported: decoder-only models)."""

PromptType = SingletonPrompt
"""vLLM's `PromptType`; asyncllm's `generate()` also takes a list of chat messages (see `AsyncLLM.generate`)."""
