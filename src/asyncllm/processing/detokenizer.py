"""Incremental detokenization of one sequence, with stop strings.

Text is decoded token by token with `tokenizers.decoders.DecodeStream`, which holds back the bytes of a
multi-byte character until the character is complete, so no delta contains U+FFFD for text that decodes
cleanly as a whole. Stop strings are searched only where the new text can complete one; the text after the
earliest match is cut. Trailing text that could still grow into a stop string is held back (not emitted)
until it either completes the stop string or stops matching, so emitted text is never retracted.

A sequence the engine stopped with a stop token (EOS or one of `stop_token_ids`) keeps that token's id in
`token_ids` but not its text, unless `include_stop_str_in_output` (as vLLM's detokenizer, which skips decoding
the stopping token); the text is then never emitted, in any output kind.

Invariant: when the sequence ends without a stop string or stop token, `output_text ==
tokenizer.decode(token_ids)`.
"""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from asyncllm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, one step at a time.

    Args:
        tokenizer: the model's `tokenizers.Tokenizer`.
        params: uses `stop`, `include_stop_str_in_output`, `skip_special_tokens`, `min_tokens`, `detokenize`
            (False: token ids only, the text stays "").
    Attributes:
        token_ids: every generated token id fed so far (up to and including the one that completed a stop
            string; later ones are dropped).
        stop_reason: the matched stop string, or None.
    """

    def __init__(self, tokenizer: HFTokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stop = list(params.stop or ())
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._detokenize = params.detokenize
        self._text = ""  # all text decoded so far (cut at a stop string)
        self._num_pending_tokens = 0  # tokens fed to the stream since it last produced text
        self._num_emittable = 0  # prefix of _text that is safe to emit
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """Text safe to show: all decoded text minus the held-back tail (which may become a stop string)."""
        return self._text[: self._num_emittable]

    @property
    def num_output_chars(self) -> int:
        """Length of `output_text`."""
        return self._num_emittable

    def output_text_since(self, start: int) -> str:
        """`output_text[start:]`, without copying the part before `start`."""
        return self._text[start : self._num_emittable]

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; later tokens are ignored."""
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int], finished: bool, stop_terminated: bool = False) -> str | None:
        """Feed the tokens of one engine step.

        Args:
            new_token_ids: token ids sampled this step, in order.
            finished: True when the engine finished the sequence with these tokens; the held-back text is
                then released and bytes of an incomplete character are flushed.
            stop_terminated: the engine stopped the sequence with the last of `new_token_ids` (EOS or a stop
                token id): its id is kept, its text is left out unless `include_stop_str_in_output`.
        Returns:
            The stop string that matched in this step (the sequence is then done), or None.
        """
        stop_token_id = None
        if stop_terminated and new_token_ids and not self._include_stop:
            new_token_ids, stop_token_id = new_token_ids[:-1], new_token_ids[-1]
        for token_id in new_token_ids:
            if self.stopped:
                break
            self.token_ids.append(token_id)
            self._append_token(token_id)
        if self.stopped:
            return self.stop_reason
        if finished:
            self._flush()
        else:
            self._num_emittable = len(self._text) - self._holdback_len()
        if stop_token_id is not None:
            self.token_ids.append(stop_token_id)  # after the flush: its bytes must not be decoded there
        return None

    def release(self) -> None:
        """Make all decoded text emittable (the sequence ends for another reason, e.g. an abort)."""
        if not self.stopped:
            self._flush()

    def _append_token(self, token_id: int) -> None:
        if not self._detokenize:
            return
        chunk = self._stream.step(self._tokenizer, token_id)
        if chunk is None:
            self._num_pending_tokens += 1
            return
        self._num_pending_tokens = 0
        old_len = len(self._text)
        self._text += chunk
        if self._stop and len(self.token_ids) > self._min_tokens:
            self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        """Find the earliest stop string that ends in the new text and cut the text there."""
        start = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            idx = self._text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return
        idx, stop = best
        self._text = self._text[: idx + len(stop)] if self._include_stop else self._text[:idx]
        self._num_emittable = len(self._text)
        self.stop_reason = stop

    def _holdback_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        if not self._stop or self._include_stop:
            return 0
        text = self._text
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _flush(self) -> None:
        """Release everything; decode bytes the stream still holds (they may decode to U+FFFD)."""
        if self._num_pending_tokens:
            tail_ids = self.token_ids[-self._num_pending_tokens :]
            self._num_pending_tokens = 0
            tail = self._tokenizer.decode(tail_ids, skip_special_tokens=self._skip_special_tokens)
            if tail:  # bytes of an incomplete character, not just skipped special tokens
                full = self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip_special_tokens)
                self._text = full if full.startswith(self._text) else self._text + tail
        self._num_emittable = len(self._text)
