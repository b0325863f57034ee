"""`StepCostFit`: the time a model step of a given size is expected to take, fitted online to recent steps.

A step's size is its `StepKey` (scheduled tokens, sampled rows); its cost is modelled as seconds = a + b * tokens +
c * rows with a, b, c >= 0 (a fixed cost, a cost per token, a cost per row), fitted by least squares to the last
steps. The thread policy (`worker/thread_policy.py`) judges each step by its time over this expectation, so steps
of any size compare.
"""

from __future__ import annotations

import statistics
from collections import deque

StepKey = tuple[int, int]  # (scheduled tokens, sampled rows)


class StepCostFit:
    """Least-squares step time `a + b * tokens + c * rows` (seconds; a, b, c >= 0: `nonnegative_least_squares`)
    over the last `window` steps of one thread count.

    The sums behind the fit are updated per step (O(1); exact integers for the sizes), so `expected` costs
    microseconds. Where the steps leave a direction undetermined (decode-only steps have tokens == rows; all steps
    one size) a ridge of `ridge` x each size's own variance picks the smallest slopes that fit, which predicts
    right along the sizes seen; sizes off them are refused by the range check.

    Args:
        window: steps kept (>= 1).
        min_steps: steps needed before `expected` answers.
        margin: how far beyond the range of sizes seen `expected` still answers (factor on the largest tokens and
            rows, divisor on the smallest). 2 by default: while requests join, rows grow by more than a quarter
            between the steps a fit saw and the probe's (at 1.25 the first probe of a seeded replay in
            `tests/unit/test_thread_policy.py` judged none of its steps).
        ridge: the ridge, a fraction of each size's variance.
    Raises:
        ValueError: min_steps outside 1..window, margin < 1 or ridge <= 0.
    """

    def __init__(self, window: int = 64, min_steps: int = 4, margin: float = 2.0, ridge: float = 1e-3) -> None:
        if not 1 <= min_steps <= window or margin < 1 or ridge <= 0:
            raise ValueError("StepCostFit needs 1 <= min_steps <= window, margin >= 1 and ridge > 0")
        self.window, self.min_steps, self.margin, self.ridge = window, min_steps, margin, ridge
        self._steps: deque[tuple[int, int, float]] = deque()
        self._sums = [0, 0, 0, 0, 0, 0.0, 0.0, 0.0]  # x, y, xx, xy, yy (ints), t, xt, yt (x: tokens, y: rows)
        self._adds = 0
        self._model: tuple[float, float, float, int, int, int, int] | None = None  # a, b, c, x range, y range

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, key: StepKey, seconds: float) -> None:
        """Account one step of size `key` (tokens, rows) that took `seconds`."""
        self._steps.append((key[0], key[1], seconds))
        self._accumulate(key[0], key[1], seconds, 1)
        if len(self._steps) > self.window:
            self._accumulate(*self._steps.popleft(), -1)
        self._adds += 1
        if self._adds % self.window == 0:  # float sums drift with every subtraction: start them afresh
            self._sums = [0, 0, 0, 0, 0, 0.0, 0.0, 0.0]
            for step in self._steps:
                self._accumulate(*step, 1)
        self._model = None

    def _accumulate(self, x: int, y: int, t: float, sign: int) -> None:
        s = self._sums
        s[0] += sign * x
        s[1] += sign * y
        s[2] += sign * x * x
        s[3] += sign * x * y
        s[4] += sign * y * y
        s[5] += sign * t
        s[6] += sign * x * t
        s[7] += sign * y * t

    def expected(self, key: StepKey, margin: float | None = None) -> float | None:
        """Seconds the fit expects for a step of size `key`, or None where it cannot say: fewer than `min_steps`
        steps, `key` outside the sizes seen (with `margin`: this fit's own unless given; 1 answers only inside
        them), or an expectation that is not positive."""
        if len(self._steps) < self.min_steps:
            return None
        if self._model is None:
            self._model = self._solve()
        a, b, c, x_lo, x_hi, y_lo, y_hi = self._model
        x, y = key
        m = self.margin if margin is None else margin
        if not (x_lo <= m * x and x <= m * x_hi and y_lo <= m * y and y <= m * y_hi):
            return None
        seconds = a + b * x + c * y
        return seconds if seconds > 0 else None

    def median_seconds(self) -> float:
        """The median seconds of the steps kept (0.0 when there are none)."""
        return statistics.median(seconds for _, _, seconds in self._steps) if self._steps else 0.0

    def recent_ratios(self, num_steps: int) -> list[float]:
        """The last `num_steps` steps' seconds over what the fit expects for their sizes, oldest first (steps the fit
        cannot judge left out)."""
        ratios = []
        for x, y, seconds in list(self._steps)[-num_steps:]:
            expected = self.expected((x, y))
            if expected is not None:
                ratios.append(seconds / expected)
        return ratios

    def _solve(self) -> tuple[float, float, float, int, int, int, int]:
        n = len(self._steps)
        sx, sy, sxx, sxy, syy, st, sxt, syt = self._sums
        ridge_x = self.ridge * (n * sxx - sx * sx) / n  # the ridge on each slope: a fraction of its centred sum of
        ridge_y = self.ridge * (n * syy - sy * sy) / n  # squares (exact integers until here)
        normal = [
            [float(n), float(sx), float(sy)],
            [float(sx), sxx + ridge_x, float(sxy)],
            [float(sy), float(sxy), syy + ridge_y],
        ]
        a, b, c = nonnegative_least_squares(normal, [st, sxt, syt])
        xs, ys = [step[0] for step in self._steps], [step[1] for step in self._steps]
        return a, b, c, min(xs), max(xs), min(ys), max(ys)


def nonnegative_least_squares(normal: list[list[float]], rhs: list[float]) -> list[float]:
    """The coefficients >= 0 that minimize a least-squares problem given by its normal equations (`normal` [k, k],
    symmetric positive semi-definite; `rhs` [k]): the unconstrained solution when it is >= 0, else the best of the
    solutions with some coefficients held at 0 (every subset is tried: k is 3 here). All zeros when none fits.

    Why: a step's cost parts (a fixed cost, a cost per token, a cost per row) are each at least zero, while an
    unconstrained fit of a few noisy steps (beside a busy process) can trade a negative intercept for a steep slope
    and expect a negative time for a size just beside the ones it saw."""
    k = len(rhs)
    best, best_value = [0.0] * k, 0.0  # the objective (less a constant): theta . normal . theta - 2 theta . rhs
    for mask in range((1 << k) - 1, 0, -1):
        free = [i for i in range(k) if mask >> i & 1]
        solved = _solve_linear([[normal[i][j] for j in free] for i in free], [rhs[i] for i in free])
        if solved is None or min(solved) < 0:
            continue
        theta = [0.0] * k
        for i, value in zip(free, solved, strict=True):
            theta[i] = value
        value = sum(theta[i] * (sum(normal[i][j] * theta[j] for j in range(k)) - 2 * rhs[i]) for i in range(k))
        if value < best_value - 1e-12 * max(1.0, abs(best_value)):
            best, best_value = theta, value
        if mask == (1 << k) - 1:
            return best  # the unconstrained solution is >= 0: it is the minimum
    return best


def _solve_linear(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """`matrix @ x = rhs` by Gaussian elimination with partial pivoting ([k, k], small k), or None when singular."""
    k = len(rhs)
    rows = [[*matrix[i], rhs[i]] for i in range(k)]
    scale = max((abs(v) for row in matrix for v in row), default=0.0)
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-12 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, k):
            factor = rows[r][col] / rows[col][col]
            for j in range(col, k + 1):
                rows[r][j] -= factor * rows[col][j]
    x = [0.0] * k
    for i in range(k - 1, -1, -1):
        x[i] = (rows[i][k] - sum(rows[i][j] * x[j] for j in range(i + 1, k))) / rows[i][i]
    return x
