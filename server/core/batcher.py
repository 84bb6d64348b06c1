"""Dynamic batching: merge concurrent requests into row-budgeted batches.

Policy: the three rules of server.core.batching_policy (its docstring says why), and
these:
- Batches are budgeted in rows (`max_batch_rows`), not requests. A request larger than the
  remaining budget is split: its first rows go now, the rest lead the next batch, and its outputs
  are reassembled in row order before its future resolves.
- A full batch goes at once. Otherwise, with a timeout, once its oldest row has waited that long
  (monotonic clock); with timeout 0 as soon as a slot is free; with None (auto) as _dispatch_at
  says: from measured batch times, arrival gaps, rows present at once and how busy the event loop
  is, nothing tuned.
- With `allowed_batch_sizes`, a batch is padded up to the next allowed size (its first row
  repeated) and the padding's outputs are dropped.
- At most `max_inflight` batches execute at once; while they run, the next batch keeps filling.
- The queue is bounded in rows: a request that would overflow it is refused at once (QueueFull:
  UNAVAILABLE, which clients retry; one that could never fit, Overloaded).
  A request that dies while queued (cancelled, or past its deadline) gives its rows back at once.
- Requests with different batch keys (signature, non-batch dimensions) never share a batch.
- Cancelled and expired requests are dropped before compute: the model never sees their rows.
- When a batch fails, its requests are re-run in halves (bisection) so that only the requests
  that make the model fail get the error; their well-formed neighbours still succeed. The re-runs
  are capped at RETRY_ROWS times the batch's rows.

- With a latency target (`target_s`), the batch size and when a batch goes follow
  server.core.latency_target instead of the auto rule, and requests that would miss the target
  are shed at arrival when the model cannot keep up within it.

The batcher owns time and futures; row offsets live in `assembly`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from server.config import batch_sizes_problem
from server.core.assembly import Tensors, check_rows, concat_rows, padding_rows, split_rows
from server.core.batching_policy import SMOOTHING, BatchCost, auto_bound, busy_share, dispatch_at, padded_rows
from server.core.latency_target import (
    ArrivalRate,
    Plan,
    RunTimeFit,
    late_after,
    latest_start,
    one_row_fits,
    plan,
    predicted_seconds,
    run_seconds,
    should_shed,
)
from server.errors import DeadlineExceeded, Overloaded, OverTarget, QueueFull, Unavailable

log = logging.getLogger("server.core.batcher")

RETRY_ROWS = 2
"""A failed batch's re-runs (to find the requests that fail it) cost at most this many times its
rows. Breadth-first halving finds one failing request among n within that (n, then n/2, n/4, ...:
under 2n rows); when every request fails, it stops after two levels (n + n rows re-run, 7 runs in
all), where halving down to single requests would run n log2 n rows in 2n - 1 runs."""


@dataclass(slots=True)  # a value, never changed; slots, not frozen: made per request or batch
class Ran:
    """What running one batch gave back."""

    outputs: Tensors
    """Its outputs, rows in order."""
    seconds: float
    """The model's time on it (compute_infer)."""
    input_seconds: float = 0.0
    """From the hand-off to the model starting on it: the copy into the model worker and the
    message there (compute_input's share of the batch; 0 where the runner cannot tell)."""
    run_rows: int = 0
    """Rows of the model run it was part of, when the worker merged it with other front-ends'
    batches (0: it ran alone)."""
    counted_rows: int | None = None
    """The requests' rows of that whole run, when this batch is the one to count it
    (mirrorserve_batch_rows); 0 when another front-end's batch counts it; None: it ran alone."""


RunBatch = Callable[[Hashable, list[Tensors], int], Awaitable[Ran]]
"""Runs one batch, given as the requests' parts in row order (and their rows, any padding part
not counted), somewhere other than the event loop (the model worker process; a thread in the
unit tests). The parts are not concatenated here: the model worker's side writes them straight
into shared memory, so a batch's inputs are copied once, not twice."""


@dataclass(slots=True)
class BatchTiming:
    """Where one batch's round trip went: handing it over, the model, and getting its outputs
    back and split per request (the three add up to the round trip)."""

    input_seconds: float
    infer_seconds: float
    output_seconds: float


class BatchObserver(Protocol):
    """What the batcher reports as it works (server.metrics.BatcherMetrics implements it)."""

    def queue_changed(self, rows: int, requests: int) -> None: ...
    def batch_started(self, rows: int) -> None: ...
    def batch_finished(self, rows: int, padded: int, timing: BatchTiming | None, counted: int) -> None:
        """`rows` of the requests, `padded` the size the model ran; timing is None when it failed;
        `counted`: the requests' rows of the model run it was part of, to count as one run (0:
        counted by another front-end's batch of the same run)."""
    def request_finished(self, answer: Answer) -> None: ...
    def request_dropped(self, reason: str) -> None:
        """reason: "deadline" or "cancelled"; the request never reached the model."""
    def request_shed(self, reason: str) -> None:
        """Refused to keep the latency target: at arrival (reason "over_target"), or when its batch
        was taken and it could no longer be answered within the target (reason "late")."""
    def target_planned(self, key: Hashable, plan: Plan, wait_s: float, fit: tuple[float, float, float],
                       rows_per_second: float) -> None:
        """The latency target's new plan for `key`'s requests: its sizes, the longest its oldest
        request waits for more rows, the fit (a, b, spread), the arrival rate."""


BatchTrace = Callable[[Hashable, list[Any], int, float, float, "BatchTiming"], None]
"""Told of a batch's end (server.tracing.batch_recorder): its key, its requests' trace contexts
(None for an untraced one), its rows, when it was handed to the model and came back (on the
batcher's clock), and where that round trip went (the worker's own timings)."""


class _NoObserver:
    def queue_changed(self, rows: int, requests: int) -> None:
        pass

    def batch_started(self, rows: int) -> None:
        pass

    def batch_finished(self, rows: int, padded: int, timing: BatchTiming | None, counted: int) -> None:
        pass

    def request_finished(self, answer: Answer) -> None:
        pass

    def request_dropped(self, reason: str) -> None:
        pass

    def request_shed(self, reason: str) -> None:
        pass

    def target_planned(self, key: Hashable, plan: Plan, wait_s: float, fit: tuple[float, float, float],
                       rows_per_second: float) -> None:
        pass


@dataclass(slots=True)  # a value, never changed; slots, not frozen: made per request or batch
class Answer:
    outputs: Tensors
    """This request's rows of every output, in its row order."""
    queue_seconds: float
    """Time in the batcher not spent on this request's batches: waiting."""
    compute_seconds: float
    """The model's time on the batches that carried this request's rows, summed."""
    input_seconds: float = 0.0
    """Handing those batches to the model, summed (BatchTiming.input_seconds)."""
    output_seconds: float = 0.0
    """Getting their outputs back and split, summed (BatchTiming.output_seconds)."""


@dataclass(slots=True)
class _TargetState:
    """The latency target's view of one key (signature): its run time, its arrival rate, and the
    plan made from them (None: to be made again)."""

    fit: RunTimeFit
    rate: ArrivalRate
    plan: Plan | None = None


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
    input_seconds: float = 0.0
    output_seconds: float = 0.0
    trace: Any = None
    """Its trace context (server.tracing), when batches are traced."""

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def deliver(self, start: int, outputs: Tensors, rows: int, timing: BatchTiming, now: float) -> Answer | None:
        """Record one part; when it completes the request, resolve it and return its answer."""
        if self.future.done():
            return None
        self.parts[start] = outputs
        self.done_rows += rows
        self.compute_seconds += timing.infer_seconds
        self.input_seconds += timing.input_seconds
        self.output_seconds += timing.output_seconds
        if self.done_rows < self.rows:
            return None
        busy = self.compute_seconds + self.input_seconds + self.output_seconds
        queue_seconds = max(0.0, now - self.enqueued_at - busy)
        if len(self.parts) > 1:
            outputs = concat_rows([self.parts[s] for s in sorted(self.parts)])
        # else: the one part, rows of the batch's outputs, which nobody writes to
        answer = Answer(outputs, queue_seconds, self.compute_seconds, self.input_seconds, self.output_seconds)
        self.future.set_result(answer)
        return answer

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


@dataclass(slots=True)
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
        timeout_s: float | None,
        max_queued_rows: int,
        max_inflight: int = 1,
        allowed_batch_sizes: tuple[int, ...] = (),
        clock: Callable[[], float] = time.monotonic,
        loop_cpu_clock: Callable[[], float] = time.thread_time,
        observer: BatchObserver | None = None,
        name: str = "the model",
        whole: Callable[[Hashable], bool] = lambda key: False,
        target_s: float | None = None,
        cost_seed: tuple[float, float] = (0.0, 0.0),
        on_batch: BatchTrace | None = None,
        trace_context: Callable[[], Any] = lambda: None,
    ) -> None:
        """`name`: what a refusal calls the queue's model (e.g. "model 'ranker' version 3").
        `whole(key)`: requests of that key are not batched: each runs alone, whole, at once (no
        batching, or a signature without a batch dimension), and its outputs are its own.
        `target_s`: the latency target (server.core.latency_target), None for none; `cost_seed`:
        the model's (a, b) as the warm-up measured them, used until enough batches have run.
        `on_batch`: told of every batch that served a traced request (server.tracing), with the
        contexts `trace_context` returned when its requests arrived; the core never sees more
        of a trace than these opaque values."""
        if max_batch_rows < 1 or max_queued_rows < 1 or max_inflight < 1 or (timeout_s or 0) < 0:
            raise ValueError("batcher limits must be positive")
        problem = batch_sizes_problem(allowed_batch_sizes, max_batch_rows, max_name="the batch budget")
        if problem:
            raise ValueError(problem)
        self._run_batch = run_batch
        self._name = name
        self._whole = whole
        self._max_batch_rows = max_batch_rows
        self._timeout_s = timeout_s
        self._max_queued_rows = max_queued_rows
        self._max_inflight = max_inflight
        self._allowed_batch_sizes = allowed_batch_sizes
        self._clock = clock
        self._loop_cpu_clock = loop_cpu_clock
        """CPU time of the thread running the event loop (the batcher only runs on it)."""
        self._observer: BatchObserver = observer or _NoObserver()
        self._queues: dict[Hashable, deque[_Request]] = {}
        self._key_rows: dict[Hashable, int] = {}
        self._queued_rows = 0
        self._queued_requests = 0
        self._closed = False
        self._inflight: set[asyncio.Task[None]] = set()
        self._executing = 0
        """Batches taken and not yet finished (the task set lags: tasks leave it by callback)."""
        self._cost = BatchCost()
        """What a batch costs: its average time, and the part of it that does not grow with rows."""
        self._row_gap = math.inf
        """Moving average of the seconds between arriving rows (1 / the arrival rate); the first gap
        measured, until there are more."""
        self._last_arrival: float | None = None
        self._executing_rows = 0
        self._present = 0
        """The most rows present at once (queued or executing) since the last batch was taken..."""
        self._last_present = 0
        """...and the same over the cycle before it: the rows that ended a wait then."""
        self._free_since = 0.0
        """When the last executing batch ended (the model has been free since, if none executes)."""
        self._taken_at: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))
        """When the last two batches were taken: (clock, loop CPU clock); the event loop's busy
        share is measured from the earlier one, over a whole batch cycle and the present one."""
        self._task: asyncio.Task[None] | None = None
        self._target_s = target_s
        self._on_batch = on_batch
        self._trace_context = trace_context
        self._cost_seed = cost_seed
        self._targets: dict[Hashable, _TargetState] = {}
        """Per key (signature): the latency target's fit, arrival rate and plan."""
        self._sizes = list(allowed_batch_sizes) or list(range(1, max_batch_rows + 1))
        self._running: tuple[float, int, Hashable] = (0.0, 0, None)
        """When the latest batch was taken, its rows and key (for a new request's predicted time)."""

    def _target_state(self, key: Hashable) -> _TargetState:
        state = self._targets.get(key)
        if state is None:
            state = self._targets[key] = _TargetState(RunTimeFit(*self._cost_seed), ArrivalRate())
        return state

    def target_plan(self, key: Hashable) -> Plan | None:
        """The latency target's present plan for `key`'s requests (None without a target)."""
        if self._target_s is None:
            return None
        state = self._target_state(key)
        if state.plan is None:
            a, b = state.fit.ab()
            rate = state.rate.per_second(self._clock())
            spread = state.fit.spread()
            state.plan = plan(self._target_s, a, b, spread, rate, self._sizes)
            wait = max(0.0, self._target_s - state.plan.margin_s - run_seconds(a, b, state.plan.batch_size))
            self._observer.target_planned(key, state.plan, wait, (a, b, spread), rate)
        return state.plan

    def _replan(self) -> None:
        """A batch was taken or finished: every key's plan is made again when next asked for."""
        for state in self._targets.values():
            state.plan = None

    def _batch_rows(self, key: Hashable) -> int:
        """The rows that make a batch full (it goes at once): the budget, or with a target B*."""
        target = self.target_plan(key)
        return self._max_batch_rows if target is None else min(target.batch_size, self._max_batch_rows)

    def _take_rows(self, key: Hashable) -> int:
        """The most rows a batch takes: the budget, or with a target the plan's take size."""
        target = self.target_plan(key)
        return self._max_batch_rows if target is None else min(target.take_size, self._max_batch_rows)

    def wait_bound_s(self) -> float:
        """The longest a batch's oldest row waits for more now: the fixed timeout, or the auto
        rule's present bound."""
        return self._timeout_s if self._timeout_s is not None else self._auto_bound()

    @property
    def queued_rows(self) -> int:
        """Rows waiting for a batch."""
        return self._queued_rows

    def start(self) -> None:
        """Create the asyncio machinery; call from inside the running event loop."""
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(self._max_inflight)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    @property
    def max_queued_rows(self) -> int:
        return self._max_queued_rows

    def check_size(self, rows: int) -> None:
        """Overloaded if a request of `rows` rows could never be queued: callers whose decoding
        costs per row ask before they decode."""
        if rows > self._max_queued_rows:
            raise Overloaded(f"request has {rows} rows; at most {self._max_queued_rows} rows may be queued")

    async def submit(
        self, key: Hashable, inputs: Mapping[str, np.ndarray], rows: int, *, deadline: float | None = None
    ) -> Answer:
        """Queue a request's rows and wait for its outputs (rows in the same order).

        `deadline` is on this batcher's clock; a request still queued when it passes is dropped
        and fails with DeadlineExceeded.
        """
        if self._closed or self._task is None:
            raise Unavailable(f"{self._name} is being unloaded (or the server is stopping); retry, and the "
                              f"request goes to the version serving now")
        self.check_size(rows)
        if self._queued_rows + rows > self._max_queued_rows:
            raise QueueFull(f"queue full: {self._queued_rows} rows waiting for {self._name}, bound "
                            f"{self._max_queued_rows} (--max-queued-rows); retry later")
        now = self._clock()
        if deadline is not None and now >= deadline:
            self._observer.request_dropped("deadline")
            raise DeadlineExceeded("the deadline passed before the request was queued")
        if self._target_s is not None and not self._whole(key):
            self._target_state(key).rate.add(now, rows)
            self._shed_if_late(key, now, rows)
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        request = _Request(key, inputs, rows, future, now, deadline)
        if self._on_batch is not None:
            request.trace = self._trace_context()
        self._queues.setdefault(key, deque()).append(request)
        self._queued_requests += 1
        self._add_rows(key, rows)
        self._arrived(now, rows)
        expiry = None
        if deadline is not None:
            expiry = asyncio.get_running_loop().call_later(deadline - now, self._expire, request)

        def finished(_: object) -> None:
            if expiry is not None:
                expiry.cancel()
            self._unqueue_rest(request)

        future.add_done_callback(finished)
        self._wakeup.set()
        return await future

    def _shed_if_late(self, key: Hashable, now: float, rows: int) -> None:
        """With a target: refuse a request predicted to miss it, so the ones served stay under it
        (server.core.latency_target.should_shed). Its key's fit prices the batches ahead of it
        (queued rows of other signatures too, at its own cost: a bound, not a schedule)."""
        target = self.target_plan(key)
        assert target is not None and self._target_s is not None
        state = self._target_state(key)
        a, b = state.fit.ab()
        left = 0.0
        if self._executing:
            taken_at, taken_rows, taken_key = self._running
            running = self._target_state(taken_key).fit.ab() if taken_key in self._targets else (a, b)
            left = max(0.0, taken_at + run_seconds(*running, taken_rows) - now)
        predicted = predicted_seconds(a, b, self._take_rows(key), left, self._queued_rows, rows,
                                      state.rate.per_second(now))
        if should_shed(predicted, self._target_s, target, state.fit.spread(), a, b, min(rows, target.take_size)):
            self._observer.request_shed("over_target")
            raise OverTarget(f"{self._name} cannot meet its latency target now: this request would take about "
                             f"{predicted * 1000:.0f} ms, over the target of {self._target_s * 1000:.0f} ms"
                             f"{'' if target.feasible else f' less a margin of {target.margin_s * 1000:.0f} ms'}; "
                             f"retry later or on another replica")

    def _late_after(self, key: Hashable, now: float) -> float:
        """With a target: requests queued before this time can no longer be answered within it by
        the batch taken now (server.core.latency_target.late_after); -inf without a target."""
        if self._target_s is None or self._whole(key):
            return -math.inf
        a, b = self._target_state(key).fit.ab()
        if not one_row_fits(self._target_s, a, b):  # no request can make it: served as without a target
            return -math.inf
        return late_after(now, self._target_s, a, b, min(self._key_rows.get(key, 0), self._take_rows(key)))

    def _refuse_late(self, request: _Request, now: float) -> None:
        """Fail a queued request that would be answered past the target anyway: the model's time
        goes to the requests that can still make it (Clockwork's and Triton's REJECT-on-timeout
        idea, against the target instead of a per-request timeout)."""
        self._observer.request_shed("late")
        waited = now - request.enqueued_at
        target_ms = (self._target_s or 0.0) * 1000
        request.fail(OverTarget(f"{self._name} cannot meet its latency target of {target_ms:.0f} ms for this request: "
                                f"it waited {waited * 1000:.0f} ms behind others and its batch would end past the "
                                f"target; retry later or on another replica"))
        self._unqueue_rest(request)
        self._pop_head(self._queues[request.key])

    async def drain(self) -> None:
        """Refuse new requests, finish every queued and running one, then stop the loop."""
        self._closed = True
        while self._queued_rows > 0 or self._inflight:
            await asyncio.sleep(0.005)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _arrived(self, now: float, rows: int) -> None:
        """Measure the arrival rate (as the average gap between rows) and the rows present at once."""
        if self._last_arrival is not None:
            gap = (now - self._last_arrival) / rows
            self._row_gap = gap if math.isinf(self._row_gap) else self._row_gap + SMOOTHING * (gap - self._row_gap)
        self._last_arrival = now
        self._present = max(self._present, self._queued_rows + self._executing_rows)

    def _add_rows(self, key: Hashable, rows: int) -> None:
        self._queued_rows += rows
        self._key_rows[key] = self._key_rows.get(key, 0) + rows
        self._observer.queue_changed(self._queued_rows, self._queued_requests)

    def _unqueue_rest(self, request: _Request) -> None:
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
        self._unqueue_rest(request)
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
            self._last_present, self._present = self._present, self._queued_rows + self._executing_rows
            self._taken_at = (self._taken_at[1], (self._clock(), self._loop_cpu_clock()))
            self._running = (self._taken_at[1][0], rows, key)
            self._replan()
            task = asyncio.get_running_loop().create_task(self._execute(key, slices, rows))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    def _dispatch_at(self, key: Hashable, first: _Request) -> float:
        """When the batch that `first` heads goes, unless it fills up before (rules 1 and 2 of
        server.core.batching_policy, which holds the rule). Every arrival and every batch's end
        wakes the loop, which asks again. With a latency target: at once when the model is idle,
        else when the oldest request must start to meet the target (a full batch goes before)."""
        if self._target_s is not None:
            if not self._executing:
                return first.enqueued_at
            target = self.target_plan(key)
            assert target is not None
            a, b = self._target_state(key).fit.ab()
            rows = min(self._key_rows.get(key, 0), self._take_rows(key))
            return latest_start(first.enqueued_at, self._target_s, target.margin_s, a, b, rows)
        return dispatch_at(first.enqueued_at, self._timeout_s, self._executing, self._cost.seconds, self._auto_bound,
                           self._row_gap, self._key_rows.get(key, 0), self._last_present, self._free_since)

    def _auto_bound(self) -> float:
        """batching_policy.auto_bound, the event loop's busy share measured since the batch before
        last was taken (a whole batch cycle and the present one, so an idle spell shows at once)."""
        taken, taken_cpu = self._taken_at[0]
        busy = busy_share(self._clock() - taken, self._loop_cpu_clock() - taken_cpu)
        return auto_bound(self._cost.fixed_seconds, busy, self._max_batch_rows, self._row_gap)

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
        return next((k for k, rows in self._key_rows.items() if rows >= self._batch_rows(k)), None)

    async def _next_batch(self) -> tuple[Hashable, list[_Slice]]:
        while True:
            oldest = self._oldest_key()
            if oldest is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            key, first = oldest
            while not self._whole(key):
                full = self._full_key()
                if full is not None:
                    key = full  # a full batch goes at once, even while an older one is filling
                    break
                remaining = self._dispatch_at(key, first) - self._clock()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                # The loop's timer runs on the loop's clock, which may be cached for a whole
                # iteration (uvloop's is, to the millisecond): on waking, ask this clock again.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._wakeup.wait()
            slices = self._take(key)
            if slices:
                return key, slices

    def _take(self, key: Hashable) -> list[_Slice]:
        """Cut up to max_batch_rows (with a target, the take size) live rows off the front of key's queue."""
        queue = self._queues.get(key)
        slices: list[_Slice] = []
        whole = self._whole(key)
        budget = self._take_rows(key)
        now = self._clock()
        late_after = self._late_after(key, now)
        while queue and budget > 0 and not (whole and slices):
            request = queue[0]
            if self._drop_dead(request, now):
                self._pop_head(queue)
                continue
            if request.enqueued_at < late_after and not request.dispatched:
                self._refuse_late(request, now)
                continue
            n = request.rows - request.next_row if whole else min(request.rows - request.next_row, budget)
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
            if not self._executing:
                self._free_since = self._clock()
            self._slots.release()
            self._wakeup.set()  # a batch waiting only while this one ran may go now

    async def _run_isolating(self, key: Hashable, live: list[_Slice]) -> None:
        """Run the slices as one batch; if it fails, re-run its requests in halves, breadth-first,
        each failing half split again, down to single requests, within RETRY_ROWS x the batch's
        rows. A request alone that fails gets its own error; one whose half cannot be afforded
        any more gets that half's."""
        if not live:
            return
        error = await self._run_once(key, live)
        if error is None:
            return
        budget = RETRY_ROWS * sum(s.rows for s in live)
        failed: deque[tuple[list[_Slice], Exception]] = deque([(live, error)])
        while failed:
            group, error = failed.popleft()
            requests = list(dict.fromkeys(s.request for s in group))
            if len(requests) == 1:
                requests[0].fail(error)
                continue
            first = set(requests[: len(requests) // 2])
            live_now = [s for s in group if not s.request.future.done()]
            for half in ([s for s in live_now if s.request in first], [s for s in live_now if s.request not in first]):
                rows = sum(s.rows for s in half)
                if rows > budget:
                    for request in dict.fromkeys(s.request for s in half):
                        request.fail(error)
                    continue
                budget -= rows
                again = await self._run_once(key, half) if half else None
                if again is not None:
                    failed.append((half, again))

    async def _run_once(self, key: Hashable, live: list[_Slice]) -> Exception | None:
        rows = sum(s.rows for s in live)
        self._observer.batch_started(rows)
        timing: BatchTiming | None = None
        counted = rows
        parts = [s.inputs() for s in live]
        padded = rows if self._whole(key) else padded_rows(self._allowed_batch_sizes, rows)
        if padded > rows:
            parts.append(padding_rows(parts[0], padded - rows))
        try:
            handed = self._clock()
            ran = await self._run_batch(key, parts, rows)
            outputs = ran.outputs
            if self._whole(key):  # one request's own outputs, whatever their shapes
                split = [outputs]
            else:
                check_rows(outputs, padded, "batch")
                if padded > rows:
                    outputs = {name: array[:rows] for name, array in outputs.items()}
                split = split_rows(outputs, [s.rows for s in live])
            self._cost.add(ran.run_rows or padded, ran.seconds)
            now = self._clock()
            if self._target_s is not None and not self._whole(key):
                # The whole round trip, not the model's time alone: handing the batch over and
                # splitting its answer are part of every request's wait behind it.
                self._target_state(key).fit.add(ran.run_rows or padded, now - handed)
                self._replan()
            if ran.counted_rows is not None:
                counted = ran.counted_rows
            input_seconds = max(0.0, ran.input_seconds)
            timing = BatchTiming(input_seconds, ran.seconds, max(0.0, now - handed - input_seconds - ran.seconds))
        except Exception as exc:
            return exc
        finally:
            self._observer.batch_finished(rows, padded, timing, counted)
        for s, part in zip(live, split, strict=True):
            answer = s.request.deliver(s.start, part, s.rows, timing, now)
            if answer is not None:
                self._observer.request_finished(answer)
        if self._on_batch is not None:
            try:
                self._on_batch(key, [s.request.trace for s in live], rows, handed, now, timing)
            except Exception:  # a trace is never worth a batch: its answers are out already
                log.exception("recording the batch's trace failed")
        return None
