"""server.core.batcher.Batcher driven by a fake model on a one-thread executor.

pytest-asyncio is not used: every test runs its own `asyncio.run(main())`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
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
    double,
    fail_on_negative,
    on_thread,
    refused,
    request,
    until,
)

from server.core.batcher import Batcher
from server.errors import ModelFailure, Unavailable

pytestmark = pytest.mark.timeout(30)


def start(model: FakeModel, executor: ThreadPoolExecutor, **limits: Any) -> Batcher:
    """A started Batcher; call inside the running loop."""
    settings: dict[str, Any] = {"max_batch_rows": 64, "timeout_s": 0.01, "max_queued_rows": 1000}
    settings.update(limits)
    batcher = Batcher(on_thread(model, executor), **settings)
    batcher.start()
    return batcher


async def submit(batcher: Batcher, inputs: Tensors, key: Hashable = "k") -> Tensors:
    answer = await batcher.submit(key, inputs, int(inputs["x"].shape[0]))
    return answer.outputs


# ---------------------------------------------------------------------------------------------


def test_concurrent_requests_merge_and_each_gets_its_own_rows(
    model: FakeModel, executor: ThreadPoolExecutor
) -> None:
    async def main() -> None:
        b = start(model, executor, max_batch_rows=100, timeout_s=0.05)
        sizes = [1, 3, 2, 4, 1, 2, 5, 1]
        firsts = np.cumsum([0, *sizes])[:-1] * 10 + 1000
        reqs = [request(int(f), n) for f, n in zip(firsts, sizes, strict=True)]
        results = await asyncio.gather(*(submit(b, r) for r in reqs))
        for r, out in zip(reqs, results, strict=True):
            assert_answer(r, out)
        assert len(model.calls) == 1
        np.testing.assert_array_equal(model.calls[0].x, np.concatenate([r["x"] for r in reqs]))
        await b.drain()

    asyncio.run(main())


def test_row_budget_is_never_exceeded(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    async def main() -> None:
        b = start(model, executor, max_batch_rows=5, timeout_s=0.01)
        rng = np.random.default_rng(7)
        sizes = [int(n) for n in rng.integers(1, 10, size=20)]
        reqs = []
        first = 0
        for n in sizes:
            reqs.append(request(first, n))
            first += n
        results = await asyncio.gather(*(submit(b, r) for r in reqs))
        for r, out in zip(reqs, results, strict=True):
            assert_answer(r, out)
        batch_rows = [c.rows for c in model.calls]
        assert max(batch_rows) <= 5
        assert sum(batch_rows) == sum(sizes)
        # Everything was queued at once, so every batch but the last is full.
        assert all(n == 5 for n in batch_rows[:-1])
        # One key: rows reach the model in arrival order.
        assert model.rows_seen() == list(range(sum(sizes)))
        await b.drain()

    asyncio.run(main())


def test_large_request_is_split_and_reassembled(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    async def main() -> None:
        b = start(model, executor, max_batch_rows=4, timeout_s=0.01)
        alone = request(0, 10)
        assert_answer(alone, await submit(b, alone))
        assert [c.rows for c in model.calls] == [4, 4, 2]

        model.calls.clear()
        a, big, c = request(100, 3), request(200, 10), request(300, 2)
        results = await asyncio.gather(submit(b, a), submit(b, big), submit(b, c))
        for r, out in zip((a, big, c), results, strict=True):
            assert_answer(r, out)
        assert [call.x[:, 0].tolist() for call in model.calls] == [
            [100, 101, 102, 200],
            [201, 202, 203, 204],
            [205, 206, 207, 208],
            [209, 300, 301],
        ]
        await b.drain()

    asyncio.run(main())


def test_single_request_waits_for_the_timeout(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    async def main() -> None:
        b = start(model, executor, max_batch_rows=100, timeout_s=0.05)
        r = request(0, 1)
        t0 = time.monotonic()
        out = await submit(b, r)
        assert_answer(r, out)
        assert len(model.calls) == 1
        waited = model.calls[0].at - t0
        assert waited >= 0.049, waited
        assert waited < 0.5, waited
        await b.drain()

    asyncio.run(main())


def test_wait_counts_from_the_first_queued_row(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    async def main() -> None:
        b = start(model, executor, max_batch_rows=100, timeout_s=0.4)
        t0 = time.monotonic()
        first = asyncio.create_task(submit(b, request(0, 1)))
        await asyncio.sleep(0.2)
        second = asyncio.create_task(submit(b, request(1, 1)))
        await asyncio.gather(first, second)
        assert len(model.calls) == 1  # the late request joined the waiting batch
        went = model.calls[0].at - t0
        assert went >= 0.399, went
        assert went < 0.6, went  # not the second request's own deadline (0.6)
        await b.drain()

    asyncio.run(main())


def test_full_batch_goes_without_waiting(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    async def main() -> None:
        b = start(model, executor, max_batch_rows=4, timeout_s=5.0)
        reqs = [request(i, 1) for i in range(4)]
        t0 = time.monotonic()
        results = await asyncio.gather(*(submit(b, r) for r in reqs))
        assert time.monotonic() - t0 < 0.5
        for r, out in zip(reqs, results, strict=True):
            assert_answer(r, out)
        assert [c.rows for c in model.calls] == [4]
        await b.drain()

    asyncio.run(main())


def test_rows_queued_while_busy_go_at_once_when_the_model_frees(
    model: FakeModel, executor: ThreadPoolExecutor
) -> None:
    async def main() -> None:
        model.gate.clear()
        b = start(model, executor, max_batch_rows=2, timeout_s=0.3)
        held = asyncio.create_task(submit(b, request(0, 2)))  # full: goes at once, then is held
        await until(lambda: len(model.calls) == 1)
        waiting = asyncio.create_task(submit(b, request(2, 1)))
        await asyncio.sleep(0.35)  # longer than the timeout
        released = time.monotonic()
        model.gate.set()
        await asyncio.gather(held, waiting)
        assert len(model.calls) == 2
        assert model.calls[1].at - released < 0.15
        await b.drain()

    asyncio.run(main())


def test_queue_bound(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    async def main() -> None:
        model.gate.clear()
        b = start(model, executor, max_batch_rows=2, timeout_s=0.0, max_queued_rows=4)

        # Larger than the bound: refused even with an empty queue.
        await refused(submit(b, request(900, 5)), "request has 5 rows; at most 4 rows may be queued")

        held = asyncio.create_task(submit(b, request(0, 2)))
        await until(lambda: len(model.calls) == 1)
        assert b.queued_rows == 0
        second = asyncio.create_task(submit(b, request(10, 3)))
        await asyncio.sleep(0)
        assert b.queued_rows == 3

        t0 = time.monotonic()
        await refused(submit(b, request(500, 2)), "queue full: 3 rows waiting for the model, bound 4")
        await refused(submit(b, request(510, 2), key="another key"), "queue full")  # one bound for all keys
        third = asyncio.create_task(submit(b, request(20, 1)))
        await asyncio.sleep(0)
        assert b.queued_rows == 4
        await refused(submit(b, request(520, 1)), "queue full: 4 rows waiting for the model")
        await refused(submit(b, request(530, 5)), "request has 5 rows")
        assert time.monotonic() - t0 < 0.1  # refused at once, not after waiting
        assert not held.done()

        model.gate.set()
        for task, r in ((held, request(0, 2)), (second, request(10, 3)), (third, request(20, 1))):
            assert_answer(r, await task)
        assert sorted(model.rows_seen()) == [0, 1, 10, 11, 12, 20]
        assert all(c.rows <= 2 for c in model.calls)
        await b.drain()
        assert b.queued_rows == 0

    asyncio.run(main())


def test_different_keys_never_share_a_batch(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    async def main() -> None:
        b = start(model, executor, max_batch_rows=100, timeout_s=0.03)
        reqs: list[tuple[str, Tensors]] = []
        for i in range(6):
            reqs.append(("a", request(1000 + 10 * i, 1 + i % 3, width=1)))
            reqs.append(("b", request(2000 + 10 * i, 1 + i % 2, width=2)))
        results = await asyncio.gather(*(submit(b, r, key=k) for k, r in reqs))
        for (_, r), out in zip(reqs, results, strict=True):
            assert_answer(r, out)
        assert sorted(str(c.key) for c in model.calls) == ["a", "b"]
        for c in model.calls:
            base = 1000 if c.key == "a" else 2000
            assert ((c.x >= base) & (c.x < base + 1000)).all(), (c.key, c.x)
            assert c.x.shape[1] == (1 if c.key == "a" else 2)
        await b.drain()

    asyncio.run(main())


@pytest.mark.parametrize("cancel", [["r2"], ["r3"], ["r4"], ["r2", "r4"], ["r2", "r3", "r4"]], ids="+".join)
def test_cancelled_request_never_reaches_the_model(
    cancel: list[str], model: FakeModel, executor: ThreadPoolExecutor
) -> None:
    async def main() -> None:
        model.gate.clear()
        b = start(model, executor, max_batch_rows=10, timeout_s=0.0)
        r1 = request(0, 1)
        first = asyncio.create_task(submit(b, r1))
        await until(lambda: len(model.calls) == 1)
        queued = {"r2": request(100, 3), "r3": request(200, 2), "r4": request(300, 1)}
        tasks = {name: asyncio.create_task(submit(b, r)) for name, r in queued.items()}
        await asyncio.sleep(0)
        assert b.queued_rows == 6
        for name in cancel:
            tasks[name].cancel()
        for name in cancel:
            with pytest.raises(asyncio.CancelledError):
                await tasks[name]

        model.gate.set()
        assert_answer(r1, await first)
        for name, task in tasks.items():
            if name not in cancel:
                assert_answer(queued[name], await task)
        await b.drain()

        expected = [0] + [int(v) for n, r in queued.items() if n not in cancel for v in r["x"][:, 0]]
        assert model.rows_seen() == expected
        assert sum(c.rows for c in model.calls) == len(expected)
        assert b.queued_rows == 0

    asyncio.run(main())


def test_cancelled_split_request_leaves_its_remaining_rows_uncomputed(
    model: FakeModel, executor: ThreadPoolExecutor
) -> None:
    async def main() -> None:
        model.gate.clear()
        b = start(model, executor, max_batch_rows=4, timeout_s=0.0)
        big = asyncio.create_task(submit(b, request(0, 10)))
        await until(lambda: len(model.calls) == 1)  # rows 0..3 are in the model, held
        after = request(100, 1)
        behind = asyncio.create_task(submit(b, after))
        await asyncio.sleep(0)
        big.cancel()
        with pytest.raises(asyncio.CancelledError):
            await big
        model.gate.set()
        assert_answer(after, await behind)
        await b.drain()
        assert model.rows_seen() == [0, 1, 2, 3, 100]
        assert b.queued_rows == 0

    asyncio.run(main())


def test_failing_batch_fails_only_the_request_that_breaks_it(
    model: FakeModel, executor: ThreadPoolExecutor
) -> None:
    model.respond = fail_on_negative

    async def main() -> None:
        b = start(model, executor, max_batch_rows=2, timeout_s=0.05)
        bad, mate, c, d = request(-1, 1), request(10, 1), request(20, 1), request(30, 1)
        results = await asyncio.gather(*(submit(b, r) for r in (bad, mate, c, d)), return_exceptions=True)
        # The failed batch [bad, mate] is re-run in halves: bad alone fails, mate alone succeeds.
        assert [c.rows for c in model.calls] == [2, 1, 1, 2]
        assert isinstance(results[0], Poisoned) and str(results[0]) == "batch of 1 rows"
        assert_answer(mate, results[1])  # type: ignore[arg-type]
        assert_answer(c, results[2])  # type: ignore[arg-type]
        assert_answer(d, results[3])  # type: ignore[arg-type]
        # The batcher keeps serving.
        later = request(40, 2)
        assert_answer(later, await submit(b, later))
        await b.drain()

    asyncio.run(main())


def test_failure_of_a_split_request_drops_its_remaining_rows(
    model: FakeModel, executor: ThreadPoolExecutor
) -> None:
    model.respond = fail_on_negative

    async def main() -> None:
        b = start(model, executor, max_batch_rows=4, timeout_s=0.0)
        with pytest.raises(Poisoned, match="batch of 4 rows"):
            await submit(b, request(-1, 6))  # rows -1..2 fail in the first batch
        ok = request(50, 1)
        assert_answer(ok, await submit(b, ok))
        await b.drain()
        assert model.rows_seen() == [-1, 0, 1, 2, 50]  # rows 3 and 4 of the failed request never ran
        assert b.queued_rows == 0

    asyncio.run(main())


@pytest.mark.parametrize("bad_output", ["short", "long", "scalar"])
def test_wrong_number_of_output_rows_is_a_model_failure(
    bad_output: str, model: FakeModel, executor: ThreadPoolExecutor
) -> None:
    def wrong(key: Hashable, batch: Tensors) -> Tensors:
        x = batch["x"]
        y = {"short": x[:-1], "long": np.concatenate([x, x]), "scalar": np.array(7)}[bad_output]
        return {"y": y}

    async def main() -> None:
        model.respond = wrong
        b = start(model, executor, max_batch_rows=3, timeout_s=0.05)
        results = await asyncio.gather(submit(b, request(0, 1)), submit(b, request(1, 2)), return_exceptions=True)
        # The whole batch, then each request alone: every run returns the wrong row count.
        assert [c.rows for c in model.calls] == [3, 1, 2]
        for failed, rows in zip(results, (1, 2), strict=True):
            assert isinstance(failed, ModelFailure)
            assert f"expected {rows} rows" in str(failed)
            assert "output 'y'" in str(failed)
        model.respond = double
        ok = request(10, 2)
        assert_answer(ok, await submit(b, ok))
        await b.drain()

    asyncio.run(main())


def test_drain_finishes_queued_work_then_refuses(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    async def main() -> None:
        b = start(model, executor, max_batch_rows=3, timeout_s=0.2)
        reqs = [request(0, 2), request(2, 2), request(4, 3), request(7, 1)]
        tasks = [asyncio.create_task(submit(b, r)) for r in reqs]
        await asyncio.sleep(0)  # all queued
        await b.drain()
        assert sum(c.rows for c in model.calls) == 8
        assert b.queued_rows == 0
        for r, t in zip(reqs, tasks, strict=True):
            assert_answer(r, await t)
        with pytest.raises(Unavailable, match="the model is being unloaded"):
            await submit(b, request(100, 1))

    asyncio.run(main())


def test_drain_waits_for_the_running_batch(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    async def main() -> None:
        model.gate.clear()
        b = start(model, executor, max_batch_rows=1, timeout_s=0.0)
        r = request(0, 1)
        running = asyncio.create_task(submit(b, r))
        await until(lambda: len(model.calls) == 1)
        draining = asyncio.create_task(b.drain())
        await asyncio.sleep(0.05)
        assert not draining.done()
        with pytest.raises(Unavailable):
            await submit(b, request(1, 1))  # refused as soon as draining starts
        model.gate.set()
        await asyncio.wait_for(draining, timeout=2)
        assert_answer(r, await running)

    asyncio.run(main())


def test_submit_before_start_is_unavailable(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    async def main() -> None:
        b = Batcher(on_thread(model, executor), max_batch_rows=4, timeout_s=0.0, max_queued_rows=4)
        with pytest.raises(Unavailable, match="the model is being unloaded"):
            await submit(b, request(0, 1))

    asyncio.run(main())
    assert model.calls == []


@pytest.mark.parametrize(
    "limits",
    [
        {"max_batch_rows": 0},
        {"max_queued_rows": 0},
        {"max_inflight": 0},
        {"timeout_s": -0.1},
    ],
    ids=lambda d: next(iter(d)),
)
def test_invalid_limits(limits: dict[str, Any], model: FakeModel, executor: ThreadPoolExecutor) -> None:
    settings: dict[str, Any] = {"max_batch_rows": 4, "timeout_s": 0.0, "max_queued_rows": 4}
    settings.update(limits)
    with pytest.raises(ValueError, match="positive"):
        Batcher(on_thread(model, executor), **settings)


def test_full_batch_of_another_key_does_not_wait_behind_an_older_key(
    model: FakeModel, executor: ThreadPoolExecutor
) -> None:
    async def main() -> None:
        b = start(model, executor, max_batch_rows=4, timeout_s=0.8)
        older = asyncio.create_task(submit(b, request(0, 1), key="a"))
        await asyncio.sleep(0.01)
        full = request(100, 4)
        t0 = time.monotonic()
        try:
            assert_answer(full, await submit(b, full, key="b"))
            elapsed = time.monotonic() - t0
        finally:
            await older
            await b.drain()
        assert elapsed < 0.4, elapsed

    asyncio.run(main())


def test_answer_timings_and_observer(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    """Queue time is the wait before the batch; compute is the batch's run; a split request pays
    for every batch that carried its rows; the observer sees the same numbers."""

    def slow(key: Hashable, batch: Tensors) -> Tensors:
        time.sleep(0.05)
        return double(key, batch)

    model.respond = slow
    observer = RecordingObserver()

    async def main() -> None:
        b = Batcher(on_thread(model, executor), max_batch_rows=4, timeout_s=0.03, max_queued_rows=100,
                    observer=observer)
        b.start()
        one = await b.submit("k", request(0, 1), 1)
        split = await b.submit("k", request(10, 10), 10)  # 4 + 4 + 2 rows: three batches
        await b.drain()
        assert 0.025 < one.queue_seconds < 0.2, one
        assert 0.045 < one.compute_seconds < 0.2, one
        assert 0.14 < split.compute_seconds < 0.6, split
        assert split.queue_seconds < 0.2, split
        np.testing.assert_array_equal(split.outputs["y"], request(10, 10)["x"] * 2)

    asyncio.run(main())
    assert observer.started == [1, 4, 4, 2]
    assert len(observer.finished) == 4 and all(s is not None and s >= 0.045 for s in observer.finished)
    assert len(observer.request_queue_seconds) == 2
    assert observer.queue[0] == (1, 1) and observer.queue[-1] == (0, 0)
    assert (10, 1) in observer.queue  # the split request queued whole
    assert max(rows for rows, _ in observer.queue) == 10


def test_failed_batch_reports_no_duration(model: FakeModel, executor: ThreadPoolExecutor) -> None:
    def broken(key: Hashable, batch: Tensors) -> Tensors:
        raise RuntimeError("boom")

    model.respond = broken
    observer = RecordingObserver()

    async def main() -> None:
        b = Batcher(on_thread(model, executor), max_batch_rows=4, timeout_s=0.0, max_queued_rows=100, observer=observer)
        b.start()
        with pytest.raises(RuntimeError, match="boom"):
            await b.submit("k", request(0, 2), 2)
        await b.drain()

    asyncio.run(main())
    assert observer.started == [2] and observer.finished == [None]
    assert observer.request_queue_seconds == []


def test_whole_requests_run_alone_each_in_one_batch_whatever_its_rows(
    model: FakeModel, executor: ThreadPoolExecutor
) -> None:
    """Batching off (or a signature without a batch dimension): each request is one model run, all
    of it at once, never merged with another nor split by the row budget, and sent without a wait."""

    async def main() -> None:
        b = start(model, executor, max_batch_rows=3, timeout_s=10.0, whole=lambda key: key == "alone")
        big, small, other = request(0, 256), request(1000, 3), request(2000, 2)
        started = time.monotonic()
        results = await asyncio.gather(submit(b, big, key="alone"), submit(b, small, key="alone"),
                                       submit(b, other, key="alone"))
        assert time.monotonic() - started < 5  # none waited out the 10 s timeout
        for inputs, outputs in zip((big, small, other), results, strict=True):
            assert_answer(inputs, outputs)
        assert [c.rows for c in model.calls] == [256, 3, 2]
        batched = [request(3000 + 10 * i, 1) for i in range(3)]  # another key still batches: one full batch
        await asyncio.gather(*(submit(b, r, key="batched") for r in batched))
        assert [c.rows for c in model.calls][3:] == [3]
        await b.drain()

    asyncio.run(main())
