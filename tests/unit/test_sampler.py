"""Sampler: greedy = argmax; top-k/top-p pick only allowed tokens; seeded rows are batch-independent;
temperature reshapes the distribution as softmax(logits / T); penalties, logit_bias, allowed_token_ids,
min_tokens and min_p match a plain per-element reference."""

from __future__ import annotations

import torch

from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.logits_processing import LogitsEdits, RowTokens, apply_min_p
from asyncllm.worker.sampler import Sampler, SamplingMetadata, apply_top_k_top_p, argmax_rows, seed_generator

VOCAB = 50


def _meta(params: list[SamplingParams], generators: dict[int, torch.Generator] | None = None) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, VOCAB, generators or {})


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits(8)
    tokens = Sampler()(logits, _meta([SamplingParams(temperature=0.0)] * 8))
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 5.0) for i in range(6)]
    tokens = Sampler()(logits, _meta(params))
    assert torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))


def test_top_k_only_picks_top_k_tokens() -> None:
    logits = _logits(4)
    sampler = Sampler(seed=1)
    allowed = logits.topk(3, dim=-1).indices
    seen = set()
    for _ in range(200):
        tokens = sampler(logits, _meta([SamplingParams(temperature=10.0, top_k=3)] * 4))
        assert (allowed == tokens.unsqueeze(1)).any(dim=1).all()
        seen.add(tuple(tokens.tolist()))
    assert len(seen) > 10  # high temperature: it does sample, not always the argmax


def test_top_p_only_picks_the_nucleus() -> None:
    logits = torch.full((2, VOCAB), -10.0)
    logits[:, :4] = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    masked = apply_top_k_top_p(logits, None, torch.tensor([0.7, 0.85]))
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [0, 1]  # 0.5 + 0.3 >= 0.7
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [0, 1, 2]
    sampler = Sampler(seed=2)
    params = [SamplingParams(top_p=0.7), SamplingParams(top_p=0.85)]
    counts = torch.zeros(2, VOCAB)
    for _ in range(300):
        tokens = sampler(logits, _meta(params))
        counts[torch.arange(2), tokens] += 1
    assert counts[0, 2:].sum() == 0
    assert counts[0, :2].min() > 0
    assert counts[1, 3:].sum() == 0
    assert counts[1, :3].min() > 0


def test_top_p_keeps_the_most_likely_token_even_for_tiny_p() -> None:
    logits = _logits(3)
    masked = apply_top_k_top_p(logits, torch.tensor([VOCAB, 2, 1]), torch.tensor([1e-6, 1.0, 1.0]))
    assert torch.isfinite(masked).sum(dim=1).tolist() == [1, 2, 1]
    assert torch.equal(masked.argmax(dim=-1), logits.argmax(dim=-1))


def _seeded_tokens(row_logits: torch.Tensor, others: torch.Tensor | None, position: int) -> int:
    """The token of a seed-42 row at `position`, sampled alone or as row 1 of a batch with `others`."""
    generator = seed_generator(torch.Generator(), 42, position)
    if others is None:
        return int(Sampler(seed=7)(row_logits[None], _meta([SamplingParams(seed=42)], {0: generator}))[0])
    batch = torch.cat([others[:1], row_logits[None], others[1:]])
    params = [SamplingParams(temperature=0.5), SamplingParams(seed=42), SamplingParams(top_k=5, seed=3)]
    other_generator = seed_generator(torch.Generator(), 3, position)
    return int(Sampler(seed=position)(batch, _meta(params, {1: generator, 2: other_generator}))[1])


def test_seeded_row_gives_same_tokens_alone_and_in_a_batch() -> None:
    row = torch.zeros(VOCAB)  # uniform: every token equally likely, so agreement is not luck
    others = _logits(2, seed=5)
    alone = [_seeded_tokens(row, None, position) for position in range(20)]
    batched = [_seeded_tokens(row, others, position) for position in range(20)]
    assert alone == batched
    assert len(set(alone)) > 5


def test_seed_generator_depends_on_seed_and_position() -> None:
    draws = {
        (seed, position): seed_generator(torch.Generator(), seed, position).initial_seed()
        for seed in range(5)
        for position in range(5)
    }
    assert len(set(draws.values())) == 25


def test_temperature_matches_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    num_rows = 20000
    for temperature in (0.5, 1.0, 2.0):
        sampler = Sampler(seed=123)
        params = [SamplingParams(temperature=temperature)] * num_rows
        meta = SamplingMetadata.from_params(params, 4, {})
        tokens = sampler(logits.expand(num_rows, 4), meta)
        freq = torch.bincount(tokens, minlength=4).float() / num_rows
        expected = (logits / temperature).softmax(dim=-1)
        assert torch.allclose(freq, expected, atol=0.015), (temperature, freq, expected)


def test_partial_top_k_path_matches_full_sort() -> None:
    from asyncllm.worker import sampler as sampler_module

    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(9)) * 2
    top_k = torch.tensor([1, 7, 40, 300, 1000, 5000])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.3, 1.0, 0.8])
    partial = apply_top_k_top_p(logits[:5], top_k[:5], top_p[:5])
    full_limit, sampler_module._MAX_PARTIAL_TOP_K = sampler_module._MAX_PARTIAL_TOP_K, 0
    try:
        full = apply_top_k_top_p(logits[:5], top_k[:5], top_p[:5])
        full_with_wide_row = apply_top_k_top_p(logits, top_k, top_p)
    finally:
        sampler_module._MAX_PARTIAL_TOP_K = full_limit
    assert torch.equal(torch.isfinite(partial), torch.isfinite(full))
    kept = torch.isfinite(partial).sum(dim=1).tolist()
    assert kept[0] == 1
    assert kept[4] == 1000  # top-k only
    assert all(1 <= n < k for n, k in zip(kept[1:4], [7, 40, 300], strict=True))  # top-p cut inside top-k
    assert torch.isfinite(full_with_wide_row[5]).sum() < 5000


# ---- logit edits vs a plain per-element reference ------------------------------------------------------


def _reference_edit(logits: list[float], params: SamplingParams, row: RowTokens) -> list[float]:
    """Plain Python: allowed ids, min_tokens, logit bias (clamped to +-100), then CTRL repetition penalty on
    prompt+output tokens, then OpenAI frequency/presence penalties on output tokens."""
    out = []
    for token, value in enumerate(logits):
        if params.allowed_token_ids and token not in params.allowed_token_ids:
            value = float("-inf")
        eos_masked = row.eos_token_id == token and not params.ignore_eos
        stop_masked = token in (params.stop_token_ids or ())
        if len(row.output_token_ids) < params.min_tokens and (eos_masked or stop_masked):
            value = float("-inf")
        value += max(-100.0, min(100.0, (params.logit_bias or {}).get(token, 0.0)))
        count = row.output_token_ids.count(token)
        if token in row.prompt_token_ids or count:
            r = params.repetition_penalty
            value = value / r if value > 0 else value * r
        value -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        out.append(value)
    return out


PENALTY_CASES = [
    (SamplingParams(repetition_penalty=1.7), RowTokens([1, 2, 3, 3], [4, 4, 9])),
    (SamplingParams(repetition_penalty=0.6), RowTokens([0, 5], [7])),
    (SamplingParams(frequency_penalty=0.8), RowTokens([1], [4, 4, 4, 9, 11])),
    (SamplingParams(presence_penalty=-1.5), RowTokens([1], [4, 4, 4, 9, 11])),
    (
        SamplingParams(presence_penalty=0.5, frequency_penalty=-0.3, repetition_penalty=1.3, logit_bias={4: 3.0}),
        RowTokens([2, 4, 6], [6, 6, 8, 49]),
    ),
    (SamplingParams(logit_bias={0: 250.0, 3: -7.5, 49: -1000.0}), RowTokens([1], [])),
    (SamplingParams(allowed_token_ids=[3, 17, 40], logit_bias={17: 2.0}), RowTokens([1], [2])),
    (SamplingParams(min_tokens=3, stop_token_ids=[8, 9]), RowTokens([1], [5, 6], eos_token_id=2)),
    (SamplingParams(min_tokens=3, stop_token_ids=[8]), RowTokens([1], [5, 6, 7], eos_token_id=2)),
    (SamplingParams(min_tokens=3, ignore_eos=True), RowTokens([1], [], eos_token_id=2)),
    (SamplingParams(), RowTokens([1], [2])),
]


def test_logit_edits_match_the_plain_reference_in_one_batch() -> None:
    params = [p for p, _ in PENALTY_CASES]
    rows = [r for _, r in PENALTY_CASES]
    logits = _logits(len(params), seed=3)
    edited = LogitsEdits.from_rows(params, rows, VOCAB).apply_before_temperature(logits)
    expected = torch.tensor([_reference_edit(logits[i].tolist(), p, r) for i, (p, r) in enumerate(PENALTY_CASES)])
    assert torch.equal(torch.isinf(edited), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(edited[finite], expected[finite], rtol=1e-6, atol=1e-5)


def test_batch_without_edits_builds_no_tensors() -> None:
    edits = LogitsEdits.from_rows([SamplingParams(), SamplingParams(min_tokens=2)], [RowTokens([1], [2, 3])] * 2, VOCAB)
    assert (edits.additive, edits.penalties, edits.min_p) == (None, None, None)


def test_greedy_takes_the_argmax_after_logit_bias_and_masks() -> None:
    logits = _logits(3, seed=5)
    params = [
        SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[10, 11, 12]),
        SamplingParams(temperature=0.0, min_tokens=1),
    ]
    eos = int(logits[2].argmax())
    rows = [RowTokens([1], []), RowTokens([1], []), RowTokens([1], [], eos_token_id=eos)]
    tokens = Sampler()(logits, SamplingMetadata.from_params(params, VOCAB, {}, rows)).tolist()
    assert tokens[0] == 7
    assert tokens[1] == 10 + int(logits[1, 10:13].argmax())
    assert tokens[2] == int(logits[2].topk(2).indices[1])


def test_sampling_never_leaves_allowed_token_ids() -> None:
    logits = _logits(1, seed=6).repeat(400, 1)
    params = [SamplingParams(temperature=2.0, allowed_token_ids=[3, 9, 27])] * 400
    tokens = Sampler(seed=1)(logits, _meta(params))
    assert set(tokens.tolist()) == {3, 9, 27}


def test_min_p_matches_the_plain_reference_and_only_samples_kept_tokens() -> None:
    logits = _logits(4, seed=7)
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    masked = apply_min_p(logits, min_p)
    for i in range(4):
        probs = logits[i].softmax(dim=-1).tolist()
        kept = [p >= min_p[i].item() * max(probs) for p in probs]
        assert (~torch.isinf(masked[i])).tolist() == kept
    rows = logits[2:3].repeat(300, 1)
    tokens = Sampler(seed=2)(rows, _meta([SamplingParams(min_p=0.3)] * 300))
    kept_ids = set(torch.nonzero(~torch.isinf(masked[2])).flatten().tolist())
    assert set(tokens.tolist()) <= kept_ids
    assert len(set(tokens.tolist())) > 1 or len(kept_ids) == 1


def test_sampling_with_penalties_follows_the_edited_distribution() -> None:
    """A token pushed to -inf by a huge frequency penalty (with repetition) is never drawn; chi-square-free
    check: the edited softmax puts > 0 mass only on the other tokens."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 10.0  # would win almost always
    row = RowTokens([1], [5] * 50)
    params = SamplingParams(frequency_penalty=2.0)
    tokens = Sampler(seed=3)(
        logits.repeat(200, 1), SamplingMetadata.from_params([params] * 200, VOCAB, {}, [row] * 200)
    )
    assert 5 not in tokens.tolist()


def test_argmax_rows_is_torch_argmax_with_ties_infinities_and_nan() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=gen)
    x[1, [7, 300, 999]] = 50.0  # ties: the first index wins
    x[2] = float("-inf")
    x[2, 500] = 0.0
    x[3] = float("-inf")  # all equal: index 0
    x[4, [20, 40]] = float("inf")
    x[5, 123] = float("nan")  # NaN counts as the maximum
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [int(x[0].argmax()), 7, 500, 0, 20, 123]
