"""`asyncllm serve` started as a vLLM deployment would start it (`VLLM_API_KEY` in the environment, `--dtype`,
`--enforce-eager`, `--max-logprobs`, `--chat-template`, `--shutdown-timeout`), answering vLLM's request fields and
endpoints, checked with the `openai` client and raw HTTP (docs/vllm_compat.md lists each row)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.server.server_helpers import ServerProcess, console_script, start_server, stop_server

pytestmark = pytest.mark.mp

KEY = "vllm-style-secret"
MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# The model's own template shape, plus a marker (to see it is used) and Qwen3's `enable_thinking` switch.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    "{# CUSTOM #}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    flags = ["--dtype", "float32", "--enforce-eager", "--max-logprobs", "30", "--chat-template", str(template)]
    flags += ["--shutdown-timeout", "5", "--num-kv-blocks", "64"]
    os.environ["VLLM_API_KEY"] = KEY  # inherited by the server process
    try:
        proc = start_server(*flags)
    finally:
        del os.environ["VLLM_API_KEY"]
    yield proc
    stop_server(proc)


def oai(server: ServerProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_vllm_api_key_in_the_environment_is_the_api_key(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


async def test_models_by_name_and_cards_with_root_and_parent(server: ServerProcess) -> None:
    async with oai(server) as client:
        card = await client.models.retrieve(MODEL)
        listed = await client.models.list()
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("no-such-model")
    assert card.id == MODEL
    assert card.model_extra == {"root": MODEL, "parent": None, "max_model_len": card.model_extra["max_model_len"]}
    assert [m.id for m in listed.data] == [MODEL]
    assert listed.data[0].model_extra["root"] == MODEL
    assert missing.value.status_code == 404
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_unknown_routes_answer_an_openai_error_body(server: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    missing = httpx.get(f"{server.base_url}/v1/no-such-route", headers=auth, timeout=30)
    wrong_method = httpx.get(f"{server.base_url}/v1/completions", headers=auth, timeout=30)
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": "Invalid URL (GET /v1/no-such-route)",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["message"] == "Invalid URL (GET /v1/completions)"


async def test_stream_options_without_stream_is_a_400(server: ServerProcess) -> None:
    async with oai(server) as client:
        with pytest.raises(openai.BadRequestError, match="Stream options can only be defined when `stream=True`"):
            await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2, stream_options={"include_usage": True}
            )


async def test_completions_echo_and_return_token_ids(server: ServerProcess) -> None:
    async with oai(server) as client:
        plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
        echoed = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, extra_body={"return_token_ids": True}
        )
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            echo=True,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        chunks = [chunk async for chunk in stream]
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    tokenized = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    extra = echoed.choices[0].model_extra
    assert extra["prompt_token_ids"] == tokenized
    assert len(extra["token_ids"]) == echoed.usage.completion_tokens == 5
    assert extra["prompt_logprobs"] is None  # vLLM sends null
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == tokenized
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == extra["token_ids"]


async def test_completions_allowed_token_ids_and_truncate_prompt_tokens(server: ServerProcess) -> None:
    allowed = post(server, "/tokenize", {"prompt": " yes no maybe"}).json()["tokens"]
    async with oai(server) as client:
        constrained = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=1.0,
            seed=1,
            extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
        )
        truncated = await client.completions.create(
            model=MODEL,
            prompt="one two three four five six seven eight",
            max_tokens=2,
            extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True},
        )
    assert set(constrained.choices[0].model_extra["token_ids"]) <= set(allowed)
    assert truncated.usage.prompt_tokens == 3
    full = post(server, "/tokenize", {"prompt": "one two three four five six seven eight"}).json()["tokens"]
    assert truncated.choices[0].model_extra["prompt_token_ids"] == full[-3:]


async def test_max_logprobs_flag_raises_the_limit(server: ServerProcess) -> None:
    async with oai(server) as client:
        wide = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=25)
        with pytest.raises(openai.BadRequestError, match="greater than max allowed: 30"):
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=31)
    assert len(wide.choices[0].logprobs.top_logprobs[0]) == 25


async def test_chat_template_flag_and_chat_template_kwargs(server: ServerProcess) -> None:
    rendered = post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": rendered}).json()["prompt"]
    # the --chat-template file's rendering (special tokens dropped by /detokenize): no system prompt, which the
    # model's own template adds
    assert text == "user\nWhat is the capital of France?\nassistant\n"
    async with oai(server) as client:
        default = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
        no_thinking = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set"):
            await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=4,
                extra_body={"chat_template_kwargs": {"messages": []}},
            )
    think_tokens = len(post(server, "/tokenize", {"prompt": "<think>\n\n</think>\n\n"}).json()["tokens"])
    assert no_thinking.usage.prompt_tokens == default.usage.prompt_tokens + think_tokens
    assert default.usage.prompt_tokens == len(rendered)


def test_an_unsupported_dtype_fails_serve_at_once_naming_it() -> None:
    result = subprocess.run(
        [console_script(), "serve", "--dtype", "bfloat16", "--port", "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "ConfigError" in result.stderr
    assert "dtype='bfloat16' is not supported" in result.stderr


def test_shutdown_timeout_is_the_grace_period() -> None:
    from asyncllm.entrypoints.cli import make_parser

    ns = make_parser().parse_args(["serve", "--shutdown-timeout", "7", "--enforce-eager", "--max-logprobs", "5"])
    assert ns.grace_period == 7.0
    assert (ns.enforce_eager, ns.max_logprobs) == (True, 5)
    assert json.dumps(ns.chat_template) == "null"
