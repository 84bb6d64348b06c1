"""Which batches the model worker runs next, and which it runs together. Pure: no TensorFlow.

Each front-end process batches what reaches it and sends its batches (Run) on its own channel.
With several front-ends, batches of one version and signature from different front-ends arrive
close together; run one at a time, each would be small. So the worker runs at most
`max_inflight` batches of a servable at once (each front-end would otherwise send its own
max_inflight), and while they run, the others wait here. When one finishes, the waiting batches
of the same signature are taken together, oldest first, as one model run: up to the servable's
row budget, and only to a size the model allows (`allowed_batch_sizes`, when it has them). A
signature served unbatched is never merged. With one front-end nothing ever waits here (its
batcher sends no more than max_inflight), so a single front-end runs exactly as before.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
"""Where a batch came from and how to answer it (the worker's front-end channel)."""


@dataclass(frozen=True)
class Rules:
    """A servable's merging rules, from its Load."""

    max_inflight: int
    max_rows: int
    allowed_sizes: tuple[int, ...] = ()
    unbatched: frozenset[str] = frozenset()
    """Signatures run alone, whole: never merged."""

    def fits(self, rows: int) -> bool:
        if rows > self.max_rows:
            return False
        return not self.allowed_sizes or rows in self.allowed_sizes


@dataclass(frozen=True)
class Part(Generic[T]):
    """One front-end's batch."""

    origin: T
    servable_id: int
    signature: str
    rows: int
    """Its rows as sent (padding included): where its outputs are cut from the run's."""


@dataclass
class _Servable(Generic[T]):
    rules: Rules
    running: int = 0
    waiting: deque[Part[T]] = field(default_factory=deque)


class RunQueue(Generic[T]):
    """Thread-safe. `submit` returns the run to start now (or None: it waits); `finished` the next
    run of that servable to start on the thread that just finished one (or None)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servables: dict[int, _Servable[T]] = {}

    def add(self, servable_id: int, rules: Rules) -> None:
        with self._lock:
            self._servables[servable_id] = _Servable(rules)

    def remove(self, servable_id: int) -> list[Part[T]]:
        """Forget a servable; the batches still waiting for it (to be failed)."""
        with self._lock:
            gone = self._servables.pop(servable_id, None)
        return [] if gone is None else list(gone.waiting)

    def submit(self, part: Part[T]) -> list[Part[T]] | None:
        with self._lock:
            state = self._servables.get(part.servable_id)
            if state is None:
                return [part]  # unknown servable: run it, so that it is failed by name
            if state.running < state.rules.max_inflight:
                state.running += 1
                return [part]
            state.waiting.append(part)
            return None

    def finished(self, servable_id: int) -> list[Part[T]] | None:
        with self._lock:
            state = self._servables.get(servable_id)
            if state is None:
                return None
            if not state.waiting:
                state.running -= 1
                return None
            return take(state.waiting, state.rules)


def take(waiting: deque[Part[T]], rules: Rules) -> list[Part[T]]:
    """The oldest waiting batch and, when its signature batches, the later ones of the same
    signature that fit beside it, in arrival order (the rest keep their places)."""
    first = waiting.popleft()
    run = [first]
    if first.signature in rules.unbatched:
        return run
    rows = first.rows
    kept: list[Part[T]] = []
    while waiting:
        part = waiting.popleft()
        if part.signature == first.signature and rules.fits(rows + part.rows):
            run.append(part)
            rows += part.rows
        else:
            kept.append(part)
    waiting.extendleft(reversed(kept))
    return run


def cut(total_rows: Sequence[int]) -> list[tuple[int, int]]:
    """Each part's [start, end) rows in the merged run."""
    bounds, start = [], 0
    for rows in total_rows:
        bounds.append((start, start + rows))
        start += rows
    return bounds


def shares(replica_rows: Sequence[int], start: int, end: int) -> tuple[int, ...]:
    """Rows of [start, end) that each replica ran, the run's rows having been split over the
    replicas in order (replica 0 the first rows): a part's own replica counts, which over all the
    parts of a run add up to the run's."""
    out, first = [], 0
    for count in replica_rows:
        last = first + count
        out.append(max(0, min(end, last) - max(start, first)))
        first = last
    return tuple(out)
