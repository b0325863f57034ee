"""How many n-gram draft tokens a request should verify this step: only as many as pay for their rows.

On a CPU a forward's cost grows with its rows: `step_seconds ≈ fixed + per_token * num_tokens` (a measured
case: `benchmarks/analysis.md`, "Draft policy"). With B decoding rows, a produced token costs
`(fixed + per_token * B) / B` seconds, and a draft token costs `per_token` seconds and yields a token only when it
and every draft before it are accepted. So the j-th draft is worth verifying when
`P(accept drafts 1..j) > break_even = per_token * B / (fixed + per_token * B)`: at batch 1 drafts pay at a modest
acceptance rate, at 8 or 32 rows only at a very high one.

Two estimates, both online:
- `StepCostModel`: an exponentially weighted least-squares fit of the engine's decode-step times (seconds)
  against their scheduled tokens (drafts included), over steps without a prefill chunk.
- `AcceptanceEstimate` (one per request): the conditional acceptance rate `q` of a draft token given that the
  drafts before it were accepted (decayed counts of accepted tokens and of rejections), so
  `P(accept drafts 1..j) ≈ q ** j`. A request that drafts nothing for `PROBE_INTERVAL` of its decode steps
  verifies one draft token anyway, so a request whose text turns repetitive (a list being copied) wins its
  drafts back.

The output distribution never depends on this policy (rejection sampling keeps it exact); only speed does.
asyncllm's own policy: vLLM's n-gram proposer always drafts k tokens when the n-gram matches
(`speculative_config={"adaptive": false}` does that here).
"""

from __future__ import annotations

from dataclasses import dataclass

COST_HALF_LIFE_STEPS = 64  # the cost fit follows the machine's load within about this many steps
MIN_COST_SAMPLES = 8  # decode steps observed before the fit is used (until then: draft up to k)
MIN_TOKEN_VARIANCE = 0.25  # tokens**2: below this the steps seen so far cannot separate fixed from per-token cost
ACCEPTANCE_DECAY = 0.8  # per verification: the estimate follows the last few verifications of a request
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0  # q starts at 0.5
PROBE_INTERVAL = 16  # decode steps without drafts after which one draft token is verified anyway


class StepCostModel:
    """Exponentially weighted least-squares fit `seconds ≈ fixed + per_token * num_tokens` of decode steps."""

    def __init__(self) -> None:
        self._decay = 0.5 ** (1.0 / COST_HALF_LIFE_STEPS)
        self._weight = self._sum_x = self._sum_y = self._sum_xx = self._sum_xy = 0.0
        self._num_samples = 0
        self.fixed_s: float | None = None  # seconds per step regardless of its tokens
        self.per_token_s: float | None = None  # seconds per scheduled token

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Add one decode step: `num_tokens` scheduled tokens (drafts included) ran in `seconds`."""
        d = self._decay
        self._weight = d * self._weight + 1.0
        self._sum_x = d * self._sum_x + num_tokens
        self._sum_y = d * self._sum_y + seconds
        self._sum_xx = d * self._sum_xx + num_tokens * num_tokens
        self._sum_xy = d * self._sum_xy + num_tokens * seconds
        self._num_samples += 1
        self._refit()

    def _refit(self) -> None:
        w = self._weight
        mean_x, mean_y = self._sum_x / w, self._sum_y / w
        variance_x = self._sum_xx / w - mean_x * mean_x
        if self._num_samples < MIN_COST_SAMPLES or variance_x < MIN_TOKEN_VARIANCE:
            return  # keep the last fit (or none)
        slope = (self._sum_xy / w - mean_x * mean_y) / variance_x
        self.per_token_s = max(slope, 0.0)
        self.fixed_s = max(mean_y - self.per_token_s * mean_x, 0.0)

    def break_even(self, num_rows: int) -> float:
        """The probability that a draft token must have of being accepted to pay for its row, with `num_rows`
        decode rows in the step; 0.0 (every draft pays) until the fit exists."""
        if self.per_token_s is None or self.fixed_s is None:
            return 0.0
        rows_cost = self.per_token_s * max(num_rows, 1)
        total = self.fixed_s + rows_cost
        return rows_cost / total if total > 0 else 0.0


@dataclass
class AcceptanceEstimate:
    """One request's draft acceptance, for `num_draft_tokens` (decayed counts; see the module docstring)."""

    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    steps_without_drafts: int = 0

    @property
    def rate(self) -> float:
        """q: the estimated probability that a draft token is accepted, given the drafts before it were."""
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """Add one verification: `num_accepted` of `num_drafts` drafts accepted (a rejection ends the run)."""
        self.accepted = ACCEPTANCE_DECAY * self.accepted + num_accepted
        self.rejected = ACCEPTANCE_DECAY * self.rejected + (1 if num_accepted < num_drafts else 0)

    def num_draft_tokens(self, limit: int, break_even: float) -> int:
        """How many drafts (at most `limit`) to verify: the j-th while `rate ** j > break_even`, or one probe
        after `PROBE_INTERVAL` decode steps without any."""
        count, chance = 0, 1.0
        while count < limit:
            chance *= self.rate
            if chance <= break_even:
                break
            count += 1
        if count == 0 and limit > 0 and self.steps_without_drafts >= PROBE_INTERVAL:
            count = 1
        return count

    def note_decode_step(self, num_drafts: int) -> None:
        """Count a decode step of the request that verifies `num_drafts` drafts (0: none were proposed)."""
        self.steps_without_drafts = 0 if num_drafts else self.steps_without_drafts + 1
