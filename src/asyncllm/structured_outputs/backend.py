"""The grammar engine behind structured outputs: xgrammar (https://github.com/mlc-ai/xgrammar), vLLM's default.

Two stages, as in vLLM's xgrammar backend:
- `check_constraint` (frontend, at submission, no tokenizer): builds the xgrammar `Grammar` of the
  constraint, which parses the schema/regex/EBNF and rejects what xgrammar cannot honour, with the reason.
- `GrammarCompiler.compile` (engine core, in a thread pool): compiles it against the model's vocabulary into a
  `CompiledGrammar` (token-level mask tables; xgrammar caches them by spec).

JSON is generated compactly (`any_whitespace=False`: separators ", " and ": ", no free whitespace), which keeps a
small model from looping on whitespace; vLLM offers the same as `disable_any_whitespace`.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

from asyncllm.errors import InvalidRequestError
from asyncllm.structured_outputs.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

    from asyncllm.model.loading.tokenizer import Tokenizer

_INSTALL_HINT = "structured outputs need xgrammar: pip install 'asyncllm[structured]'"


def import_xgrammar() -> Any:
    """The `xgrammar` module.

    Raises:
        InvalidRequestError: xgrammar is not installed (names the extra to install).
    """
    try:
        import xgrammar
    except ImportError as exc:
        raise InvalidRequestError(_INSTALL_HINT) from exc
    return xgrammar


def preload_xgrammar() -> bool:
    """Import xgrammar now if it is installed (it imports `transformers`: seconds), so the first constrained
    request's check does not pay for it on the event loop. Call it from a worker thread at start-up.

    Returns:
        True when xgrammar is installed (and now imported).
    """
    try:
        import_xgrammar()
    except InvalidRequestError:
        return False
    return True


def check_constraint(params: StructuredOutputsParams) -> None:
    """Check that the constraint is well-formed and supported, without compiling it for a vocabulary.

    Results are cached by `params.key` (a bad spec is re-checked; a good one costs a dict lookup).
    Raises:
        InvalidRequestError: naming the kind and xgrammar's (or the JSON parser's) reason.
    """
    _check_key(params.key)


@functools.lru_cache(maxsize=256)
def _check_key(key: tuple[str, str]) -> None:
    kind, spec = key
    if kind == "json":
        _check_json_schema(spec)
    try:
        build_grammar(import_xgrammar(), kind, spec)
    except InvalidRequestError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the parser's message
        raise InvalidRequestError(f"structured_outputs.{kind} is invalid: {exc}") from exc


def _check_json_schema(spec: str) -> None:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError("structured_outputs.json must be a JSON schema (an object)")
    try:
        import jsonschema
    except ImportError:
        return  # xgrammar's own parser still checks it
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequestError(f"structured_outputs.json is not a valid JSON schema: {exc.message}") from exc


def build_grammar(xgr: Any, kind: str, spec: str) -> xgrammar.Grammar:
    """The xgrammar `Grammar` of a constraint given as `StructuredOutputsParams.key` parts.

    Raises:
        whatever xgrammar raises for a spec it cannot parse or support.
    """
    if kind == "json":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
    if kind == "json_object":  # an object, compact (xgrammar's builtin JSON grammar allows any value, any spacing)
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    raise InvalidRequestError(f"unknown structured output kind {kind!r}")


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string escapes are valid EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def build_tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.TokenizerInfo:
    """xgrammar's view of the model's vocabulary.

    Args:
        tokenizer: the model's tokenizer: byte-level BPE (tokens spelled in GPT-2's byte alphabet) or SentencePiece
            with byte fallback ("▁" for a space, `<0xNN>` byte tokens; `Tokenizer.vocab_type`), without a prefix
            space.
        vocab_size: the model's logits width (49152 for SmolLM2); ids past the tokenizer's vocabulary
            (padding) are never allowed.
    Special tokens (control tokens such as `<|im_start|>`) are given an empty spelling, so xgrammar treats them
    as special and never allows them inside the text; EOS is the stop token (allowed once the grammar may end).
    """
    xgr = import_xgrammar()
    vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
    special = {i for i, token in tokenizer.hf.get_added_tokens_decoder().items() if token.special}
    encoded = [""] * max(len(vocab), max(vocab.values()) + 1)
    for text, token_id in vocab.items():
        encoded[token_id] = "" if token_id in special else text
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    vocab_type = xgr.VocabType.BYTE_FALLBACK if tokenizer.vocab_type == "byte_fallback" else xgr.VocabType.BYTE_LEVEL
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stop, add_prefix_space=False)


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary (thread-safe; xgrammar releases the GIL while compiling).

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the model's logits width.
        max_threads: xgrammar's own compile threads per grammar.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_threads: int = 1) -> None:
        xgr = import_xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(build_tokenizer_info(tokenizer, vocab_size), max_threads=max_threads)

    def compile(self, key: tuple[str, str]) -> xgrammar.CompiledGrammar:
        """Compile the constraint `key` (see `StructuredOutputsParams.key`).

        Raises:
            InvalidRequestError: xgrammar rejects the spec.
        """
        kind, spec = key
        try:
            return self._compiler.compile_grammar(build_grammar(self._xgr, kind, spec))
        except Exception as exc:
            raise InvalidRequestError(f"structured_outputs.{kind} failed to compile: {exc}") from exc

    def new_matcher(self, compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        """A fresh matcher (parser state at the start of the output) for a compiled grammar."""
        return self._xgr.GrammarMatcher(compiled)
