"""asyncllm `Logprob` dicts -> the two OpenAI logprobs shapes.

Input: `CompletionOutput.logprobs`, one `{token_id: Logprob}` per generated token (the k most likely tokens
plus the sampled one, whose id is the matching entry of `token_ids`). Logprobs are natural logs of the raw
model distribution.
"""

from __future__ import annotations

from asyncllm.entrypoints.openai.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from asyncllm.outputs import Logprob

PositionLogprobs = dict[int, Logprob]


def _token_text(token_id: int, logprob: Logprob, as_ids: bool = False) -> str:
    """A token as the response names it: its text, or "token_id:N" (vLLM's `return_tokens_as_token_ids`)."""
    if as_ids:
        return f"token_id:{token_id}"
    return logprob.decoded_token if logprob.decoded_token is not None else f"<token {token_id}>"


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The k best entries of one position, by rank."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    return ranked[:k]


def to_completion_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], k: int, text_offset: int, as_ids: bool = False
) -> CompletionLogprobs:
    """The legacy completions shape: parallel lists of tokens, their logprobs, top-k dicts and text offsets.

    Args:
        token_ids: the generated token ids these logprobs belong to (same length as `logprobs`).
        k: top alternatives per position (the request's `logprobs`).
        text_offset: character offset of the first token in the choice's text.
        as_ids: name tokens "token_id:N" (vLLM's `return_tokens_as_token_ids`).
    """
    result = CompletionLogprobs()
    offset = text_offset
    for token_id, position in zip(token_ids, logprobs, strict=True):
        sampled = position[token_id]
        text = _token_text(token_id, sampled, as_ids)
        result.tokens.append(text)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({_token_text(t, lp, as_ids): lp.logprob for t, lp in _top(position, k)})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def to_chat_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], k: int, as_ids: bool = False
) -> ChatLogprobs:
    """The chat shape: one entry per token with its bytes and its `k` most likely alternatives (`as_ids`: tokens
    named "token_id:N")."""
    content = []
    for token_id, position in zip(token_ids, logprobs, strict=True):
        sampled = position[token_id]
        text = _token_text(token_id, sampled, as_ids)
        top = [
            TopLogprob(
                token=_token_text(t, lp, as_ids), logprob=lp.logprob, bytes=list(_token_text(t, lp, as_ids).encode())
            )
            for t, lp in _top(position, k)
        ]
        content.append(
            ChatTokenLogprob(token=text, logprob=sampled.logprob, bytes=list(text.encode()), top_logprobs=top)
        )
    return ChatLogprobs(content=content)
