"""`asyncllm serve gemma-3-270m`: a base model (no chat template) behind the OpenAI API: completions work, chat
completions are a 400 naming the missing template."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from tests.server.server_helpers import console_script, start_server, stop_server

pytestmark = [pytest.mark.mp, pytest.mark.slow]


def test_base_model_completions_and_chat_refusal() -> None:
    server = start_server("gemma-3-270m", "--max-model-len", "1024", "--num-kv-blocks", "64", "--quantization", "none")
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["gemma-3-270m"]
            body = {"model": "gemma-3-270m", "prompt": "The capital of France is", "max_tokens": 9, "temperature": 0}
            done = http.post("/v1/completions", json=body)
            assert done.status_code == 200, done.text
            assert done.json()["choices"][0]["text"].startswith(" the capital of the country of France.")
            chat = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            refused = http.post("/v1/chat/completions", json=chat)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "no chat template" in error["message"]
            assert "--chat-template" in error["message"]
            tokens = http.post("/tokenize", json={"model": "gemma-3-270m", "prompt": "The capital"}).json()
            assert tokens["tokens"][0] == 2  # <bos>
            assert http.get("/health").status_code == 200  # the refusal left the server serving
    finally:
        stop_server(server)


def test_cli_generate_on_the_base_model() -> None:
    """`asyncllm generate --raw` continues the text, and a chat message with `--chat-template` is answered from the
    same tokens. (Chat without a template is refused with a message naming it: in the engine and server tests above;
    the CLI's exit code for any `AsyncLLMError` is checked in `test_cli.py`.)"""

    def generate(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [
            console_script(),
            "generate",
            "--model",
            "gemma-3-270m",
            "--max-tokens",
            "9",
            "--no-engine-process",
            "--quantization",
            "none",
        ]
        return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)

    raw = generate("--raw", "The capital of France is")
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout.startswith(" the capital of the country of France.")
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    templated = generate("--chat-template", template, "The capital of France is")
    assert templated.returncode == 0, templated.stderr
    assert templated.stdout.startswith(" the capital of the country of France.")  # the same text after <bos>
