"""Per-version counts and durations in the shape of Triton's statistics extension (ModelStatistics):
what `perf_analyzer` splits a request's time with, and what a client diffs between two calls.

Recorded from the same readings as the Prometheus histograms, so the two agree: `success`/`fail`
from the request-duration observation, `queue` from the queue-duration one, the batch figures from
the batch-duration one. All times on time.perf_counter/time.monotonic, kept in integer nanoseconds.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Duration:
    """How many, and how long they took together (Triton's StatisticDuration)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        """`seconds` >= 0 (perf_counter differences; the queue time is clamped)."""
        self.count += 1
        self.ns += int(seconds * 1e9)


@dataclass(slots=True)  # a value, never changed; slots, not frozen: made per request or batch
class RequestTiming:
    """Where one request's server time went. `queue` waiting for and between its batches;
    `input` decoding it and handing its batches to the model; `infer` the model's time on its
    batches; `output` getting their outputs back, split and encoded; `total` from receiving it to
    its encoded answer. The first four add up to no more than `total`."""

    queue_seconds: float
    input_seconds: float
    infer_seconds: float
    output_seconds: float
    total_seconds: float


@dataclass(slots=True)
class BatchSizeStatistics:
    """Executed batches of one size (Triton's InferBatchStatistics)."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(slots=True)
class VersionStatistics:
    """One loaded version's figures since it was loaded. Mutated on the event loop only."""

    last_inference_ms: int = 0
    """Wall-clock milliseconds since the epoch of the last batch's end (0: none yet)."""
    inference_count: int = 0
    """Rows the model ran for requests (padding rows not counted)."""
    execution_count: int = 0
    """Batches the model ran."""
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchSizeStatistics] = field(default_factory=dict)
    """By the batch size the model ran (padding included)."""

    def batch_ran(self, rows: int, size: int, input_seconds: float, infer_seconds: float,
                  output_seconds: float) -> None:
        self.inference_count += rows
        self.execution_count += 1
        self.last_inference_ms = int(time.time() * 1000)
        batch = self.batches.get(size)
        if batch is None:
            batch = self.batches[size] = BatchSizeStatistics()
        batch.compute_input.add(input_seconds)
        batch.compute_infer.add(infer_seconds)
        batch.compute_output.add(output_seconds)

    def request_queued(self, queue_seconds: float) -> None:
        self.queue.add(queue_seconds)

    def request_succeeded(self, seconds: float, timing: RequestTiming | None) -> None:
        """`seconds`: the request-duration histogram's reading; `timing`: its split, where it ran."""
        self.success.add(seconds)
        if timing is not None:
            self.compute_input.add(timing.input_seconds)
            self.compute_infer.add(timing.infer_seconds)
            self.compute_output.add(timing.output_seconds)

    def request_failed(self, seconds: float) -> None:
        self.fail.add(seconds)


PeerStatistics = Callable[[list[int]], Awaitable[dict[int, list["VersionStatistics"]]]]
"""What the other front-end processes hold of the given servables (by id): with several
front-ends, each records the requests it answered, and a statistics call adds theirs up."""


def combined(own: VersionStatistics, others: list[VersionStatistics]) -> VersionStatistics:
    """One version's figures over every front-end process: counts and durations added, the
    latest last inference."""
    if not others:
        return own
    total = VersionStatistics()
    for part in (own, *others):
        total.last_inference_ms = max(total.last_inference_ms, part.last_inference_ms)
        total.inference_count += part.inference_count
        total.execution_count += part.execution_count
        for name in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
            _add(getattr(total, name), getattr(part, name))
        for size, batch in part.batches.items():
            into = total.batches.setdefault(size, BatchSizeStatistics())
            for name in ("compute_input", "compute_infer", "compute_output"):
                _add(getattr(into, name), getattr(batch, name))
    return total


def _add(into: Duration, part: Duration) -> None:
    into.count += part.count
    into.ns += part.ns
