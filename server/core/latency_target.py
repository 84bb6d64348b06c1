"""Batching to a latency target: the user states a p99 for a model, the server finds the batch size.
Pure: numbers in, numbers out; the batcher keeps the clock.

The rule, in a few sentences. The model's run time is fitted online as a + b·rows from the batches
it runs (recent ones weigh more), and rows arrive at a measured rate λ. A batch of B rows runs
S(B) = a + b·B; a row that joins it waits at most for the batch before it to run or for its own to
fill (B / λ), whichever is longer, then for its own run: L(B) = max(S(B), B / λ) + S(B). The batch
size B* is the largest allowed size whose L(B) fits the target less a margin (three times the
fit's spread, and a tenth of the target). The smallest size that keeps up is the least B with
B / S(B) ≥ λ. A batch goes when the queue holds B* rows, when the model is idle (as without a
target), or when its oldest request would otherwise miss the target; it takes the rows waiting
then up to the take size, the largest B with S(B) + S(B*) within the budget (rows already
waiting need no filling, so a rate measured low does not starve a batch, and a request arriving
as it starts still fits). A request whose predicted time (the running batch's rest, the full
batches of the take size ahead of it, its own) exceeds the target less three spreads is refused
at arrival, so the ones served stay under it: in the bursts of a rate the model keeps up with,
and, against the target less the whole margin, at a rate it cannot keep up with. When a batch
is taken, a request it cannot answer within the target any more (it waited too long behind a
slow run) is refused too, and the model's time goes to those that can still make it. A target
below a one-row run, a + b, cannot be met at all: that is said at load, and such a model is
served as without shedding (its misses are the model's, not the queue's).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from server.core.batching_policy import BatchCost

FIT_WEIGHT = 0.05
"""Weight of the newest batch in the fit's moving averages: about the last twenty batches count,
so a change in the model's speed shows within a few dozen batches."""
SPREAD_MARGINS = 3.0
"""The margin takes this many times the fit's spread (its residuals' root mean square)..."""
TARGET_MARGIN = 0.1
"""...and this share of the target: what the fit cannot see (the event loop's own delays)."""
MIN_BATCHES = 8
"""Batches fitted before the fit is trusted over the warm-up's figures."""
RATE_WINDOW_S = 1.0
"""The arrival rate is the rows of the last second."""


class ArrivalRate:
    """Rows per second over the last RATE_WINDOW_S (over the time since the first arrival, before
    a whole window has passed)."""

    def __init__(self) -> None:
        self._arrivals: deque[tuple[float, int]] = deque()
        self._rows = 0
        self._first: float | None = None

    def add(self, now: float, rows: int) -> None:
        if self._first is None:
            self._first = now
        self._arrivals.append((now, rows))
        self._rows += rows

    def per_second(self, now: float) -> float:
        while self._arrivals and self._arrivals[0][0] <= now - RATE_WINDOW_S:
            self._rows -= self._arrivals.popleft()[1]
        if self._first is None:
            return 0.0
        return self._rows / max(min(now - self._first, RATE_WINDOW_S), 0.1 * RATE_WINDOW_S)


class RunTimeFit:
    """A model's run time as a + b·rows: a BatchCost whose newest batch weighs FIT_WEIGHT, with
    the spread of its residuals; the warm-up's (a, b) until MIN_BATCHES have run."""

    def __init__(self, a: float = 0.0, b: float = 0.0) -> None:
        self._seed = (a, b)
        self._cost = BatchCost(FIT_WEIGHT)

    def add(self, rows: int, seconds: float) -> None:
        self._cost.add(rows, seconds)

    @property
    def count(self) -> int:
        return self._cost.count

    @property
    def trusted(self) -> bool:
        return self.count >= MIN_BATCHES

    def ab(self) -> tuple[float, float]:
        """(a, b) in seconds and seconds per row: the warm-up's until MIN_BATCHES have run."""
        if not self.trusted:
            return self._seed
        return self._cost.fixed_seconds, self._cost.per_row_seconds

    def spread(self) -> float:
        """Root mean square of the residuals around the fit (seconds); 0 until trusted."""
        return self._cost.spread() if self.trusted else 0.0


def run_seconds(a: float, b: float, rows: int) -> float:
    return a + b * rows


def worst_latency(a: float, b: float, rate: float, rows: int) -> float:
    """L(B): the longest a row of a batch of `rows` spends, waiting and running, at `rate` rows/s."""
    run = run_seconds(a, b, rows)
    fill = rows / rate if rate > 0 else 0.0
    return max(run, fill) + run


@dataclass(frozen=True)
class Plan:
    batch_size: int
    """B*: the largest size whose worst latency fits the target (1 when none does): a batch goes
    once this many rows wait."""
    take_size: int
    """The most rows a batch takes of those already waiting: the largest size whose run, followed
    by a run of B*, fits (a request arriving as it starts can still be served in time); at least B*."""
    keep_up_size: int | None
    """The least size that keeps up with the arrival rate; None when no size does."""
    margin_s: float
    feasible: bool
    """Whether some size fits the target and the take size keeps up: if not, requests predicted
    past the target less the margin are refused (should_shed)."""


def plan(target_s: float, a: float, b: float, spread: float, rate: float, sizes: Sequence[int]) -> Plan:
    """B*, the take size and the size that keeps up, for a target at the measured rate; `sizes`:
    the sizes a batch may take (every size up to the maximum, or the allowed ones), ascending. The
    searches are bisections: L(B) grows with B, and so do S(B) and B / S(B)."""
    margin = SPREAD_MARGINS * spread + TARGET_MARGIN * target_s
    budget = target_s - margin
    fitting = bisect.bisect_right(sizes, budget, key=lambda size: worst_latency(a, b, rate, size))
    best = sizes[fitting - 1] if fitting else sizes[0]
    taking = bisect.bisect_right(sizes, budget, key=lambda size: run_seconds(a, b, size) + run_seconds(a, b, best))
    take = max(sizes[taking - 1] if taking else sizes[0], best)
    first = bisect.bisect_left(sizes, True, key=lambda size: size >= rate * run_seconds(a, b, size))
    keep_up = sizes[first] if first < len(sizes) else None
    return Plan(best, take, keep_up, margin, bool(fitting) and keep_up is not None and keep_up <= take)


def one_row_fits(target_s: float, a: float, b: float) -> bool:
    """Whether a lone row can ever meet the target (said at load when not)."""
    return run_seconds(a, b, 1) <= target_s


def predicted_seconds(a: float, b: float, batch_size: int, running_left_s: float, rows_ahead: int,
                      rows: int, rate: float) -> float:
    """A new request's predicted time: the running batch's rest, the full batches of `batch_size`
    (the plan's take size) that take the rows queued ahead of it, then its own batch: the rows
    with it now and those arriving at `rate` before it goes, up to `batch_size`."""
    size = max(batch_size, 1)
    full = (rows_ahead + rows - 1) // size
    waited = running_left_s + full * run_seconds(a, b, size)
    own = min(size, rows_ahead + rows - full * size + math.floor(rate * waited))
    return waited + run_seconds(a, b, own)


def should_shed(predicted_s: float, target_s: float, plan: Plan, spread: float, a: float, b: float,
                rows: int) -> bool:
    """Whether a request predicted to take `predicted_s` is refused. While the plan keeps up, past
    the target less the run time's noise (SPREAD_MARGINS spreads): a burst, few requests are near
    it; while it cannot, past the target less the whole margin (every request let in then waits
    near the edge, and half of those predicted at the bound would miss it). Never when its own
    run alone would miss: that miss is the model's, not the queue's."""
    bound = target_s - (SPREAD_MARGINS * spread if plan.feasible else plan.margin_s)
    return predicted_s > bound and run_seconds(a, b, rows) <= bound


def late_after(now: float, target_s: float, a: float, b: float, rows: int) -> float:
    """Requests queued before this time can no longer be answered within the target by a batch of
    `rows` taken now: its run, at the fitted time, ends past their target. No margin: a request
    refused here is a certain miss (with three spreads, an mlp at 30% load lost 25% of its
    requests to misses that would not have happened)."""
    return now + run_seconds(a, b, rows) - target_s


def latest_start(enqueued_at: float, target_s: float, margin_s: float, a: float, b: float, rows: int) -> float:
    """When a batch of `rows` whose oldest request arrived at `enqueued_at` must start at the
    latest for that request to meet the target."""
    return enqueued_at + target_s - margin_s - run_seconds(a, b, rows)
