"""Verification of draft tokens: keep the output distribution exactly the target model's.

Each request with k drafts has k + 1 verification rows: row j holds the target logits after the request's
tokens plus drafts 1..j (row 0: after its last real token). Row j's draft is draft j + 1 (the last row has none).
- Greedy rows: draft j + 1 is accepted iff it is the argmax of row j (after the same logit edits as without
  speculation), so greedy output ids are identical to plain decoding.
- Sampled rows: the n-gram proposer's draft distribution q is a point mass on the draft token x, so the standard
  speculative sampling rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding"; Chen et al. 2023) reduces to: accept x with probability min(1, p(x) / q(x)) = p(x); on rejection,
  sample from the residual max(p - q, 0) normalized, i.e. p with x removed and renormalized. The accepted or
  resampled token is distributed exactly as p. Same treatment as vLLM's rejection sampler for drafts without
  probabilities (vllm/v1/sample/rejection_sampler.py, `NO_DRAFT_PROBS`: draft probability 1, recovered token
  from the target probabilities with the draft zeroed).
The request emits the accepted drafts up to the first rejection, then that row's corrected token; if all k
drafts are accepted, a bonus token sampled from the last row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncllm.worker.sampler import Sampler, SamplingMetadata, argmax_rows


@dataclass
class VerificationResult:
    """Per-request outcome of one verification step.

    Fields:
        token_ids: per request, the emitted tokens (accepted drafts, then one corrected or bonus token).
        rows: per request, the verification row each emitted token came from (for logprobs).
    """

    token_ids: list[list[int]]
    rows: list[list[int]]


class RejectionSampler:
    """Verifies drafts against the target distributions computed by a `Sampler`.

    Args:
        sampler: supplies the target distribution (`compute_probs`) and the shared generator.
    """

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]]) -> VerificationResult:
        """Verify every request's drafts.

        Args:
            logits: [num_rows, vocab_size] float32, num_rows = sum(len(d) + 1 for d in drafts); each request's
                rows are consecutive, in the order of `drafts`.
            meta: one row of sampling parameters per logits row (seeded rows have their own generator, seeded
                for that row's output position).
            drafts: per request, its draft token ids (possibly empty: it then just samples one token).
        Returns:
            The emitted tokens of each request.
        """
        row_tokens, accepted = self.verify_rows(logits, meta, _row_drafts(drafts))
        token_ids: list[list[int]] = []
        rows: list[list[int]] = []
        start = 0
        for draft in drafts:
            emitted, emitted_rows = [], []
            for j in range(len(draft) + 1):
                row = start + j
                emitted_rows.append(row)
                if j < len(draft) and accepted[row]:
                    emitted.append(draft[j])
                    continue
                emitted.append(row_tokens[row])
                break
            token_ids.append(emitted)
            rows.append(emitted_rows)
            start += len(draft) + 1
        return VerificationResult(token_ids, rows)

    def verify_rows(
        self, logits: torch.Tensor, meta: SamplingMetadata, row_drafts: list[int]
    ) -> tuple[list[int], list[bool]]:
        """Accept or reject each row's draft and sample the row's own token.

        Args:
            row_drafts: [num_rows] the draft token each row verifies, -1 for none (a bonus row).
        Returns:
            Per row: the token it emits when it ends the run (greedy: the argmax; sampled: a token from p
            without the draft, or from p when it has no draft), and whether its draft was accepted.
        """
        greedy_tokens, probs = self.sampler.compute_probs(logits, meta)
        draft = torch.tensor(row_drafts, dtype=torch.int64)
        has_draft = draft >= 0
        greedy_accept = has_draft & (greedy_tokens == draft)
        if probs is None:
            return greedy_tokens.tolist(), greedy_accept.tolist()
        is_greedy = meta.temperature == 0
        safe_draft = draft.clamp(min=0).unsqueeze(1)
        uniform = self._draw_uniform(has_draft, meta.generators)
        random_accept = has_draft & (uniform < probs.gather(1, safe_draft).squeeze(1))
        residual = probs.scatter(1, safe_draft, 0.0)
        residual = torch.where(has_draft.unsqueeze(1), residual, probs)
        recovered = argmax_rows(residual.div_(self.sampler.draw_noise(residual, meta.generators)))
        tokens = torch.where(is_greedy, greedy_tokens, recovered)
        accept = torch.where(is_greedy, greedy_accept, random_accept)
        return tokens.tolist(), accept.tolist()

    def _draw_uniform(self, has_draft: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """[num_rows] U[0, 1): a seeded row with a draft draws from its generator (before its noise); a seeded
        row without one draws nothing, so it samples exactly as without speculation; others use the shared one."""
        uniform = torch.rand(len(has_draft), generator=self.sampler.generator)
        for row, generator in generators.items():
            if has_draft[row]:
                uniform[row] = torch.rand(1, generator=generator)
        return uniform


def _row_drafts(drafts: list[list[int]]) -> list[int]:
    """Per verification row, the draft it checks (-1 for each request's last row)."""
    return [token for draft in drafts for token in [*draft, -1]]
