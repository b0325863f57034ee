"""Batched sampling from logits: logit edits (allowed tokens, min_tokens, logit bias, penalties), then greedy
rows by argmax, the others by temperature, min-p, top-k, top-p and an exponential race.

Sampling `argmax(p / q)` with `q ~ Exp(1)` i.i.d. per vocabulary entry draws token i with probability p_i
(the "exponential race" / Gumbel-max trick in exponential form, as vLLM's sampler does). Its only randomness
is the noise `q`, drawn per row: a seeded row draws its noise from its own generator, so it samples the same
token alone or in any batch. The generator is re-seeded at every output position from (seed, position), so a
seeded request also gives the same tokens after a preemption (its state is rebuilt on resume).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from asyncllm.model.kernels.row_kernels import load_kernels
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured_outputs.bitmask import apply_grammar_bitmask
from asyncllm.utils import request_callables
from asyncllm.worker.logits_processing import LogitsEdits, RowTokens, apply_logits_processors, apply_min_p

_SEED_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads (seed, position) pairs over the seed space
_MAX_PARTIAL_TOP_K = 1024  # up to this k, top-k/top-p use `topk` instead of sorting the whole vocabulary


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one step, as tensors.

    Fields:
        temperature: [num_reqs] float32; 0 for greedy rows (`SamplingParams.greedy`: below `SAMPLING_EPS`).
        top_k: [num_reqs] int64 (vocab_size = disabled), or None when no row uses top-k.
        top_p: [num_reqs] float32 (1.0 = disabled), or None when no row uses top-p.
        generators: row index -> the seeded generator of that row, already seeded for this step.
        edits: logit edits (bias, masks, penalties, min-p) applied before sampling.
        grammar_rows: [num_constrained] int64 rows under a structured-output grammar, or None.
        grammar_allowed: [num_constrained, vocab_size] bool, the tokens each grammar allows next, or None.
        logits_processors: row -> (the request's callables, its tokens), for rows with
            `SamplingParams.logits_processors` (in-process workers only); None when no row has them.
        failed_rows: row -> error, filled by `compute_probs` for rows whose logits processor failed.
        keep_processed: `compute_probs` keeps the processed logits in `processed_logits` (`logprobs_mode`
            "processed_*"): [num_reqs, vocab_size], after every edit, temperature, min-p, top-k and top-p (greedy
            rows: after the edits only).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    edits: LogitsEdits
    grammar_rows: torch.Tensor | None = None
    grammar_allowed: torch.Tensor | None = None
    logits_processors: dict[int, tuple[tuple[Any, ...], RowTokens]] | None = None
    failed_rows: dict[int, str] = field(default_factory=dict)
    keep_processed: bool = False
    processed_logits: torch.Tensor | None = None

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        vocab_size: int,
        generators: dict[int, torch.Generator],
        rows: list[RowTokens] | None = None,
    ) -> SamplingMetadata:
        """Build the tensors for rows sampled with `params` (one per row) over a `vocab_size` vocabulary.

        Args:
            rows: each row's prompt, output and EOS ids (for penalties and min_tokens); None means no tokens.
        """
        if rows is None:
            rows = [RowTokens([], []) for _ in params]
        processors = {}
        for row, (p, tokens) in enumerate(zip(params, rows, strict=True)):
            functions = request_callables.lookup(p.logits_processors_key) if p.logits_processors_key else None
            if functions:
                processors[row] = (functions, tokens)
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_ps = [p.top_p for p in params]
        return cls(
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32),
            top_k=torch.tensor(top_ks, dtype=torch.int64) if min(top_ks) < vocab_size else None,
            top_p=torch.tensor(top_ps, dtype=torch.float32) if min(top_ps) < 1.0 else None,
            generators=generators,
            edits=LogitsEdits.from_rows(params, rows, vocab_size),
            logits_processors=processors or None,
        )


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for `[rows, vocab_size]` float32, as `[rows]` int64: the first index of each row's
    maximum (NaN counts as the maximum), as `torch.argmax` documents. Computed with `torch.max(dim=-1)`, which
    documents the same first-index rule and is faster on CPU (`benchmarks/analysis.md`, "Sampler"); where the row
    kernels are built, by their `argmax_rows` (the same indices, checked at start-up; two vector passes over a row
    instead of ATen's one compare per value)."""
    kernels = load_kernels()
    if kernels is not None and x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0:
        return kernels.argmax_rows(x.contiguous())
    return x.max(dim=-1).indices


def seed_generator(generator: torch.Generator, seed: int, position: int) -> torch.Generator:
    """Re-seed a request's generator for the token at output `position` (0-based); returns it."""
    return generator.manual_seed((seed * _SEED_MIX + position) % (1 << 63))


class Sampler:
    """Samples one token per row of a logits batch.

    Args:
        seed: seed of the generator shared by unseeded rows (ModelConfig.seed).
    """

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Sample.

        Order (as vLLM v1; vLLM v0's per-request logits processors first): the grammar bitmask (structured
        outputs), logit edits (allowed tokens, min_tokens and bad-words masks, logit bias, then penalties);
        greedy rows take the argmax of the edited logits; the others divide by temperature, then min-p, top-k,
        top-p.

        Args:
            logits: [num_reqs, vocab_size] float32 (not modified).
            meta: per-row parameters.
        Returns:
            [num_reqs] int64 token ids.
        Source: exponential race (argmax p/q, q ~ Exp(1)) as in vLLM's `random_sample`; top-k/top-p masking
            with one ascending sort as in vLLM's `apply_top_k_top_p`.
        """
        greedy_tokens, probs = self.compute_probs(logits, meta)
        if probs is None:
            return greedy_tokens
        sampled = argmax_rows(probs.div_(self.draw_noise(probs, meta.generators)))
        return torch.where(meta.temperature == 0, greedy_tokens, sampled)

    def compute_probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target distribution of every row, in the order `__call__` documents.

        Returns:
            [num_reqs] int64 argmax of the edited logits (the token of greedy rows), and [num_reqs, vocab_size]
            float32 probabilities after temperature, min-p, top-k and top-p (None when every row is greedy;
            rows of greedy requests hold their temperature-1 distribution and are not to be sampled from).
        """
        if meta.logits_processors:
            logits, meta.failed_rows = apply_logits_processors(logits, meta.logits_processors)
        if meta.grammar_rows is not None and meta.grammar_allowed is not None:
            logits = apply_grammar_bitmask(logits, meta.grammar_rows, meta.grammar_allowed)
        logits = meta.edits.apply_before_temperature(logits)
        greedy_tokens = argmax_rows(logits)
        if meta.all_greedy:
            if meta.keep_processed:
                meta.processed_logits = logits
            return greedy_tokens, None
        is_greedy = meta.temperature == 0
        temperature = torch.where(is_greedy, 1.0, meta.temperature)
        scaled = logits / temperature.unsqueeze(1)
        if meta.edits.min_p is not None:
            scaled = apply_min_p(scaled, meta.edits.min_p)
        top_k = meta.top_k
        if top_k is not None:  # greedy rows keep vocab_size (disabled); they must not force a full sort
            top_k = torch.where(is_greedy, top_k[~is_greedy].max(), top_k)
        scaled = apply_top_k_top_p(scaled, top_k, meta.top_p)
        if meta.keep_processed:
            meta.processed_logits = torch.where(is_greedy.unsqueeze(1), logits, scaled)
        return greedy_tokens, scaled.softmax(dim=-1)

    def draw_noise(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """[num_reqs, vocab_size] Exp(1) noise: seeded rows from their generator, the others from the shared one."""
        noise = torch.empty_like(probs)
        if len(generators) < probs.shape[0]:
            noise.exponential_(generator=self.generator)
        for row, generator in generators.items():
            noise[row].exponential_(generator=generator)
        return noise


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf.

    Args:
        logits: [num_reqs, vocab_size] float32.
        top_k: [num_reqs] int64 in [1, vocab_size], or None.
        top_p: [num_reqs] float32 in (0, 1], or None.
    Returns:
        A new [num_reqs, vocab_size] tensor (or `logits` itself when both are None). Ties with the k-th
        logit are kept; the most likely token always survives top-p.
    """
    if top_k is None and top_p is None:
        return logits
    if top_k is not None and int(top_k.max()) <= _MAX_PARTIAL_TOP_K:
        return _apply_partial_top_k_top_p(logits, top_k, top_p)
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= (1.0 - top_p).unsqueeze(1)
        outside[:, -1] = False
        sorted_logits.masked_fill_(outside, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)


def _apply_partial_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """The same masks from the `max(top_k)` largest logits only (a partial sort, far cheaper than a full sort of
    the vocabulary; `benchmarks/analysis.md`, "Sampler"): find each row's smallest kept logit, mask everything
    below it."""
    candidates = logits.topk(int(top_k.max()), dim=-1).values  # [num_reqs, max_k], descending
    ranks = torch.arange(candidates.shape[1])
    candidates = candidates.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = candidates.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)  # mass of the more likely tokens >= p
        candidates = candidates.masked_fill(outside, float("-inf"))
    threshold = candidates.masked_fill(candidates == float("-inf"), float("inf")).amin(dim=-1, keepdim=True)
    return logits.masked_fill(logits < threshold, float("-inf"))
