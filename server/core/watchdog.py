"""When a batch has run too long: the model worker counts as hung.

A hung kernel, a blocking op or a loop that never ends leaves a batch unanswered for good, and
with it every request in it, every request queued behind it, and any drain or reload waiting for
it. Each batch therefore gets a time limit, from how long that version's batches usually take:

- `multiple` x the p99 of the version's last `window` batch times (send to answer, as the
  front-end sees it), but never under `floor_s` (the flag: a slow batch on a busy machine is
  not a hang);
- for a version's first `settling` batches, `first_multiple` x `floor_s`: the first calls of a
  signature may trace, compile or autotune.

Pure: the caller keeps the times and the clock. With the defaults a hang is noticed within
`first_multiple` x `floor_s` (90 s) early on, and within `floor_s` (30 s) for a version whose
batches take under 1.5 s.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

DEFAULT_FLOOR_S = 30.0


@dataclass(frozen=True)
class HangRule:
    floor_s: float = DEFAULT_FLOOR_S
    """Least time a batch may run before it counts as hung (--hang-timeout-s); 0: never."""
    multiple: float = 20.0
    first_multiple: float = 3.0
    settling: int = 20
    window: int = 200

    @property
    def enabled(self) -> bool:
        return self.floor_s > 0

    def limit_s(self, recent: BatchTimes) -> float:
        """The time limit of a version's next batch, given the times of its batches so far."""
        if recent.count < self.settling:
            return self.first_multiple * self.floor_s
        return max(self.floor_s, self.multiple * recent.p99())


@dataclass
class BatchTimes:
    """One version's recent batch times (seconds), newest last, and how many it has run."""

    window: int = 200
    count: int = 0
    seconds: deque[float] = field(default_factory=deque)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds.append(seconds)
        if len(self.seconds) > self.window:
            self.seconds.popleft()

    def p99(self) -> float:
        """The 99th percentile of the recent times (nearest rank); 0 with none."""
        if not self.seconds:
            return 0.0
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
