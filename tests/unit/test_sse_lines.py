"""Server-sent events whose JSON holds characters `str.splitlines` breaks at (`serving_base.sse`).

The failing input: `tests/server/test_server_lifecycle.py` streamed 2000 sampled tokens and read them with httpx's
`aiter_lines`; one chunk's text began with such a character, and the line it read ended inside the JSON string
(`{"id":"cmpl-...","choices":[{"index":0,"text":"`: JSONDecodeError)."""

from __future__ import annotations

import json

import httpx
import pytest

from asyncllm.entrypoints.openai.responses import CompletionChoice, CompletionResponse
from asyncllm.entrypoints.openai.serving_base import sse

BREAKERS = ["\x85", "\u2028", "\u2029"]  # the line breaks of `str.splitlines` that JSON leaves raw


def _chunk(text: str) -> str:
    choice = CompletionChoice(index=0, text=text)
    return CompletionResponse(id="cmpl-1", model="m", choices=[choice]).model_dump_json()


@pytest.mark.parametrize("breaker", BREAKERS)
def test_an_event_reaches_a_splitlines_client_as_one_line_with_the_same_text(breaker: str) -> None:
    text = f"{breaker}Once upon a time{breaker}"
    assert len(("data: " + _chunk(text)).splitlines()) == 3  # pydantic's JSON leaves it raw
    response = httpx.Response(200, content=sse(_chunk(text)).encode())
    lines = [line for line in response.iter_lines() if line]  # as `aiter_lines` splits a streamed body
    assert len(lines) == 1
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == text


def test_other_text_is_unchanged() -> None:
    payload = _chunk('Tab\t, quote " and newline\n, é and 日本')
    assert sse(payload) == f"data: {payload}\n\n"
    assert sse("[DONE]") == "data: [DONE]\n\n"
