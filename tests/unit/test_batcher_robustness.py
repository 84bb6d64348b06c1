"""server.core.batcher.Batcher under failure: deadlines, cancellation, bisection of failed batches, and
the queue gauge after requests die in every way.

Same setup as test_batcher.py (a fake model on a one-thread executor, `asyncio.run` in each test,
no pytest-asyncio); the fakes are in batcher_fakes.py, the fixtures in conftest.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from batcher_fakes import (
    FakeModel,
    Poisoned,
    RecordingObserver,
    Tensors,
    assert_answer,
    fail_on_negative,
    on_thread,
    refused,
    request,
    until,
)

from server.core.batcher import RETRY_ROWS, Batcher
from server.errors import DeadlineExceeded

pytestmark = pytest.mark.timeout(30)


def start(model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver, **limits: Any) -> Batcher:
    """A started Batcher; call inside the running loop."""
    settings: dict[str, Any] = {"max_batch_rows": 64, "timeout_s": 0.01, "max_queued_rows": 1000}
    settings.update(limits)
    batcher = Batcher(on_thread(model, executor), observer=observer, **settings)
    batcher.start()
    return batcher


def rows_of(values: list[int]) -> Tensors:
    return {"x": np.array(values, dtype=np.int64).reshape(len(values), 1)}


async def submit(batcher: Batcher, inputs: Tensors, deadline: float | None = None) -> Tensors:
    answer = await batcher.submit("k", inputs, int(inputs["x"].shape[0]), deadline=deadline)
    return answer.outputs


async def turns(n: int = 2) -> None:
    """Let the event loop run `n` rounds of ready callbacks (no timers, no executor)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def hold_one_batch(b: Batcher, model: FakeModel) -> asyncio.Task[Tensors]:
    """Close the gate and put rows 0 and 1 into the model (max_batch_rows=2, so they go at once);
    with max_inflight=1 nothing else is taken, and nothing queued is swept, until the gate opens."""
    model.gate.clear()
    held = asyncio.create_task(submit(b, request(0, 2)))
    await until(lambda: len(model.calls) == 1)
    assert b.queued_rows == 0
    return held



# --- deadlines -----------------------------------------------------------------------------------


@pytest.mark.parametrize("position", ["head", "middle"])
def test_expired_request_fails_and_never_reaches_the_model(
    position: str, model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver
) -> None:
    """Queued behind a held batch, a request whose deadline passes fails with DeadlineExceeded once
    the batcher looks at the queue again; its rows never run, the requests around it are served.
    At the head of the queue it is swept by _oldest_key, in the middle by _take."""

    async def main() -> None:
        b = start(model, executor, observer, max_batch_rows=2, timeout_s=0.0)
        held = await hold_one_batch(b, model)
        inputs = {"doomed": request(100, 2), "a": request(200, 1), "c": request(300, 3), "patient": request(400, 1)}
        # `patient` has a deadline too, far off: it changes nothing.
        deadlines = {"doomed": time.monotonic() + 0.05, "patient": time.monotonic() + 10}
        order = ["doomed", "a", "c", "patient"] if position == "head" else ["a", "doomed", "c", "patient"]
        tasks = {name: asyncio.create_task(submit(b, inputs[name], deadlines.get(name))) for name in order}
        await asyncio.sleep(0)
        assert b.queued_rows == 7
        await asyncio.sleep(0.1)  # past the deadline; the model still holds rows 0 and 1
        model.gate.set()
        with pytest.raises(DeadlineExceeded, match="deadline passed while the request was queued"):
            await asyncio.wait_for(tasks.pop("doomed"), timeout=2)
        assert_answer(request(0, 2), await held)
        for name, task in tasks.items():
            assert_answer(inputs[name], await task)
        await b.drain()
        assert model.batches() == [[0, 1], [200, 300], [301, 302], [400]]
        assert observer.dropped == ["deadline"]
        assert b.queued_rows == 0

    asyncio.run(main())


def test_deadline_already_past_is_refused_at_once(
    model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver
) -> None:
    async def main() -> None:
        b = start(model, executor, observer, max_batch_rows=4, timeout_s=0.0)
        for deadline in (time.monotonic() - 1.0, time.monotonic()):  # reaching the deadline is passing it
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="deadline passed before the request was queued"):
                await asyncio.wait_for(submit(b, request(100, 3), deadline), timeout=0.5)
            assert time.monotonic() - t0 < 0.1
        assert observer.dropped == ["deadline", "deadline"]
        assert observer.queue == []  # never queued
        assert b.queued_rows == 0
        ok = request(0, 2)
        assert_answer(ok, await submit(b, ok, time.monotonic() + 10))
        await b.drain()
        assert model.rows_seen() == [0, 1]
        assert observer.dropped == ["deadline", "deadline"]

    asyncio.run(main())


def test_expired_request_gives_its_rows_back_while_the_model_is_busy(
    model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver
) -> None:
    async def main() -> None:
        b = start(model, executor, observer, max_batch_rows=2, timeout_s=0.0, max_queued_rows=4)
        held = await hold_one_batch(b, model)
        doomed = asyncio.create_task(submit(b, request(100, 3), time.monotonic() + 0.05))
        await asyncio.sleep(0.15)
        try:
            assert b.queued_rows == 0
            assert doomed.done()
        finally:
            model.gate.set()
            await held
            await asyncio.gather(doomed, return_exceptions=True)
            await b.drain()

    asyncio.run(main())


# --- cancellation --------------------------------------------------------------------------------


def test_cancelled_request_gives_its_rows_back_at_once(
    model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver
) -> None:
    async def main() -> None:
        b = start(model, executor, observer, max_batch_rows=2, timeout_s=0.0, max_queued_rows=4)
        held = await hold_one_batch(b, model)
        victim = asyncio.create_task(submit(b, request(100, 3)))
        await asyncio.sleep(0)
        assert b.queued_rows == 3
        await refused(submit(b, request(200, 2)), "queue full: 3 rows waiting for the model, bound 4")

        victim.cancel()
        await turns(2)
        # Given back while the model still holds the first batch, so before any sweep.
        assert b.queued_rows == 0
        assert observer.queue[-1][0] == 0
        assert len(model.calls) == 1 and not held.done()
        with pytest.raises(asyncio.CancelledError):
            await victim

        newcomer = request(200, 2)  # refused above; the freed room lets it in now
        admitted = asyncio.create_task(submit(b, newcomer))
        await asyncio.sleep(0)
        assert not admitted.done()
        assert b.queued_rows == 2
        await refused(submit(b, request(300, 3)), "queue full: 2 rows waiting for the model, bound 4")

        model.gate.set()
        assert_answer(request(0, 2), await held)
        assert_answer(newcomer, await admitted)
        await b.drain()
        assert model.batches() == [[0, 1], [200, 201]]  # rows 100..102 never ran
        assert observer.dropped == ["cancelled"]
        assert b.queued_rows == 0

    asyncio.run(main())


SPLIT_DEATHS = ["cancel_while_first_part_runs", "cancel_after_first_part_delivered", "deadline_while_first_part_runs"]


async def split_request_dies(
    how: str, model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver
) -> None:
    """A 10-row request (max_batch_rows=4: parts 0-3, 4-7, 8-9) dies after its first part reached
    the model; a 1-row request queues behind it. Its unsent rows never run and leave the queue."""
    b = start(model, executor, observer, max_batch_rows=4, timeout_s=0.0)
    if how == "cancel_after_first_part_delivered":
        model.holds[4] = threading.Event()  # part 0-3 is answered, part 4-7 is held
        ran = list(range(8))
    else:
        model.gate.clear()  # part 0-3 is held
        ran = list(range(4))
    # The deadline leaves ample time for part 0-3 to be taken before it passes, even on a slow machine.
    deadline = time.monotonic() + 0.25 if how.startswith("deadline") else None
    big = asyncio.create_task(submit(b, request(0, 10), deadline))
    await until(lambda: len(model.calls) == len(ran) // 4)
    assert b.queued_rows == 10 - len(ran)
    behind = request(100, 1)
    behind_task = asyncio.create_task(submit(b, behind))
    await asyncio.sleep(0)
    assert b.queued_rows == 11 - len(ran)

    if how.startswith("cancel"):
        big.cancel()
        await turns(2)
        assert b.queued_rows == 1  # its unsent rows are given back while the model is still held
        with pytest.raises(asyncio.CancelledError):
            await big
    else:
        await asyncio.sleep(0.3)  # past the deadline, the first part still in the model
    model.release_all()
    if deadline is not None:
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(big, timeout=2)
    assert_answer(behind, await behind_task)
    await b.drain()
    assert model.rows_seen() == [*ran, 100]
    assert b.queued_rows == 0


@pytest.mark.parametrize("how", SPLIT_DEATHS)
def test_split_request_that_dies_leaves_its_remaining_rows_uncomputed(
    how: str, model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver
) -> None:
    asyncio.run(split_request_dies(how, model, executor, observer))


@pytest.mark.parametrize(
    "how", ["cancel_while_first_part_runs", "cancel_after_first_part_delivered", "deadline_while_first_part_runs"]
)
def test_split_request_that_reached_the_model_is_not_counted_as_dropped(
    how: str, model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver
) -> None:
    asyncio.run(split_request_dies(how, model, executor, observer))
    assert observer.dropped == []  # BatchObserver.request_dropped: "the request never reached the model"


# --- bisection of failed batches -----------------------------------------------------------------

# _run_isolating runs a failed batch's requests again in two halves, first half (the first
# len // 2 requests in queue order, so the smaller half when the count is odd) before the second,
# breadth-first: every half of one level runs before the halves of a failed half do. A run of one
# request that fails fails that request; a run that succeeds answers its requests. The re-runs may
# cost RETRY_ROWS (2) x the batch's rows; a half that no longer fits fails with the error of the
# run it came from. Each tuple below is the [lo, hi) index range of the requests in one model call,
# in call order.
#
# 16, marked 5:     16 fails -> [0,8) fails, [8,16) ok -> [0,4) ok, [4,8) fails -> [4,6) fails,
#                   [6,8) ok -> [4] ok, [5] fails.                    Re-run rows 30 of 32.
# 16, marked 2, 11: 16 fails -> [0,8) fails, [8,16) fails -> [0,4) fails, [4,8) ok, [8,12) fails,
#                   [12,16) ok: 32 rows re-run, the budget spent; [0,4) and [8,12) fail whole, with
#                   their runs' error (6 well-formed requests fail beside the 2 that fail the model).
# 16, all marked:   16 -> [0,8), [8,16) -> four quarters, all failing: 7 runs, 48 rows in all, where
#                   halving down to single requests would take 31 runs and 80 rows.
# 7, marked 6:      7 fails -> [0,3) ok, [3,7) fails -> [3,5) ok, [5,7) fails -> [5] ok, [6] fails.
BISECTIONS: dict[tuple[int, tuple[int, ...]], list[tuple[int, int]]] = {
    (16, (5,)): [(0, 16), (0, 8), (8, 16), (0, 4), (4, 8), (4, 6), (6, 8), (4, 5), (5, 6)],
    (16, (2, 11)): [(0, 16), (0, 8), (8, 16), (0, 4), (4, 8), (8, 12), (12, 16)],
    (16, tuple(range(16))): [(0, 16), (0, 8), (8, 16), (0, 4), (4, 8), (8, 12), (12, 16)],
    (7, (6,)): [(0, 7), (0, 3), (3, 7), (3, 5), (5, 7), (5, 6), (6, 7)],
}
FAILED_WITH: dict[tuple[int, tuple[int, ...]], dict[int, int]] = {
    (16, (5,)): {5: 1},
    (16, (2, 11)): {i: 4 for i in (0, 1, 2, 3, 8, 9, 10, 11)},
    (16, tuple(range(16))): {i: 4 for i in range(16)},
    (7, (6,)): {6: 1},
}
"""The requests that fail, with the rows of the run whose error they get."""


@pytest.mark.parametrize(
    ("n", "marked", "sizes"),
    [
        (16, (5,), [16, 8, 8, 4, 4, 2, 2, 1, 1]),
        (16, (2, 11), [16, 8, 8, 4, 4, 4, 4]),
        (16, tuple(range(16)), [16, 8, 8, 4, 4, 4, 4]),
        (7, (6,), [7, 3, 4, 2, 2, 1, 1]),
    ],
    ids=["16-one-marked", "16-two-marked-capped", "16-all-marked-capped", "7-odd-halves"],
)
def test_bisection_fails_the_marked_requests_within_its_budget(
    n: int, marked: tuple[int, ...], sizes: list[int], model: FakeModel, executor: ThreadPoolExecutor,
    observer: RecordingObserver,
) -> None:
    model.respond = fail_on_negative
    values = [-1 if i in marked else 100 + i for i in range(n)]
    ranges = BISECTIONS[(n, marked)]

    async def main() -> None:
        # n one-row requests submitted together fill one batch of max_batch_rows=n at once (the
        # 0.2 s timeout would let them all join anyway).
        b = start(model, executor, observer, max_batch_rows=n, timeout_s=0.2)
        inputs = [rows_of([v]) for v in values]
        results = await asyncio.wait_for(
            asyncio.gather(*(submit(b, r) for r in inputs), return_exceptions=True), timeout=5
        )
        assert [c.rows for c in model.calls] == sizes
        assert model.batches() == [values[lo:hi] for lo, hi in ranges]
        failing = FAILED_WITH[(n, marked)]
        for i, (r, result) in enumerate(zip(inputs, results, strict=True)):
            if i in failing:
                assert isinstance(result, Poisoned), (i, result)
                assert str(result) == f"batch of {failing[i]} rows"  # alone: its own error
            else:
                assert_answer(r, result)
        assert sum(sizes[1:]) <= RETRY_ROWS * n

        # The next batch is unaffected.
        calls = len(model.calls)
        after = request(1000, n)
        assert_answer(after, await submit(b, after))
        assert model.batches()[calls:] == [list(range(1000, 1000 + n))]
        await b.drain()
        assert b.queued_rows == 0

    asyncio.run(main())
    assert observer.started == [*sizes, n]
    failed_runs = [any(lo <= m < hi for m in marked) for lo, hi in ranges] + [False]
    assert [s is None for s in observer.finished] == failed_runs
    assert len(observer.request_queue_seconds) == n - len(FAILED_WITH[(n, marked)]) + 1
    assert observer.dropped == []


def test_split_request_whose_last_part_fails_spares_its_batch_mates(
    model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver
) -> None:
    model.respond = fail_on_negative

    async def main() -> None:
        b = start(model, executor, observer, max_batch_rows=4, timeout_s=0.05)
        a, big, mate, later = rows_of([500]), rows_of([0, 1, 2, 3, -1, 5]), rows_of([600]), rows_of([700])
        results = await asyncio.wait_for(
            asyncio.gather(*(submit(b, r) for r in (a, big, mate, later)), return_exceptions=True), timeout=5
        )
        # big's first part succeeds with `a`; its second part fails with `mate`, then alone, and
        # `mate` alone succeeds; `later` did not fit and goes next.
        assert model.batches() == [[500, 0, 1, 2], [3, -1, 5, 600], [3, -1, 5], [600], [700]]
        assert isinstance(results[1], Poisoned) and str(results[1]) == "batch of 3 rows"
        for r, result in zip((a, mate, later), (results[0], results[2], results[3]), strict=True):
            assert_answer(r, result)
        await b.drain()
        assert b.queued_rows == 0

    asyncio.run(main())
    assert observer.started == [4, 4, 3, 1, 1]
    assert observer.dropped == []


def test_split_request_whose_middle_part_fails_never_runs_its_last_part(
    model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver
) -> None:
    model.respond = fail_on_negative

    async def main() -> None:
        b = start(model, executor, observer, max_batch_rows=4, timeout_s=0.0)
        big, behind = rows_of([0, 1, 2, 3, 4, -1, 6, 7, 8, 9]), rows_of([600])
        results = await asyncio.wait_for(
            asyncio.gather(submit(b, big), submit(b, behind), return_exceptions=True), timeout=5
        )
        # Part 4-7 fails; alone in its batch, it is not re-run. Rows 8 and 9 are given back.
        assert model.batches() == [[0, 1, 2, 3], [4, -1, 6, 7], [600]]
        assert isinstance(results[0], Poisoned) and str(results[0]) == "batch of 4 rows"
        assert_answer(behind, results[1])
        await b.drain()
        assert b.queued_rows == 0

    asyncio.run(main())
    assert observer.dropped == []


# --- queue gauge ---------------------------------------------------------------------------------


async def mixed_outcomes(model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver) -> None:
    """Behind a held batch: a request that completes, one that fails, one cancelled, one expired.
    The last two are swept after the failed batch's bisection, so a sweep is the queue's last change."""
    model.respond = fail_on_negative
    b = start(model, executor, observer, max_batch_rows=2, timeout_s=0.0)
    held = await hold_one_batch(b, model)
    ok, bad = request(10, 1), rows_of([-1])
    ok_task = asyncio.create_task(submit(b, ok))
    bad_task = asyncio.create_task(submit(b, bad))
    cancelled = asyncio.create_task(submit(b, request(30, 1)))
    expired = asyncio.create_task(submit(b, request(40, 1), time.monotonic() + 0.05))
    await asyncio.sleep(0)
    assert b.queued_rows == 4
    cancelled.cancel()
    await turns(2)
    assert b.queued_rows == 3
    await asyncio.sleep(0.1)
    model.gate.set()
    assert_answer(request(0, 2), await held)
    assert_answer(ok, await ok_task)
    with pytest.raises(Poisoned):
        await bad_task
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(expired, timeout=2)
    await b.drain()
    assert model.batches() == [[0, 1], [10, -1], [10], [-1]]
    assert sorted(observer.dropped) == ["cancelled", "deadline"]
    assert b.queued_rows == 0


def test_queue_is_empty_after_every_kind_of_outcome(
    model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver
) -> None:
    asyncio.run(mixed_outcomes(model, executor, observer))
    assert observer.queue[-1][0] == 0
    assert all(rows >= 0 and requests >= 0 for rows, requests in observer.queue)


def test_observer_sees_an_empty_queue_after_every_kind_of_outcome(
    model: FakeModel, executor: ThreadPoolExecutor, observer: RecordingObserver
) -> None:
    asyncio.run(mixed_outcomes(model, executor, observer))
    assert observer.queue[-1] == (0, 0)
