"""Tokenizer from GGUF metadata without the transformers reference (parity lives in tests/integration)."""

from __future__ import annotations

import pathlib

import pytest

from asyncllm.config import EngineArgs, load_chat_template
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.model.loading.gguf_metadata import read_gguf_header
from asyncllm.model.loading.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer.load(model_path)


def test_header_lists_every_tensor(model_path: str) -> None:
    metadata, tensors = read_gguf_header(model_path)
    assert metadata["general.architecture"] == "llama"
    assert len(tensors) == 272
    assert tensors[0].name == "token_embd.weight"
    assert tensors[0].shape == (576, 49152)


def test_special_tokens_roundtrip(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhé 🎉<|im_end|>")
    assert ids[0] == tokenizer.bos_token_id
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids) == "user\nhé 🎉"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhé 🎉<|im_end|>"
    assert tokenizer.vocab_size == 49152


def test_chat_template_renders_chatml(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_template_errors_are_invalid_requests(tokenizer: Tokenizer) -> None:
    tokenizer_copy = Tokenizer(tokenizer.hf, 1, 2, "{{ raise_exception('no system role') }}", False)
    with pytest.raises(InvalidRequestError, match="no system role"):
        tokenizer_copy.apply_chat_template([{"role": "system", "content": "x"}])
    no_template = Tokenizer(tokenizer.hf, 1, 2, None, False)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])


def test_user_chat_template_from_text_or_file(tmp_path: pathlib.Path) -> None:
    """`EngineArgs.chat_template` (vLLM's `--chat-template`): a file path or the template text; anything else, or a
    template that does not parse, is a ConfigError before any engine starts."""
    text = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% if loop.last %}{% break %}{% endif %}"
    text += "{% endfor %}"
    assert load_chat_template(text) == text
    (tmp_path / "t.jinja").write_text(text)
    assert load_chat_template(str(tmp_path / "t.jinja")) == text
    with pytest.raises(ConfigError, match="neither a readable file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="syntax error on line 1"):
        load_chat_template("{% for m in messages %}")
    with pytest.raises(ConfigError, match="chat_template"):
        EngineArgs(chat_template="{{ unclosed").validate()
