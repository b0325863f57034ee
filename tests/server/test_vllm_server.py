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
    flags += ["--shutdown-timeout", "5", "--num-kv-blocks", "64", "--enable-auto-tool-choice"]
    flags += ["--enable-force-include-usage", "--enable-request-id-headers", "--return-tokens-as-token-ids"]
    flags += ["--enable-tokenizer-info-endpoint"]
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
        chunks = [chunk async for chunk in stream if chunk.choices]  # the server adds a usage chunk
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


def test_invocations_routes_by_the_bodys_shape(server: ServerProcess) -> None:
    chat = post(server, "/invocations", {"messages": MESSAGES, "max_tokens": 3})
    completion = post(server, "/invocations", {"prompt": PROMPT, "max_tokens": 3})
    embedding = post(server, "/invocations", {"input": PROMPT})
    neither = post(server, "/invocations", {"text": PROMPT})
    bad = post(server, "/invocations", {"prompt": PROMPT, "max_tokens": "many"})
    assert (chat.status_code, chat.json()["object"]) == (200, "chat.completion")
    assert (completion.status_code, completion.json()["object"]) == (200, "text_completion")
    assert (embedding.status_code, embedding.json()["object"]) == (200, "list")
    assert neither.status_code == 400
    assert "messages" in neither.json()["error"]["message"]
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "max_tokens")


def test_load_tokenize_token_strs_and_request_id_headers(server: ServerProcess) -> None:
    load = httpx.get(f"{server.base_url}/load", timeout=30)
    assert load.json() == {"server_load": 0}
    tokenized = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokenized["token_strs"] == ["Hello", "Ġworld"]  # byte-level BPE's vocabulary strings
    assert len(tokenized["tokens"]) == 2
    given = httpx.get(f"{server.base_url}/version", headers={"X-Request-Id": "abc-123"}, timeout=30)
    made = httpx.get(f"{server.base_url}/version", timeout=30)
    assert given.headers["x-request-id"] == "abc-123"
    assert len(made.headers["x-request-id"]) == 32


async def test_force_include_usage_and_tokens_as_token_ids(server: ServerProcess) -> None:
    async with oai(server) as client:
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stream=True)
        chunks = [chunk async for chunk in stream]
        as_ids = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1)
        as_text = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=2,
            temperature=0,
            logprobs=1,
            extra_body={"return_tokens_as_token_ids": False, "return_token_ids": True},
        )
    assert chunks[-1].usage is not None  # no stream_options asked for it: --enable-force-include-usage
    assert chunks[-1].usage.completion_tokens == 3
    ids = as_text.choices[0].model_extra["token_ids"]
    assert as_ids.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert (
        as_text.choices[0].logprobs.tokens[0] == as_text.choices[0].text[: len(as_text.choices[0].logprobs.tokens[0])]
    )


def test_lora_modules_take_vllms_json_form() -> None:
    from asyncllm.entrypoints.cli import make_parser

    spec = json.dumps({"name": "sql", "path": "/adapters/sql", "base_model_name": MODEL})
    ns = make_parser().parse_args(["serve", "--lora-modules", spec, "math=/adapters/math"])
    assert ns.lora_modules == [("sql", "/adapters/sql"), ("math", "/adapters/math")]
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--lora-modules", '{"name": "x"}'])


def test_continuous_usage_stats_needs_include_usage() -> None:
    from asyncllm.entrypoints.openai.protocol import CompletionRequest

    alone = CompletionRequest(prompt="x", stream=True, stream_options={"continuous_usage_stats": True})
    both = CompletionRequest(
        prompt="x", stream=True, stream_options={"continuous_usage_stats": True, "include_usage": True}
    )
    assert (alone.continuous_usage_stats, both.continuous_usage_stats) == (False, True)


async def test_prompt_logprobs_in_vllms_shape(server: ServerProcess) -> None:
    async with oai(server) as client:
        completion = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2, "return_token_ids": True}
        )
        chat = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": 0}
        )
        with pytest.raises(openai.BadRequestError, match="greater than max allowed: 30"):
            await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": -1}
            )
    extra = completion.choices[0].model_extra
    positions, ids = extra["prompt_logprobs"], extra["prompt_token_ids"]
    assert len(positions) == len(ids)
    assert positions[0] is None
    for token_id, position in zip(ids[1:], positions[1:], strict=True):
        assert next(iter(position)) == str(token_id)  # the prompt token first, then the top 2
        assert 2 <= len(position) <= 3
        assert all(entry["logprob"] <= 0 and entry["rank"] >= 1 for entry in position.values())
    chat_positions = chat.model_extra["prompt_logprobs"]
    assert chat_positions[0] is None
    assert len(chat_positions) == chat.usage.prompt_tokens
    assert all(len(p) == 1 for p in chat_positions[1:])


async def test_chat_continue_final_message_and_echo(server: ServerProcess) -> None:
    started = "The capital of France is"
    messages = [*MESSAGES, {"role": "assistant", "content": started}]
    closed = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["count"]
    async with oai(server) as client:
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=3,
            temperature=0,
            extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True},
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=3,
            temperature=0,
            stream=True,
            extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True},
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        with pytest.raises(openai.BadRequestError, match="Cannot set both `continue_final_message`"):
            await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=3, extra_body={"continue_final_message": True}
            )
    content = reply.choices[0].message.content
    assert content.startswith(started)
    assert len(content) > len(started)
    assert streamed == content
    end_of_turn = len(
        post(server, "/tokenize", {"prompt": "<|im_end|>\n", "add_special_tokens": False}).json()["tokens"]
    )
    assert reply.usage.prompt_tokens == closed - end_of_turn  # the final message left open


async def test_completions_take_structured_outputs_and_response_format(server: ServerProcess) -> None:
    async with oai(server) as client:
        choice = await client.completions.create(
            model=MODEL,
            prompt="Is the sky blue? Answer:",
            max_tokens=5,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        shaped = await client.completions.create(
            model=MODEL,
            prompt="The capital of France as JSON:",
            max_tokens=40,
            temperature=0,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}},
        )
    assert choice.choices[0].text in ("yes", "no")
    assert isinstance(json.loads(shaped.choices[0].text)["city"], str)


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


async def test_tokenize_and_chat_take_tools_with_chat_template_kwargs(server: ServerProcess) -> None:
    def count(**fields: object) -> int:
        return int(post(server, "/tokenize", {"messages": MESSAGES, **fields}).json()["count"])

    plain, with_tools = count(), count(tools=[TOOL])
    no_thinking = count(tools=[TOOL], chat_template_kwargs={"enable_thinking": False})
    think_tokens = len(post(server, "/tokenize", {"prompt": "<think>\n\n</think>\n\n"}).json()["tokens"])
    assert with_tools > plain  # the tools' system prompt
    assert no_thinking == with_tools + think_tokens
    async with oai(server) as client:
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=2,
            tools=[TOOL],
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
    assert reply.usage.prompt_tokens == no_thinking
    opened = post(
        server,
        "/tokenize",
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "The capital"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": opened}).json()["prompt"]
    assert text.endswith("assistant\nThe capital")


def test_tokenizer_info_endpoint(server: ServerProcess) -> None:
    info = httpx.get(f"{server.base_url}/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] == "Tokenizer"
    assert info["chat_template"] == TEMPLATE  # the --chat-template in use
    assert info["eos_token"] == "<|im_end|>"
    assert info["vocab_size"] == 49152
    plain = post(server, "/tokenize", {"prompt": "Hi"}).json()
    assert plain["token_strs"] is None  # vLLM sends null unless asked
