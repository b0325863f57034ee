"""`Tokenizer`: a `tokenizers.Tokenizer` built from GGUF metadata or an HF directory, plus the chat template.

From a GGUF file (`tokenizer.ggml.model == "gpt2"`, byte-level BPE) the tokenizer is rebuilt the way HF
`transformers` does it in `integrations/gguf/gguf_tokenizer_mapping.py` (v5), so token ids match
`AutoTokenizer.from_pretrained(dir, gguf_file=name)`:
- BPE over the file's tokens (re-spelled into the byte-level alphabet if needed) and merges, no unk token;
- pre-tokenization by `tokenizer.ggml.pre` (`PRE_TOKENIZATIONS`; the names llama.cpp's `llama-vocab.cpp` reads):
  the family's `Split` regex then `ByteLevel(use_regex=False)`, or the plain GPT-2
  `ByteLevel(add_prefix_space=False, use_regex=True)`; NFC first for Qwen2/Qwen3 ("qwen2") and `ignore_merges` for
  Llama 3 ("llama-bpe"), as their tokenizer.json files have them; decoder `ByteLevel`. A missing or unknown name
  is a `ConfigError` (llama.cpp would fall back to a "default" split and warn of degraded quality). Checked
  against each family's tokenizer.json (`tests/unit/test_gguf_tokenizers.py`);
- tokens typed CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens, so
  `<|im_start|>` / `<|im_end|>` are matched whole in text;
- BOS/EOS are added only if `tokenizer.ggml.add_bos_token` / `add_eos_token` say so (SmolLM2: neither).

From a GGUF file of a Gemma architecture with `tokenizer.ggml.model == "llama"` (SentencePiece BPE with byte
fallback, as in Gemma 3) it is rebuilt the way transformers' `gemma_tokenizer` does (same module), so ids match:
- a BPE model over the file's tokens, with a whitespace-only token holding a space spelled as that many "▁", byte
  fallback (`<0xNN>` tokens) and the file's unknown token;
- the file has no merges: they are derived from the vocabulary. Every split of a token t into two tokens
  (l, r) is a merge; merges rank by t's position in the file (earlier first; Gemma's scores do not follow its
  merge order), then by a longer l first;
- normalizer: " " -> "▁"; no space is prepended (`add_space_prefix` must be false); decoder: "▁" -> " ", byte
  fallback, fuse;
- CONTROL tokens special, USER_DEFINED plain added tokens; BOS per `add_bos_token`, as for "gpt2".
Incremental detokenization (`processing/detokenizer.py`'s `DecodeStream`) holds back a partial UTF-8 sequence of
byte-fallback tokens, as it does for byte-level BPE.

Known difference from the true SmolLM2 tokenizer: its `tokenizer.json` (pre-tokenizer `smollm` in llama.cpp, which
means the same) splits digits individually (`Digits(individual_digits=True)` before `ByteLevel`), so "2024" is 4
tokens there. transformers has no entry for `smollm` and falls back to the GPT-2 regex, which keeps runs of
digits together (" 2024" may be one or two tokens). We match transformers, as required; prompts with numbers
therefore tokenize slightly differently from the original model's tokenizer.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.model.loading.gguf_metadata import read_gguf_metadata

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_SPACE_MARK = "\u2581"  # SentencePiece's visible space "▁"
# GGUF architectures whose "llama" (SentencePiece) tokenizer is built as Gemma's (`_sentencepiece_bpe`).
SENTENCEPIECE_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# OpenAI's o200k split (Phi-4-mini's tokenizer.json; llama.cpp's GPT4O pre-tokenizer, before its rewrite for
# its own regex engine): cased words with an optional contraction, digits in threes, "/" kept with punctuation.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenization:
    """What a GGUF `tokenizer.ggml.pre` name means for byte-level BPE, as the family's own tokenizer.json does it.

    Fields:
        split: the `Split` regex (behaviour "isolated") run before the byte-level mapping; None: the GPT-2 regex of
            `ByteLevel(use_regex=True)`.
        nfc: the text is NFC-normalized first (Qwen2's and Qwen3's tokenizer.json).
        ignore_merges: a pre-token spelled exactly as a vocabulary token is that token, whatever the merges say
            (Llama 3's tokenizer.json `"ignore_merges": true`; llama.cpp sets it for the same names).
    """

    split: str | None
    nfc: bool = False
    ignore_merges: bool = False


# `tokenizer.ggml.pre` -> its pre-tokenization (names as llama.cpp's `llama-vocab.cpp` reads them and
# `convert_hf_to_gguf.py` writes them). Anything else, or no name at all, is refused: a wrong split changes the ids.
PRE_TOKENIZATIONS: dict[str, PreTokenization] = {
    # GPT-2's own regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2 names of byte-level models).
    "gpt-2": PreTokenization(None),
    "phi-2": PreTokenization(None),
    # Llama 3 (3.0-3.3; llama.cpp's LLAMA3 group, ignore_merges as in their tokenizer.json).
    "llama3": PreTokenization(_LLAMA3_SPLIT, ignore_merges=True),
    "llama-v3": PreTokenization(_LLAMA3_SPLIT, ignore_merges=True),
    "llama-bpe": PreTokenization(_LLAMA3_SPLIT, ignore_merges=True),
    "smaug-bpe": PreTokenization(_LLAMA3_SPLIT),
    # Qwen2, Qwen2.5, Qwen3 (their tokenizer.json: NFC, then the split, digits one by one).
    "qwen2": PreTokenization(_QWEN2_SPLIT, nfc=True),
    # DeepSeek-R1 distilled into Qwen2.5: Qwen's split (transformers' GGUF mapping and llama.cpp's QWEN2 group),
    # without NFC as llama.cpp runs it; not checked against the model's own tokenizer.json (none on this machine).
    "deepseek-r1-qwen": PreTokenization(_QWEN2_SPLIT),
    # Phi-4-mini.
    "gpt-4o": PreTokenization(_GPT4O_SPLIT),
    # SmolLM/SmolLM2 (the default model): the GPT-2 regex, as transformers loads such a file. llama.cpp and the
    # model's own tokenizer.json split digits one by one first (see the module docstring).
    "smollm": PreTokenization(None),
}


class Tokenizer:
    """Text <-> token ids for one model, and its chat template.

    Attributes:
        hf: the underlying `tokenizers.Tokenizer` (use it with `tokenizers.decoders.DecodeStream`).
        vocab_size: size of the vocabulary including added tokens.
        bos_token_id, eos_token_id: special ids, None when the model has none.
        chat_template: Jinja2 chat template source, None when the model has none.
        add_bos_token: whether `encode(..., add_special_tokens=True)` prepends BOS.
        vocab_type: how tokens spell text: "byte_level" (GPT-2's byte alphabet) or "byte_fallback" (SentencePiece:
            "▁" for a space, `<0xNN>` tokens for bytes), for the structured-output backend.
    """

    def __init__(
        self,
        hf: HFTokenizer,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
        add_bos_token: bool,
        vocab_type: str = "byte_level",
    ) -> None:
        self.hf = hf
        self.vocab_type = vocab_type
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token

    @classmethod
    def load(cls, model_path: str, gguf_metadata: dict[str, Any] | None = None) -> Tokenizer:
        """Load from a `.gguf` file's metadata (`gguf_metadata`: that metadata already read, not read again) or from
        an HF directory (tokenizer.json + tokenizer_config.json).

        Raises:
            ConfigError: a byte-level BPE GGUF whose `tokenizer.ggml.pre` is missing or not in `PRE_TOKENIZATIONS`.
            ValueError: the GGUF tokenizer type is neither byte-level BPE ("gpt2") nor, for a Gemma architecture,
                SentencePiece ("llama") without a space prefix; or the path is neither.
        """
        path = pathlib.Path(model_path)
        if path.is_file() and path.suffix.lower() == ".gguf":
            return _load_gguf(path, gguf_metadata)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            return _load_hf_dir(path)
        raise ValueError(f"{model_path}: not a .gguf file or a directory with tokenizer.json")

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.hf.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.hf.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognized whole.

        `add_special_tokens` adds BOS (and EOS) only where the model asks for them (`add_bos_token`).
        Uses `encode_batch`, which releases the GIL while the Rust tokenizer runs (`encode` holds it, so a long
        prompt tokenized in a worker thread would still stall the event loop; `benchmarks/analysis.md`, "Long
        prompts").
        """
        return list(self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped when `skip_special_tokens`."""
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render chat messages into a prompt string with the model's template.

        Rendered in a Jinja2 immutable sandbox with the globals HF templates expect (`raise_exception`,
        `strftime_now`, a `tojson` filter that does not escape HTML, `bos_token`, `eos_token`); `tools` (OpenAI
        tool dicts) is passed as the template's `tools` variable, as HF `transformers` does. `template_kwargs`
        (vLLM's `chat_template_kwargs`, e.g. `{"enable_thinking": False}`) are more template variables; they may
        not redefine the ones above.

        Raises:
            InvalidRequestError: the model has no chat template, the template rejects the messages, or
                `template_kwargs` redefines a reserved variable.
        """
        reserved = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}
        clash = sorted(reserved & set(template_kwargs or {}))
        if clash:
            raise InvalidRequestError(f"chat_template_kwargs may not set {clash}: use the request's own fields")
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template (a base model): send a text prompt (generate(), /v1/completions), "
                "or give a template with EngineArgs(chat_template=...) / --chat-template"
            )
        try:
            return _compile_template(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **(template_kwargs or {}),
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}") from exc


def _load_gguf(path: pathlib.Path, meta: dict[str, Any] | None = None) -> Tokenizer:
    meta = meta if meta is not None else read_gguf_metadata(path)
    kind, arch = meta.get("tokenizer.ggml.model"), meta.get("general.architecture")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if kind == "gpt2":
        pre = pre_tokenization(meta.get("tokenizer.ggml.pre"), path)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        hf = _byte_level_bpe(tokens, meta["tokenizer.ggml.merges"], pre.ignore_merges)
        if pre.nfc:
            hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = _pre_tokenizer(pre)
        hf.decoder = decoders.ByteLevel()
        _add_typed_tokens(hf, tokens, token_types)
    elif kind == "llama" and arch in SENTENCEPIECE_ARCHITECTURES:
        if meta.get("tokenizer.ggml.add_space_prefix", False):
            raise ValueError(f"{path}: tokenizer.ggml.add_space_prefix=true is not supported (Gemma adds none)")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None  # llama.cpp's default
        hf = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.unknown_token_id"))
        _add_sentencepiece_typed_tokens(hf, tokens, token_types)
    else:
        raise ValueError(
            f"{path}: tokenizer type {kind!r} unsupported for architecture {arch!r}; need 'gpt2', or 'llama' "
            f"(SentencePiece) for {sorted(SENTENCEPIECE_ARCHITECTURES)}"
        )
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    hf.post_processor = _bos_eos_processor(tokens, bos if add_bos else None, eos if add_eos else None)
    vocab_type = "byte_level" if kind == "gpt2" else "byte_fallback"
    return Tokenizer(hf, bos, eos, meta.get("tokenizer.chat_template"), add_bos, vocab_type)


def _sentencepiece_bpe(tokens: list[str], unk_id: int | None) -> HFTokenizer:
    """Gemma's SentencePiece BPE (byte fallback) from GGUF tokens, with merges derived from the vocabulary."""
    spelled = [_SPACE_MARK * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    unk = None if unk_id is None else spelled[unk_id]
    model = models.BPE(
        vocab=vocab, merges=_derive_merges(spelled, vocab), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    hf = HFTokenizer(model)
    hf.normalizer = normalizers.Replace(" ", _SPACE_MARK)
    hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # as transformers' GemmaTokenizer
    hf.decoder = decoders.Sequence([decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    return hf


def _derive_merges(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split (l, r) of a token into two vocabulary tokens, ranked by the token's position (the last one when a
    spelling repeats, as `vocab` keeps), then by a longer l first."""
    merges: list[tuple[str, str]] = []
    for index, token in enumerate(tokens):
        if vocab[token] != index:
            continue
        merges.extend(
            (token[:cut], token[cut:])
            for cut in range(len(token) - 1, 0, -1)
            if token[:cut] in vocab and token[cut:] in vocab
        )
    return merges


def _add_sentencepiece_typed_tokens(hf: HFTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """CONTROL tokens -> special added tokens; USER_DEFINED ones spelled as in the vocabulary -> plain added tokens
    (both matched whole; a whitespace-only one, respelled with "▁", is left to the model, as transformers does)."""
    control = [t for t, k in zip(tokens, token_types, strict=True) if k == _CONTROL]
    vocab = hf.get_vocab()
    user = [t for t, k in zip(tokens, token_types, strict=True) if k == _USER_DEFINED and t in vocab]
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    hf.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (Radford et al., 2019, `bytes_to_unicode`)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_level_bpe(tokens: list[str], merges: list[str], ignore_merges: bool = False) -> HFTokenizer:
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore_merges)  # type: ignore[arg-type]
    return HFTokenizer(model)


def pre_tokenization(pre: Any, path: pathlib.Path | str = "GGUF") -> PreTokenization:
    """The pre-tokenization a GGUF `tokenizer.ggml.pre` value names (`PRE_TOKENIZATIONS`).

    Raises:
        ConfigError: the value is missing or not a known name (llama.cpp then falls back to a "default" regex and
            warns that generation quality degrades; asyncllm does not guess).
    """
    if not isinstance(pre, str) or pre not in PRE_TOKENIZATIONS:
        raise ConfigError(
            f"{path}: tokenizer.ggml.pre={pre!r} is not a byte-level BPE pre-tokenizer asyncllm knows; known: "
            f"{sorted(PRE_TOKENIZATIONS)}"
        )
    return PRE_TOKENIZATIONS[pre]


def _pre_tokenizer(pre: PreTokenization) -> pre_tokenizers.PreTokenizer:
    if pre.split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _add_typed_tokens(hf: HFTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """CONTROL tokens (spelled in the byte alphabet) -> special; USER_DEFINED -> plain added tokens."""
    alphabet = set(_byte_alphabet().values())
    control = [t for t, k in zip(tokens, token_types, strict=True) if k == _CONTROL and set(t) <= alphabet]
    user = [t for t, k in zip(tokens, token_types, strict=True) if k == _USER_DEFINED]
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    hf.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _bos_eos_processor(tokens: list[str], bos: int | None, eos: int | None) -> processors.PostProcessor:
    pre = [tokens[bos]] if bos is not None else []
    post = [tokens[eos]] if eos is not None else []
    special = [(tokens[i], i) for i in {i for i in (bos, eos) if i is not None}]
    single = " ".join([*pre, "$A", *post])
    pair = " ".join([*pre, "$A", *post, *pre, "$B:1", *post])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _load_hf_dir(path: pathlib.Path) -> Tokenizer:
    hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
    config_file = path / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = config.get("chat_template")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    if isinstance(template, list):  # a list of named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    bos = _special_id(hf, config.get("bos_token"))
    eos = _special_id(hf, config.get("eos_token"))
    add_bos = bos is not None and hf.encode("a").ids[:1] == [bos]
    return Tokenizer(hf, bos, eos, template, add_bos)


def _special_id(hf: HFTokenizer, token: str | dict[str, Any] | None) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else hf.token_to_id(token)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)
