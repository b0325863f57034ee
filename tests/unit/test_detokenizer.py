"""IncrementalDetokenizer on the real SmolLM2 tokenizer: unicode, split characters, stop strings."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer

from asyncllm import SamplingParams
from asyncllm.processing.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello, world! How are you today?",
    "  leading and   multiple   spaces  \n\ttabs\n\nnewlines  ",
    "héllo wörld — naïve café, Ærøskøbing, ß",
    "😀 emoji 👩‍👩‍👧‍👦 family, flags 🇫🇷🇯🇵, skin 👍🏽!",
    "日本語のテキストと中文文本，以及한국어 텍스트。",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย",
    "math ∑∫√∞ ≤ ≥ ≠ and arrows ⟶ ⇒ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "code: def f(x):\n    return x ** 2  # comment 🐍",
    "<|im_start|>user\nhi<|im_end|> special tokens inline",
]


@pytest.fixture(scope="module")
def hf(model_path: str) -> HFTokenizer:
    from asyncllm.model.loading.tokenizer import Tokenizer

    return Tokenizer.load(model_path).hf


def stream_deltas(
    hf: HFTokenizer, ids: list[int], params: SamplingParams, per_step: int = 1
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `ids` `per_step` at a time; returns the emitted deltas (the last step is the finished one)."""
    detok = IncrementalDetokenizer(hf, params)
    deltas, sent = [], 0
    for start in range(0, len(ids), per_step):
        chunk = ids[start : start + per_step]
        detok.update(chunk, finished=start + per_step >= len(ids))
        text = detok.output_text
        emitted = "".join(deltas)
        assert text.startswith(emitted), "emitted text was retracted"
        deltas.append(text[len(emitted) :])
        sent = len(text)
        if detok.stopped:
            break
    assert sent == len(detok.output_text)
    return deltas, detok


@pytest.mark.parametrize("text", CORPUS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_full_decode(hf: HFTokenizer, text: str, skip_special_tokens: bool) -> None:
    ids = hf.encode(text, add_special_tokens=False).ids
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    deltas, detok = stream_deltas(hf, ids, params)
    assert "".join(deltas) == hf.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in d for d in deltas)
    assert detok.token_ids == ids


def test_emoji_split_across_byte_tokens_is_held_until_complete(hf: HFTokenizer) -> None:
    ids = hf.encode(" 😀", add_special_tokens=False).ids
    assert len(ids) >= 2, "the emoji should span several byte tokens"
    detok = IncrementalDetokenizer(hf, SamplingParams())
    detok.update(ids[:1], finished=False)
    assert detok.output_text == ""
    detok.update(ids[1:], finished=True)
    assert detok.output_text == " 😀"


def test_incomplete_character_at_finish_is_flushed(hf: HFTokenizer) -> None:
    ids = hf.encode(" 😀", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(hf, SamplingParams())
    detok.update(ids[:1], finished=True)
    assert detok.output_text == hf.decode(ids[:1])


def test_special_token_skipped_at_finish(hf: HFTokenizer) -> None:
    ids = [*hf.encode("Paris.", add_special_tokens=False).ids, hf.token_to_id("<|im_end|>")]
    deltas, _ = stream_deltas(hf, ids, SamplingParams())
    assert "".join(deltas) == "Paris."


def test_stop_string_spanning_tokens(hf: HFTokenizer) -> None:
    ids = hf.encode("The answer is forty two, I think.", add_special_tokens=False).ids
    deltas, detok = stream_deltas(hf, ids, SamplingParams(stop=["forty two"]))
    assert "".join(deltas) == "The answer is "
    assert detok.stop_reason == "forty two"
    assert len(detok.token_ids) < len(ids), "tokens after the stop string are not kept"


def test_stop_string_inside_one_token(hf: HFTokenizer) -> None:
    ids = hf.encode("Hello wonderful world", add_special_tokens=False).ids
    deltas, detok = stream_deltas(hf, ids, SamplingParams(stop=["nder"]))
    assert "".join(deltas) == "Hello wo"
    assert detok.stop_reason == "nder"


def test_include_stop_str_in_output(hf: HFTokenizer) -> None:
    ids = hf.encode("one two three four", add_special_tokens=False).ids
    params = SamplingParams(stop=["thr"], include_stop_str_in_output=True)
    deltas, detok = stream_deltas(hf, ids, params)
    assert "".join(deltas) == "one two thr"
    assert detok.stop_reason == "thr"


def test_holdback_is_released_when_the_prefix_does_not_complete(hf: HFTokenizer) -> None:
    ids = hf.encode("abc abd abe", add_special_tokens=False).ids
    params = SamplingParams(stop=["abz"])
    deltas, detok = stream_deltas(hf, ids, params)
    assert "".join(deltas) == "abc abd abe"
    assert detok.stop_reason is None


def test_holdback_never_emits_a_stop_prefix_that_later_completes(hf: HFTokenizer) -> None:
    text = "xx END"
    ids = hf.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(hf, SamplingParams(stop=[" END"]))
    emitted = []
    for token_id in ids:
        detok.update([token_id], finished=False)
        emitted.append(detok.output_text)
    assert all(not e.endswith((" ", " E", " EN")) for e in emitted[:-1])
    assert detok.output_text == "xx"
    assert detok.stop_reason == " END"


def test_earliest_stop_string_wins(hf: HFTokenizer) -> None:
    ids = hf.encode("alpha beta gamma", add_special_tokens=False).ids
    deltas, detok = stream_deltas(hf, ids, SamplingParams(stop=["gamma", "beta"]), per_step=len(ids))
    assert "".join(deltas) == "alpha "
    assert detok.stop_reason == "beta"


def test_min_tokens_defers_stop_strings(hf: HFTokenizer) -> None:
    ids = hf.encode("stop now and stop later", add_special_tokens=False).ids
    deltas, detok = stream_deltas(hf, ids, SamplingParams(stop=["stop"], min_tokens=2, max_tokens=16))
    assert "".join(deltas) == "stop now and "
    assert detok.stop_reason == "stop"


@pytest.mark.parametrize("text", CORPUS[:7])
def test_unicode_corpus_with_stop_strings_never_retracts(hf: HFTokenizer, text: str) -> None:
    ids = hf.encode(text, add_special_tokens=False).ids
    full = hf.decode(ids)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    if not stop.strip():
        pytest.skip("the middle of this text is blank")
    deltas, detok = stream_deltas(hf, ids, SamplingParams(stop=[stop]))
    assert "".join(deltas) == full[: full.find(stop)]
    assert detok.stop_reason == stop
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_text_is_left_out_unless_asked_for(
    hf: HFTokenizer, skip_special_tokens: bool, include: bool
) -> None:
    """Issue 12: with stop_token_ids=[id of " are"] the text ended "... Dogs are"; an EOS-stopped answer with
    skip_special_tokens=False ended in "<|im_end|>". As vLLM: the id stays in token_ids, the text does not."""
    answer = hf.encode("Dogs are loyal. Dogs", add_special_tokens=False).ids
    (are,) = hf.encode(" are", add_special_tokens=False).ids
    for stop_id in (are, hf.token_to_id("<|im_end|>")):
        params = SamplingParams(
            stop_token_ids=[stop_id], skip_special_tokens=skip_special_tokens, include_stop_str_in_output=include
        )
        detok = IncrementalDetokenizer(hf, params)
        sent = ""
        for i, token_id in enumerate([*answer, stop_id]):
            last = i == len(answer)
            assert detok.update([token_id], finished=last, stop_terminated=last) is None
            sent += detok.output_text_since(len(sent))
        stop_text = hf.decode([stop_id], skip_special_tokens=skip_special_tokens)
        assert detok.token_ids == [*answer, stop_id]
        assert sent == detok.output_text == "Dogs are loyal. Dogs" + (stop_text if include else "")
