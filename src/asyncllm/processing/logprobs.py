"""Frontend side of logprobs: engine `LogprobsLists` -> `{token_id: Logprob}` dicts with decoded tokens."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer

from asyncllm.messages.engine import LogprobsLists
from asyncllm.outputs import Logprob, PromptLogprobs, SampleLogprobs


class LogprobsProcessor:
    """Accumulates one sequence's sample and prompt logprobs.

    Args:
        tokenizer: decodes each listed token on its own (`decoded_token`); None (`detokenize=False`): every
            `decoded_token` is None, as vLLM.
        num_logprobs: `SamplingParams.logprobs` (None: no sample logprobs).
        num_prompt_logprobs: `SamplingParams.prompt_logprobs` (None: no prompt logprobs).
    Attributes:
        logprobs: one dict per generated token, or None.
        cumulative_sums: [num_tokens + 1] running sums of the sampled tokens' logprobs (`cumulative_sums[i]` = sum
            over the first i tokens), so `cumulative_logprob` costs O(1) per output, not O(num_tokens).
        prompt_logprobs: [None, dict, ...] once the engine sent them, or None.
    """

    def __init__(
        self, tokenizer: HFTokenizer | None, num_logprobs: int | None, num_prompt_logprobs: int | None
    ) -> None:
        self._tokenizer = tokenizer
        self.logprobs: SampleLogprobs | None = [] if num_logprobs is not None else None
        self.cumulative_sums: list[float] = [0.0]
        self._wants_prompt_logprobs = num_prompt_logprobs is not None
        self.prompt_logprobs: PromptLogprobs | None = None

    def update(self, new_logprobs: LogprobsLists | None, new_prompt_logprobs: LogprobsLists | None) -> None:
        """Append one engine step's logprobs."""
        if new_logprobs is not None and self.logprobs is not None:
            self.logprobs.extend(self._to_dicts(new_logprobs))
            for row in new_logprobs.logprobs:
                self.cumulative_sums.append(self.cumulative_sums[-1] + row[0])
        if new_prompt_logprobs is not None and self._wants_prompt_logprobs:
            self.prompt_logprobs = [None, *self._to_dicts(new_prompt_logprobs)]

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` entries (tokens after a stop string are dropped)."""
        if self.logprobs is not None:
            del self.logprobs[num_tokens:]
            del self.cumulative_sums[num_tokens + 1 :]

    def cumulative_logprob(self, num_tokens: int) -> float | None:
        """Sum of the sampled logprobs of the first `num_tokens` tokens, or None without logprobs."""
        if self.logprobs is None:
            return None
        return float(self.cumulative_sums[min(num_tokens, len(self.cumulative_sums) - 1)])

    def _to_dicts(self, lists: LogprobsLists) -> SampleLogprobs:
        """One dict per position, in vLLM's order: the scored (sampled or prompt) token first, then the top-k by
        rank; a scored token that is also in the top-k keeps the first place and takes its top-k entry."""
        unique_ids = sorted({t for row in lists.token_ids for t in row})
        decoded: dict[int, str | None]
        if self._tokenizer is None:
            decoded = dict.fromkeys(unique_ids)
        else:
            texts = self._tokenizer.decode_batch([[t] for t in unique_ids], skip_special_tokens=False)
            decoded = dict(zip(unique_ids, texts, strict=True))
        dicts: SampleLogprobs = []
        for ids, values, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=True):
            entry = {ids[0]: Logprob(values[0], rank, decoded[ids[0]])}
            for top_rank, (tid, lp) in enumerate(zip(ids[1:], values[1:], strict=True), 1):
                entry[tid] = Logprob(lp, top_rank, decoded[tid])
            dicts.append(entry)
        return dicts
