"""Dynamic batching: merge concurrent requests into row-budgeted batches.

Policy (see architecture.md, examples 2-5):
- Batches are budgeted in rows (`max_batch_rows`), not requests. A request larger than the
  remaining budget is split: its first rows go now, the rest lead the next batch, and its outputs
  are reassembled in row order before its future resolves.
- Once the oldest queued request arrived, a batch waits at most `timeout_s` (monotonic clock) for
  more rows; a batch that is full goes at once. Because the wait counts from the first row's
  arrival, rows that queued while the model was busy go out without further delay.
- With no timeout (the default) a batch goes at once while requests arrive one at a time, and
  waits briefly, bounded by `max_auto_wait_s`, once they arrive together; while batches stay
  small, only as long as another batch is executing, and not at all unless batches are short
  (see SHORT_BATCH_S). Larger batches that are short also wait for a running batch to end instead
  of starting beside it (see _dispatch_at). A wait ends early once no batch executes and as
  many rows are queued as were lately present at once (see _all_present).
- At most `max_inflight` batches execute at once; while they run, the next batch keeps filling.
- The queue is bounded in rows: a request that would overflow it is refused at once (Overloaded).
  A request that dies while queued (cancelled, or past its deadline) gives its rows back at once.
- Requests with different batch keys (signature, non-batch dimensions) never share a batch.
- Cancelled and expired requests are dropped before compute: the model never sees their rows.
- When a batch fails, its requests are re-run in halves (bisection) so that only the requests
  that make the model fail get the error; their well-formed neighbours still succeed.

The batcher owns time and futures; row offsets live in `assembly`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from server.core.assembly import Tensors, check_rows, concat_rows, split_rows
from server.errors import DeadlineExceeded, Overloaded, Unavailable

CONCURRENT_ROWS = 1.5
"""Average rows per batch from which requests are taken to arrive concurrently (auto wait on)."""
SMALL_BATCH_ROWS = 6.0
"""Below this average, an idle model is not kept waiting for more rows (auto wait only while
another batch executes, and only if batches end within max_auto_wait_s)."""
AUTO_WAIT_BATCHES = 4.0
"""Auto wait: this many average batch times..."""
AUTO_WAIT_MIN_S = 0.001
"""...but at least this long (and at most max_auto_wait_s)."""
SHORT_BATCH_S = 0.003
"""A batch that executes faster than this (and than max_auto_wait_s) is short: overhead-bound,
as the benchmark MLP's (~1-2 ms); the CNN's take 5-30 ms."""
PRESENT_WINDOW_BATCHES = 8
"""A wait ends early once the rows queued for the batch reach the most rows present at once
(queued or executing) over this many recent batches, while none executes."""
SMOOTHING = 0.2
"""Weight of the newest batch in the moving averages of batch rows and batch time."""

RunBatch = Callable[[Hashable, list[Tensors]], Awaitable[tuple[Tensors, float]]]
"""Runs one batch, given as the requests' parts in row order, somewhere other than the event loop
(the model worker process; a thread in the unit tests) and returns its outputs, rows in order,
and the seconds the model spent on it. The parts are not concatenated here: the model worker's
side writes them straight into shared memory, so a batch's inputs are copied once, not twice."""


class BatchObserver(Protocol):
    """What the batcher reports as it works (server.metrics.BatcherMetrics implements it)."""

    def queue_changed(self, rows: int, requests: int) -> None: ...
    def batch_started(self, rows: int) -> None: ...
    def batch_finished(self, seconds: float | None) -> None:
        """seconds is None when the batch failed."""
    def request_finished(self, queue_seconds: float) -> None: ...
    def request_dropped(self, reason: str) -> None:
        """reason: "deadline" or "cancelled"; the request never reached the model."""


class _NoObserver:
    def queue_changed(self, rows: int, requests: int) -> None:
        pass

    def batch_started(self, rows: int) -> None:
        pass

    def batch_finished(self, seconds: float | None) -> None:
        pass

    def request_finished(self, queue_seconds: float) -> None:
        pass

    def request_dropped(self, reason: str) -> None:
        pass


@dataclass(frozen=True)
class Answer:
    outputs: Tensors
    """This request's rows of every output, in its row order."""
    queue_seconds: float
    """Time in the batcher not spent computing this request's batches."""
    compute_seconds: float
    """Execution time of the batches that carried this request's rows, summed."""


@dataclass(eq=False)
class _Request:
    key: Hashable
    inputs: Mapping[str, np.ndarray]
    rows: int
    future: asyncio.Future[Answer]
    enqueued_at: float
    deadline: float | None
    next_row: int = 0
    """Rows before this one have been handed to a batch (or given back, once the request died)."""
    dispatched: bool = False
    """Some of its rows were handed to the model; from then on it is never counted as dropped."""
    parts: dict[int, Tensors] = field(default_factory=dict)
    done_rows: int = 0
    compute_seconds: float = 0.0

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def deliver(self, start: int, outputs: Tensors, rows: int, compute_seconds: float, now: float) -> float | None:
        """Record one part; when it completes the request, resolve it and return its queue time."""
        if self.future.done():
            return None
        self.parts[start] = outputs
        self.done_rows += rows
        self.compute_seconds += compute_seconds
        if self.done_rows < self.rows:
            return None
        queue_seconds = max(0.0, now - self.enqueued_at - self.compute_seconds)
        if len(self.parts) > 1:
            outputs = concat_rows([self.parts[s] for s in sorted(self.parts)])
        # else: the one part, rows of the batch's outputs, which nobody writes to
        self.future.set_result(Answer(outputs, queue_seconds, self.compute_seconds))
        return queue_seconds

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


@dataclass(frozen=True)
class _Slice:
    request: _Request
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def inputs(self) -> Tensors:
        if self.start == 0 and self.stop == self.request.rows:
            return dict(self.request.inputs)
        return {n: a[self.start:self.stop] for n, a in self.request.inputs.items()}


class Batcher:
    def __init__(
        self,
        run_batch: RunBatch,
        *,
        max_batch_rows: int,
        timeout_s: float,
        max_queued_rows: int,
        max_inflight: int = 1,
        max_auto_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        observer: BatchObserver | None = None,
    ) -> None:
        if max_batch_rows < 1 or max_queued_rows < 1 or max_inflight < 1 or timeout_s < 0:
            raise ValueError("batcher limits must be positive")
        self._run_batch = run_batch
        self._max_batch_rows = max_batch_rows
        self._timeout_s = timeout_s
        self._max_queued_rows = max_queued_rows
        self._max_inflight = max_inflight
        self._max_auto_wait_s = max_auto_wait_s
        self._clock = clock
        self._observer: BatchObserver = observer or _NoObserver()
        self._queues: dict[Hashable, deque[_Request]] = {}
        self._key_rows: dict[Hashable, int] = {}
        self._queued_rows = 0
        self._queued_requests = 0
        self._closed = False
        self._inflight: set[asyncio.Task[None]] = set()
        self._executing = 0
        """Batches taken and not yet finished (the task set lags: tasks leave it by callback)."""
        self._executing_rows = 0
        self._present_peak = 0
        """The most rows present at once (queued or executing) since the last batch was taken..."""
        self._present_peaks: deque[int] = deque(maxlen=PRESENT_WINDOW_BATCHES)
        """...and the same for each of the last batches..."""
        self._all_present_rows = math.inf
        """...whose largest is the rows that end a wait early (none until a batch was taken)."""
        self._batch_seconds = 0.0
        """Moving average of a batch's execution time."""
        self._batch_rows = 1.0
        """Moving average of a batch's rows: about 1 while requests arrive one at a time."""
        self._task: asyncio.Task[None] | None = None

    @property
    def queued_rows(self) -> int:
        """Rows waiting for a batch."""
        return self._queued_rows

    def start(self) -> None:
        """Create the asyncio machinery; call from inside the running event loop."""
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(self._max_inflight)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def submit(
        self, key: Hashable, inputs: Mapping[str, np.ndarray], rows: int, *, deadline: float | None = None
    ) -> Answer:
        """Queue a request's rows and wait for its outputs (rows in the same order).

        `deadline` is on this batcher's clock; a request still queued when it passes is dropped
        and fails with DeadlineExceeded.
        """
        if self._closed or self._task is None:
            raise Unavailable("the server is not accepting requests (draining or not started)")
        if rows > self._max_queued_rows:
            raise Overloaded(f"request has {rows} rows; at most {self._max_queued_rows} rows may be queued")
        if self._queued_rows + rows > self._max_queued_rows:
            raise Overloaded(
                f"queue full: {self._queued_rows} rows waiting, bound {self._max_queued_rows}; retry later"
            )
        now = self._clock()
        if deadline is not None and now >= deadline:
            self._observer.request_dropped("deadline")
            raise DeadlineExceeded("the deadline passed before the request was queued")
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        request = _Request(key, inputs, rows, future, now, deadline)
        self._queues.setdefault(key, deque()).append(request)
        self._queued_requests += 1
        self._add_rows(key, rows)
        present = self._queued_rows + self._executing_rows
        if present > self._present_peak:
            self._present_peak = present
        expiry = None
        if deadline is not None:
            expiry = asyncio.get_running_loop().call_later(deadline - now, self._expire, request)

        def finished(_: object) -> None:
            if expiry is not None:
                expiry.cancel()
            self._release(request)

        future.add_done_callback(finished)
        self._wakeup.set()
        return await future

    async def drain(self) -> None:
        """Refuse new requests, finish every queued and running one, then stop the loop."""
        self._closed = True
        while self._queued_rows > 0 or self._inflight:
            await asyncio.sleep(0.005)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _add_rows(self, key: Hashable, rows: int) -> None:
        self._queued_rows += rows
        self._key_rows[key] = self._key_rows.get(key, 0) + rows
        self._observer.queue_changed(self._queued_rows, self._queued_requests)

    def _release(self, request: _Request) -> None:
        """A request that finished while rows of it were still queued gives them back."""
        left = request.rows - request.next_row
        if left and request.key in self._key_rows:
            request.next_row = request.rows
            self._add_rows(request.key, -left)

    def _expire(self, request: _Request) -> None:
        """Deadline timer: fail a request still waiting, giving its rows back at once."""
        if not request.future.done():
            if not request.dispatched:
                self._observer.request_dropped("deadline")
            request.fail(DeadlineExceeded("the deadline passed while the request was queued"))

    def _drop_dead(self, request: _Request, now: float) -> bool:
        """Fail or forget a queued request that must not reach the model; True if it was dead."""
        if request.future.done():
            if request.future.cancelled() and not request.dispatched:
                self._observer.request_dropped("deadline" if request.expired(now) else "cancelled")
        elif request.expired(now):
            self._expire(request)
        else:
            return False
        self._release(request)
        return True

    def _pop_head(self, queue: deque[_Request]) -> None:
        queue.popleft()
        self._queued_requests -= 1
        self._observer.queue_changed(self._queued_rows, self._queued_requests)

    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                key, slices = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            rows = sum(s.rows for s in slices)
            self._executing += 1
            self._executing_rows += rows
            self._present_peaks.append(self._present_peak)
            self._all_present_rows = max(self._present_peaks)
            self._present_peak = self._queued_rows + self._executing_rows
            task = asyncio.get_running_loop().create_task(self._execute(key, slices, rows))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    def _dispatch_at(self, first: _Request) -> float:
        """When the batch that `first` heads goes, unless it fills up before.

        With a timeout: that long after its first row arrived. Without (the default), at once
        while requests arrive one at a time, so a lone client never waits. Once batches carry
        several rows on average, requests are arriving together and the batch waits a little
        (AUTO_WAIT_BATCHES average batch times, at least AUTO_WAIT_MIN_S, at most max_auto_wait_s):
        on a server whose event loop is the bottleneck, fewer and larger batches free the time
        that every batch costs it, and both throughput and latency improve (issue 5's benchmark).
        While batches stay small (under SMALL_BATCH_ROWS rows on average), the wait lasts only
        as long as another batch executes: a few rows save little of that per-batch time, and
        with a few clients the rows that could come are usually queued already, so an idle
        model kept waiting was pure delay (4 clients, side by side, median of 3: the MLP went
        from 543 to 898 req/s, against 880 with batching off; the CNN from 391 to 555, against
        525; even at 16 and 64 clients). And when batches are not short (they take SHORT_BATCH_S
        or longer, or longer than the longest wait), a small batch goes at once into the free
        slot: it could not outwait the running batch anyway, or would only start beside it a few
        ms later (the CNN at 4 clients, side by side, 8 rounds: 515 against 484 req/s, 6 rounds
        of 8 won, against 509 with batching off; the MLP, whose batches take ~1 ms, is not
        affected).
        Once batches are not small, and while they are short (under SHORT_BATCH_S and
        max_auto_wait_s), a batch that is not full does not start beside a running one: it waits
        for that batch to end (then for the rest of its own wait) and takes every row that came
        meanwhile. A second short batch saves no time, and two calls into TensorFlow at once
        cost more CPU per row (the MLP at 64 clients, three rounds side by side, each won: 3,385
        / 3,385 / 2,435 against 2,516 / 3,274 / 1,699 req/s; the model worker spent 125-191 µs
        of CPU per request against 135-309, all processes together 494-697 against 523-976).
        Long batches (a compute-bound model's) still run two at once, which fills the cores
        TensorFlow leaves idle; and a full batch, which has nothing to wait for, takes a free
        slot at once.
        """
        if self._timeout_s > 0:
            return first.enqueued_at + self._timeout_s
        if self._max_auto_wait_s <= 0 or self._batch_rows < CONCURRENT_ROWS:
            return first.enqueued_at
        short = self._batch_seconds < min(SHORT_BATCH_S, self._max_auto_wait_s)
        if self._batch_rows < SMALL_BATCH_ROWS:
            if self._executing == 0 or not short:
                return first.enqueued_at
        elif self._executing and short:
            return math.inf  # until the running batch ends (or this one fills)
        wait = max(AUTO_WAIT_MIN_S, AUTO_WAIT_BATCHES * self._batch_seconds)
        return first.enqueued_at + min(self._max_auto_wait_s, wait)

    def _all_present(self, key: Hashable) -> bool:
        """Whether an auto wait can end early: no batch executes, and the rows queued for this
        batch are as many as the most rows present at once in recent batches. Under a closed
        loop (C clients, each waiting for its answer before it sends again) every client is then
        queued, and no row can come before this batch answers some: waiting longer is pure delay.
        This is what lets the wait be long enough to gather large batches under heavy load
        without taxing a few clients (16 MLP clients, side by side: 2,509 against 2,139 req/s
        with a 3 ms wait, and 1,030 with a 10 ms one without this)."""
        return (self._timeout_s == 0 and self._executing == 0
                and self._key_rows.get(key, 0) >= self._all_present_rows)

    def _oldest_key(self) -> tuple[Hashable, _Request] | None:
        """The key whose head request has waited longest, sweeping dead heads."""
        best: tuple[Hashable, _Request] | None = None
        now = self._clock()
        for key in list(self._queues):
            queue = self._queues[key]
            while queue and self._drop_dead(queue[0], now):
                self._pop_head(queue)
            if not queue:
                del self._queues[key]
                del self._key_rows[key]
            elif best is None or queue[0].enqueued_at < best[1].enqueued_at:
                best = (key, queue[0])
        return best

    def _full_key(self) -> Hashable | None:
        return next((k for k, rows in self._key_rows.items() if rows >= self._max_batch_rows), None)

    async def _next_batch(self) -> tuple[Hashable, list[_Slice]]:
        while True:
            oldest = self._oldest_key()
            if oldest is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            key, first = oldest
            while True:
                full = self._full_key()
                if full is not None:
                    key = full  # a full batch goes at once, even while an older one is filling
                    break
                remaining = self._dispatch_at(first) - self._clock()
                if remaining <= 0 or self._all_present(key):
                    break
                self._wakeup.clear()
                if remaining == math.inf:
                    await self._wakeup.wait()
                    continue
                try:
                    async with asyncio.timeout(remaining):
                        await self._wakeup.wait()
                except TimeoutError:
                    break
            slices = self._take(key)
            if slices:
                return key, slices

    def _take(self, key: Hashable) -> list[_Slice]:
        """Cut up to max_batch_rows live rows off the front of key's queue."""
        queue = self._queues.get(key)
        slices: list[_Slice] = []
        budget = self._max_batch_rows
        now = self._clock()
        while queue and budget > 0:
            request = queue[0]
            if self._drop_dead(request, now):
                self._pop_head(queue)
                continue
            n = min(request.rows - request.next_row, budget)
            request.dispatched = True
            slices.append(_Slice(request, request.next_row, request.next_row + n))
            request.next_row += n
            budget -= n
            if request.next_row == request.rows:
                self._pop_head(queue)
            self._add_rows(key, -n)
        if queue is not None and not queue:
            del self._queues[key]
            del self._key_rows[key]
        return slices

    async def _execute(self, key: Hashable, slices: list[_Slice], rows: int) -> None:
        try:
            now = self._clock()
            # Last look before compute: a request cancelled or expired since it was taken is
            # dropped (its other slices, if any, are skipped since its future is done).
            for s in slices:
                if s.request.expired(now):
                    self._expire(s.request)
            await self._run_isolating(key, [s for s in slices if not s.request.future.done()])
        finally:
            self._executing -= 1
            self._executing_rows -= rows
            self._slots.release()
            self._wakeup.set()  # a small batch waiting only while this one ran may go now

    async def _run_isolating(self, key: Hashable, live: list[_Slice]) -> None:
        """Run the slices as one batch; if it fails, re-run each half, down to single requests."""
        if not live:
            return
        error = await self._run_once(key, live)
        if error is None:
            return
        requests = list(dict.fromkeys(s.request for s in live))
        if len(requests) == 1:
            requests[0].fail(error)
            return
        half = requests[: len(requests) // 2]
        first = [s for s in live if s.request in half and not s.request.future.done()]
        await self._run_isolating(key, first)
        await self._run_isolating(key, [s for s in live if s.request not in half and not s.request.future.done()])

    async def _run_once(self, key: Hashable, live: list[_Slice]) -> Exception | None:
        rows = sum(s.rows for s in live)
        self._observer.batch_started(rows)
        seconds: float | None = None
        try:
            outputs, elapsed = await self._run_batch(key, [s.inputs() for s in live])
            check_rows(outputs, rows, "batch")
            seconds = elapsed
            self._batch_seconds += SMOOTHING * (elapsed - self._batch_seconds)
            self._batch_rows += SMOOTHING * (rows - self._batch_rows)
        except Exception as exc:
            return exc
        finally:
            self._observer.batch_finished(seconds)
        now = self._clock()
        for s, part in zip(live, split_rows(outputs, [s.rows for s in live]), strict=True):
            queue_seconds = s.request.deliver(s.start, part, s.rows, elapsed, now)
            if queue_seconds is not None:
                self._observer.request_finished(queue_seconds)
        return None
