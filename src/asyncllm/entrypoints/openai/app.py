"""The FastAPI app: routes, the engine's lifespan, API-key check and CORS.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/embeddings`, `GET /v1/models`,
`GET /health` (200, or 503 when the engine is dead), `GET /metrics` (Prometheus text of the engine's registry),
`GET /stats` (the scheduler's current counts, JSON), `POST /tokenize`, `POST /detokenize`, `GET /version`; vLLM's
`GET /v1/models/{model}`, `POST /invocations` (the body's shape picks the endpoint) and `GET /load`.
With an API key, every `/v1/` route needs `Authorization: Bearer <key>` (compared in constant time with
`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import importlib.metadata
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncllm.config import EngineArgs
from asyncllm.entrypoints.openai.errors import APIError, api_error_response, install_error_handlers
from asyncllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from asyncllm.entrypoints.openai.responses import ModelCard, ModelList
from asyncllm.entrypoints.openai.serving_base import ServingContext
from asyncllm.entrypoints.openai.serving_chat import create_chat_completion
from asyncllm.entrypoints.openai.serving_completion import create_completion
from asyncllm.entrypoints.openai.serving_embedding import create_embedding
from asyncllm.errors import ConfigError
from asyncllm.lora.checker import LoRAChecker
from asyncllm.lora.request import LoRARequest
from asyncllm.processing.tool_calling import normalize_tools, render_chat
from asyncllm.processing.tool_parsers import get_tool_parser
from asyncllm.structured_outputs.backend import preload_xgrammar

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """How the server runs (the engine's own arguments are in `engine_args`).

    Fields:
        engine_args: the engine to start in the app's lifespan.
        served_model_names: names clients may use for `model`; None = [engine_args.model].
        api_key: when set, `/v1/` routes need `Authorization: Bearer <api_key>`.
        root_path: ASGI root path when the server sits behind a path-prefixing proxy.
        allowed_origins: CORS origins; empty = no CORS headers at all.
        allowed_methods, allowed_headers, allow_credentials: the rest of the CORS policy.
        tool_call_parser: the registered tool parser that reads the model's own calls for `tool_choice="auto"`.
        lora_modules: LoRA adapters served as models: `model` name -> adapter directory (vLLM's `--lora-modules`;
            ids 1, 2, ... in this order; needs `engine_args.enable_lora`). Each is checked at start-up.
        force_include_usage: every stream ends with a usage chunk (vLLM's `--enable-force-include-usage`).
        request_id_headers: answer with `X-Request-Id` (vLLM's `--enable-request-id-headers`).
        return_tokens_as_token_ids: logprobs name tokens "token_id:N" unless a request says otherwise.
        tokenizer_info_endpoint: serve `GET /tokenizer_info` (vLLM's `--enable-tokenizer-info-endpoint`).
    """

    engine_args: EngineArgs = field(default_factory=EngineArgs)
    served_model_names: list[str] | None = None
    api_key: str | None = None
    root_path: str = ""
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    tool_call_parser: str = "hermes"
    lora_modules: dict[str, str] = field(default_factory=dict)
    force_include_usage: bool = False
    request_id_headers: bool = False
    return_tokens_as_token_ids: bool = False
    tokenizer_info_endpoint: bool = False


async def start_engine(args: EngineArgs) -> Any:
    """Start an `AsyncLLM` without blocking the event loop (`AsyncLLM.create`: model resolution and engine
    start-up run in a worker thread).

    Raises:
        InvalidRequestError, ModelNotFoundError, EngineDeadError: as `AsyncLLM.from_engine_args`.
    """
    from asyncllm.async_llm import AsyncLLM

    return await AsyncLLM.create(args)


def build_app(config: ServerConfig, llm: Any = None) -> FastAPI:
    """The app. Without `llm`, the lifespan starts one from `config.engine_args` and shuts it down at exit;
    a given `llm` is used as is and left running."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        get_tool_parser(config.tool_call_parser)  # an unknown name fails the start-up
        engine = llm if llm is not None else await start_engine(config.engine_args)
        await anyio.to_thread.run_sync(preload_xgrammar)  # else the first constrained request imports it on the loop
        app.state.llm = engine
        app.state.ctx = _make_context(config, engine)
        app.state.tokenizer_info = config.tokenizer_info_endpoint
        try:
            yield
        finally:
            if llm is None:
                await engine.shutdown()

    app = FastAPI(title="asyncllm OpenAI-compatible server", root_path=config.root_path, lifespan=lifespan)
    install_error_handlers(app)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=config.allowed_methods,
            allow_headers=config.allowed_headers,
            allow_credentials=config.allow_credentials,
        )
    _add_openai_routes(app)
    _add_ops_routes(app)
    return app


def _make_context(config: ServerConfig, llm: Any) -> ServingContext:
    """The handlers' shared context. The LoRA modules are checked here: a bad adapter (`InvalidRequestError`) or a
    name that is also a served model name (`ConfigError`) fails the start."""
    names = config.served_model_names or [str(config.engine_args.model)]
    lora_modules = {}
    if config.lora_modules:
        checker = LoRAChecker(llm.config.lora)
        for index, (name, path) in enumerate(config.lora_modules.items(), start=1):
            if name in names:
                raise ConfigError(f"--lora-modules name {name!r} is also a served model name")
            lora_modules[name] = checker.check(LoRARequest(name, index, path))
    return ServingContext(
        names=list(names),
        root=str(config.engine_args.model),
        force_include_usage=config.force_include_usage,
        return_tokens_as_token_ids=config.return_tokens_as_token_ids,
        max_model_len=llm.max_model_len,
        tool_parser=config.tool_call_parser,
        lora_modules=lora_modules,
    )


async def _running_llm(request: Request) -> Any:
    """The app's engine, if it still serves.

    Raises:
        EngineDeadError: it died or was shut down (503).
    """
    llm = request.app.state.llm
    await llm.check_health()
    return llm


def _add_openai_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await create_completion(await _running_llm(raw), raw.app.state.ctx, body, raw)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await create_chat_completion(await _running_llm(raw), raw.app.state.ctx, body, raw)

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Any:
        return await create_embedding(await _running_llm(raw), raw.app.state.ctx, body)

    @app.post("/invocations", response_model=None)
    async def invocations(raw: Request) -> Any:
        """SageMaker's route (vLLM's): the body's shape picks the endpoint: `messages` -> chat completions,
        `prompt` -> completions, `input` -> embeddings."""
        body = await raw.json()
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object")
        llm, ctx = await _running_llm(raw), raw.app.state.ctx
        try:
            if "messages" in body:
                return await create_chat_completion(llm, ctx, ChatCompletionRequest.model_validate(body), raw)
            if "prompt" in body:
                return await create_completion(llm, ctx, CompletionRequest.model_validate(body), raw)
            if "input" in body:
                return await create_embedding(llm, ctx, EmbeddingRequest.model_validate(body))
        except ValidationError as error:
            raise RequestValidationError(error.errors()) from error
        raise APIError("cannot tell the endpoint: the body has none of 'messages', 'prompt', 'input'")

    @app.get("/v1/models")
    async def models(raw: Request) -> ModelList:
        ctx: ServingContext = raw.app.state.ctx
        return ModelList(data=[_model_card(ctx, name) for name in ctx.names + list(ctx.lora_modules)])

    @app.get("/v1/models/{model:path}")
    async def model(model: str, raw: Request) -> ModelCard:
        ctx: ServingContext = raw.app.state.ctx
        if model not in ctx.names and model not in ctx.lora_modules:
            raise APIError(
                f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, param="model", code="model_not_found"
            )
        return _model_card(ctx, model)


def _model_card(ctx: ServingContext, name: str) -> ModelCard:
    """vLLM's model card: `root` the model (or the adapter's directory), `parent` the base model for an adapter."""
    lora = ctx.lora_modules.get(name)
    if lora is None:
        return ModelCard(id=name, root=ctx.root, max_model_len=ctx.max_model_len)
    return ModelCard(id=name, root=lora.lora_path, parent=ctx.name, max_model_len=ctx.max_model_len)


def _add_ops_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(raw: Request) -> Response:
        status = HTTPStatus.OK if raw.app.state.llm.is_running else HTTPStatus.SERVICE_UNAVAILABLE
        return Response(status_code=int(status))

    @app.get("/load")
    async def load(raw: Request) -> dict[str, int]:
        """vLLM's server load: the requests being served now."""
        return {"server_load": len(raw.app.state.ctx.in_flight)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("asyncllm")}

    @app.get("/metrics")
    async def metrics(raw: Request) -> Response:
        registry = raw.app.state.llm.prometheus_registry
        if registry is None:
            raise APIError("metrics need prometheus-client (pip install asyncllm[server])", HTTPStatus.NOT_FOUND)
        import prometheus_client

        return Response(prometheus_client.generate_latest(registry), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats(raw: Request) -> dict[str, Any]:
        scheduler_stats = await (await _running_llm(raw)).get_scheduler_stats()
        return {name: getattr(scheduler_stats, name) for name in scheduler_stats.__struct_fields__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, raw: Request) -> dict[str, Any]:
        ctx: ServingContext = raw.app.state.ctx
        ctx.check(body.model)
        tokenizer = raw.app.state.llm.get_tokenizer()
        tokens = _tokenize(tokenizer, body)
        answer: dict[str, Any] = {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len}
        # vLLM's: each token's string in the vocabulary when asked, else null
        answer["token_strs"] = [tokenizer.hf.id_to_token(t) for t in tokens] if body.return_token_strs else None
        return answer

    @app.get("/tokenizer_info")
    async def tokenizer_info(raw: Request) -> dict[str, Any]:
        """vLLM's tokenizer configuration (its `tokenizer_config.json` keys asyncllm knows), only with
        `--enable-tokenizer-info-endpoint` (it shows the chat template)."""
        if not raw.app.state.tokenizer_info:
            raise StarletteHTTPException(HTTPStatus.NOT_FOUND)
        tokenizer = raw.app.state.llm.get_tokenizer()
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "add_bos_token": tokenizer.add_bos_token,
            "chat_template": tokenizer.chat_template,
            "vocab_size": tokenizer.vocab_size,
            "model_max_length": raw.app.state.ctx.max_model_len,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, raw: Request) -> dict[str, str]:
        raw.app.state.ctx.check(body.model)
        tokenizer = raw.app.state.llm.get_tokenizer()
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(f"tokens {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}


def _tokenize(tokenizer: Any, body: TokenizeRequest) -> list[int]:
    """Token ids of `prompt` or of `messages` rendered with the chat template (as generation would see them).

    Raises:
        APIError: neither or both of `prompt` and `messages` given.
    """
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        if body.tools:
            if not body.add_generation_prompt:
                raise APIError("add_generation_prompt=false is not supported with tools yet", param="tools")
            specs = normalize_tools([tool.model_dump(exclude_none=True) for tool in body.tools])
            text = render_chat(tokenizer, messages, specs, body.chat_template_kwargs)
        else:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, template_kwargs=body.chat_template_kwargs
            )
        if body.continue_final_message:
            final = messages[-1]["content"]
            end = text.rfind(final) if final else -1
            if end < 0:
                raise APIError("the final message's text is not in the rendered prompt", param="continue_final_message")
            text = text[: end + len(final)]
        tokens: list[int] = tokenizer.encode(text, add_special_tokens=False)
        return tokens
    assert body.prompt is not None
    tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return tokens


class RequestIdMiddleware:
    """Pure ASGI middleware: every HTTP response carries `X-Request-Id`: the request's own, or a new uuid4 hex
    (vLLM's `--enable-request-id-headers`)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class APIKeyMiddleware:
    """Pure ASGI middleware (streams and disconnects pass through untouched): `/v1/` requests need
    `Authorization: Bearer <api_key>`, compared in constant time (`hmac.compare_digest`); else 401."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and _is_v1(scope):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(
                    "missing or wrong API key",
                    HTTPStatus.UNAUTHORIZED,
                    code="invalid_api_key",
                    err_type="authentication_error",
                )
                await api_error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_v1(scope: Any) -> bool:
    path: str = scope.get("path", "")
    return path.removeprefix(scope.get("root_path", "")).startswith("/v1")
