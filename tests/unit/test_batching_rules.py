"""The three sentences of server.core.batching_policy, one test (or a few) per clause, each on the
real Batcher with a fake model whose batches the test opens and closes, on virtual time
(virtual_time): a batch takes exactly the seconds its fake model says, no test sleeps for real,
and no timing window can flake:

1. A batch goes once it holds max_batch_size rows; otherwise, with a timeout T, once its oldest
   row waited T, and with T = 0 as soon as a batch slot is free.
2. With `auto`, a batch that finds the model free goes at once unless at least one more row is
   expected within a batch's fixed cost (the part of its time that does not grow with its rows)
   times 1 / (1 - the event loop's busy share); then it waits at most that long, and goes once as
   many rows are queued as were present at once during the previous batch. Beside a running
   batch it waits for that one to end, at most one average batch time after its oldest row.
3. At most max_inflight batches execute at once, at most max_queued_rows rows wait (beyond:
   Overloaded), and with allowed_batch_sizes a batch is padded to the next allowed size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Any

import pytest
import virtual_time
from batcher_fakes import Call, Tensors, assert_answer, double, refused, request, until
from virtual_time import now

from server.core.assembly import concat_rows
from server.core.batcher import Batcher, Ran
from server.core.batching_policy import BatchCost

pytestmark = pytest.mark.timeout(30)


class LoopModel:
    """The batcher's RunBatch as a fake model on the event loop: records every batch at the
    loop's time, waits on `gate` (open unless a test closes it), then takes `cost(rows)` seconds
    and answers with `respond` (y = 2x unless a test swaps it)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.respond: Callable[[Hashable, Tensors], Tensors] = double
        self.cost: Callable[[int], float] = lambda rows: 0.0

    async def __call__(self, key: Hashable, parts: list[Tensors], rows: int) -> Ran:
        batch = concat_rows(parts)
        started = now()
        self.calls.append(Call(key, batch["x"].copy(), started))
        await self.gate.wait()
        await asyncio.sleep(self.cost(int(batch["x"].shape[0])))
        return Ran(self.respond(key, batch), now() - started)

    def batches(self) -> list[list[int]]:
        return [[int(v) for v in c.x[:, 0]] for c in self.calls]


@pytest.fixture
def model() -> LoopModel:
    return LoopModel()


def idle_loop() -> float:
    """The event loop's CPU clock of an idle loop: the auto wait is not stretched."""
    return 0.0


def start(model: LoopModel, **limits: Any) -> Batcher:
    settings: dict[str, Any] = {"max_batch_rows": 64, "timeout_s": None, "max_queued_rows": 1000,
                                "loop_cpu_clock": idle_loop, "clock": now}
    settings.update(limits)
    b = Batcher(model, **settings)
    b.start()
    return b


async def went_after(b: Batcher, model: LoopModel, first: int, rows: int = 1) -> float:
    """Submit one request; seconds from its arrival until the model saw it."""
    t0 = now()
    await b.submit("k", request(first, rows), rows)
    call = next(c for c in model.calls if int(c.x[0, 0]) == first)
    return call.at - t0


async def running(b: Batcher, model: LoopModel, first: int) -> asyncio.Task[Any]:
    """A 1-row batch that has reached the model and is held there until the gate opens."""
    model.gate.clear()
    task = asyncio.create_task(b.submit("k", request(first, 1), 1))
    await until(lambda: bool(model.calls) and int(model.calls[-1].x[0, 0]) == first)
    return task


def timed_model(model: LoopModel, seconds: float) -> None:
    """Every batch takes `seconds` on the model, so the average batch time is known."""
    model.cost = lambda rows: seconds


# Sentence 1 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout_s", [None, 0.0, 5.0], ids=["auto", "0", "5 s"])
def test_a_full_batch_goes_at_once_whatever_the_timeout(
    model: LoopModel, timeout_s: float | None
) -> None:
    async def main() -> None:
        b = start(model, max_batch_rows=8, timeout_s=timeout_s)
        assert await went_after(b, model, 0, rows=8) < 0.1
        await b.drain()

    virtual_time.run(main())


def test_with_a_timeout_a_batch_goes_once_its_oldest_row_waited_that_long(
    model: LoopModel
) -> None:
    async def main() -> None:
        b = start(model, timeout_s=0.2)
        t0 = now()
        first = asyncio.create_task(b.submit("k", request(0, 1), 1))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(b.submit("k", request(1, 2), 2))
        await asyncio.gather(first, second)
        assert model.batches() == [[0, 1, 2]], "one batch with every row that came within T"
        assert 0.2 <= model.calls[0].at - t0 < 0.3, "T after the oldest row, not after the newest"
        await b.drain()

    virtual_time.run(main())


def test_the_wait_is_measured_on_the_batchers_clock_not_the_loops(
    model: LoopModel
) -> None:
    """The loop's timers may fire early on the batcher's clock (uvloop keeps the loop's time to
    the millisecond, cached for a whole iteration); the batch still waits its full T. Here the
    batcher's clock runs at half the loop's speed, so each timer fires halfway."""
    def half_speed() -> float:
        return now() / 2

    async def main() -> None:
        b = start(model, timeout_s=0.1, clock=half_speed)
        t0 = now()
        await b.submit("k", request(0, 1), 1)
        assert model.calls[0].at - t0 >= 0.2, "0.1 s on the batcher's clock is 0.2 s on the loop's"
        await b.drain()

    virtual_time.run(main())


def test_with_timeout_zero_a_batch_goes_as_soon_as_a_slot_is_free(
    model: LoopModel
) -> None:
    async def main() -> None:
        b = start(model, timeout_s=0.0, max_inflight=1)
        assert await went_after(b, model, 0) < 0.05, "free slot: at once"
        held = await running(b, model, 10)
        waiting = [asyncio.create_task(b.submit("k", request(20 + i, 1), 1)) for i in range(3)]
        await asyncio.sleep(0.1)
        assert int(model.calls[-1].x[0, 0]) == 10, "no slot, so no batch"
        opened = now()
        model.gate.set()
        await asyncio.gather(held, *waiting)
        assert model.batches()[-1] == [20, 21, 22]
        assert model.calls[-1].at - opened < 0.05
        await b.drain()

    virtual_time.run(main())


# Sentence 2 ---------------------------------------------------------------------------------


def test_auto_never_waits_for_a_lone_caller(model: LoopModel) -> None:
    """One caller at a time, even after batches that took 0.3 s: it is the only row present."""
    timed_model(model, 0.3)

    async def main() -> None:
        b = start(model)
        await b.submit("k", request(0, 1), 1)
        model.cost = lambda rows: 0.0
        waits = [await went_after(b, model, 10 * (i + 1)) for i in range(5)]
        assert max(waits) < 0.05, waits
        await b.drain()

    virtual_time.run(main())


async def feed(b: Batcher, gap_s: float, count: int) -> None:
    """An open loop: `count` 1-row requests, one every gap_s, none waiting for an answer."""
    tasks = []
    for i in range(count):
        tasks.append(asyncio.create_task(b.submit("k", request(1000 + i, 1), 1)))
        await asyncio.sleep(gap_s)
    await asyncio.gather(*tasks)


def idle_gaps(model: LoopModel, batch_s: float) -> list[float]:
    """Seconds the model stood free before each batch (from the previous batch's end)."""
    return [later.at - (earlier.at + batch_s) for earlier, later in zip(model.calls, model.calls[1:], strict=False)]


def test_auto_goes_at_once_while_under_one_row_comes_per_batch_time(
    model: LoopModel
) -> None:
    """Rows 60 ms apart, batches of 10 ms: fewer than one row is expected while a batch runs, so
    a batch that finds the model free goes at once."""
    timed_model(model, 0.01)

    async def main() -> None:
        b = start(model)
        await feed(b, 0.06, 8)
        assert all(c.rows == 1 for c in model.calls)
        late = [round((c.at - model.calls[0].at) % 0.06, 3) for c in model.calls[2:]]
        assert all(x < 0.02 or x > 0.05 for x in late), late  # each went on arrival, not after a wait
        await b.drain()

    virtual_time.run(main())


def test_auto_waits_at_most_a_batch_time_while_rows_keep_coming(
    model: LoopModel
) -> None:
    """Rows 5 ms apart, batches of 60 ms: about twelve rows come per batch time, so a batch that
    finds the model free waits for more, and never longer than one batch time."""
    timed_model(model, 0.06)

    async def main() -> None:
        b = start(model)
        await feed(b, 0.005, 120)
        gaps = idle_gaps(model, 0.06)[3:]
        assert max(gaps) < 0.06 + 0.04, gaps
        assert max(gaps) > 0.02, f"never waited for rows: {gaps}"
        await b.drain()

    virtual_time.run(main())


@pytest.mark.parametrize(("fixed_s", "waits"), [(0.0, False), (0.03, True)], ids=["per row", "fixed"])
def test_auto_waits_only_when_a_batch_has_a_fixed_cost(
    model: LoopModel, fixed_s: float, waits: bool
) -> None:
    """Batches of 1 and 4 rows teach the batcher the model's cost: 10 ms a row, plus `fixed_s` a
    batch. Then rows come 2 ms apart, far faster than one per batch time. With no fixed cost,
    merging rows saves nothing and the first of them goes at once; with one, it waits for more."""

    model.cost = lambda rows: fixed_s + 0.01 * rows

    async def main() -> None:
        b = start(model)
        head = asyncio.create_task(b.submit("k", request(0, 1), 1))
        await until(lambda: bool(model.calls))
        await asyncio.gather(head, *(b.submit("k", request(i, 1), 1) for i in range(1, 5)))
        assert [c.rows for c in model.calls] == [1, 4]
        trickle = []
        t0 = now()
        for i in range(6):
            trickle.append(asyncio.create_task(b.submit("k", request(100 + i, 1), 1)))
            await asyncio.sleep(0.002)
        await asyncio.gather(*trickle)
        first = next(c for c in model.calls if int(c.x[0, 0]) == 100)
        if waits:
            assert first.at - t0 > 0.008 and first.rows > 1, (first.at - t0, first.rows)
        else:
            assert first.at - t0 < 0.008 and first.rows == 1, (first.at - t0, first.rows)
        await b.drain()

    virtual_time.run(main())


@pytest.mark.parametrize(("busy", "low", "high"), [(0.0, 0.02, 0.07), (0.75, 0.10, 0.20)],
                         ids=["idle loop", "loop 75% busy"])
def test_auto_stretches_its_wait_by_how_busy_the_event_loop_is(
    model: LoopModel, busy: float, low: float, high: float
) -> None:
    """Batches of 1 and 4 rows teach the batcher a fixed cost of 30 ms a batch. Then two rows come
    2 ms apart and no more: their batch waits for more rows as long as the bound allows, which is
    the fixed cost on an idle event loop and 1 / (1 - 0.75) = 4 times it on a loop busy 75% of
    the time (the loop's CPU clock here runs at that share of the wall clock)."""

    model.cost = lambda rows: 0.03 + 0.01 * rows

    async def main() -> None:
        b = start(model, loop_cpu_clock=lambda: busy * now())
        head = asyncio.create_task(b.submit("k", request(0, 1), 1))
        await until(lambda: bool(model.calls))
        await asyncio.gather(head, *(b.submit("k", request(i, 1), 1) for i in range(1, 5)))
        assert [c.rows for c in model.calls] == [1, 4]
        t0 = now()
        pair = [asyncio.create_task(b.submit("k", request(100, 1), 1))]
        await asyncio.sleep(0.002)
        pair.append(asyncio.create_task(b.submit("k", request(101, 1), 1)))
        await asyncio.gather(*pair)
        batch = model.calls[-1]
        assert batch.rows == 2 and low < batch.at - t0 < high, (batch.rows, batch.at - t0)
        await b.drain()

    virtual_time.run(main())


def test_auto_wait_ends_once_every_row_lately_present_is_queued(
    model: LoopModel
) -> None:
    """Four callers in a closed loop (each sends again when answered), batches of 50 ms: rows come
    faster than one per batch time, but once all four are queued none can come before this batch
    answers some, so it goes then instead of waiting out the batch time."""
    timed_model(model, 0.05)

    async def caller(b: Batcher, who: int) -> None:
        for i in range(8):
            await b.submit("k", request(100 * who + i, 1), 1)

    async def main() -> None:
        b = start(model)
        await asyncio.gather(*(caller(b, who) for who in range(4)))
        steady = model.calls[2:]
        assert [c.rows for c in steady] == [4] * len(steady), [c.rows for c in model.calls]
        gaps = idle_gaps(model, 0.05)[2:]
        assert max(gaps) < 0.025, gaps
        await b.drain()

    virtual_time.run(main())


def test_auto_waits_for_the_running_batch_and_takes_every_row_that_came(
    model: LoopModel
) -> None:
    """A free slot, but a batch is running: the next one waits for it to end (within its 1 s
    average batch time), then goes at once with all three requests that came meanwhile."""
    timed_model(model, 1.0)

    async def main() -> None:
        b = start(model, max_inflight=2)
        await b.submit("k", request(0, 1), 1)  # the average batch time is now 1 s
        model.cost = lambda rows: 0.0
        held = await running(b, model, 10)
        waiting = []
        for i in range(3):
            waiting.append(asyncio.create_task(b.submit("k", request(20 + i, 1), 1)))
            await asyncio.sleep(0.05)
        assert int(model.calls[-1].x[0, 0]) == 10, "started beside the running batch"
        opened = now()
        model.gate.set()
        await asyncio.gather(held, *waiting)
        assert model.batches()[-1] == [20, 21, 22]
        assert model.calls[-1].at - opened < 0.05, "went when the running batch ended"
        await b.drain()

    virtual_time.run(main())


def test_auto_waits_no_longer_than_one_average_batch_time(
    model: LoopModel
) -> None:
    """Batches have taken 0.2 s; one is held far longer. The next batch starts beside it 0.2 s
    after its oldest row arrived, with the rows that came within those 0.2 s."""
    timed_model(model, 0.2)

    async def main() -> None:
        b = start(model, max_inflight=2)
        await b.submit("k", request(0, 1), 1)
        model.cost = lambda rows: 0.0
        held = await running(b, model, 10)
        t0 = now()
        first = asyncio.create_task(b.submit("k", request(20, 1), 1))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(b.submit("k", request(21, 1), 1))
        await until(lambda: int(model.calls[-1].x[0, 0]) == 20)
        assert 0.19 <= model.calls[-1].at - t0 < 0.35
        assert model.batches()[-1] == [20, 21]
        model.gate.set()
        await asyncio.gather(held, first, second)
        await b.drain()

    virtual_time.run(main())


def test_auto_average_follows_the_recent_batches(model: LoopModel) -> None:
    """After many fast batches, one slow batch barely moves the average: the wait beside a held
    batch stays short (about the fast batches' time, not the slow one's 0.5 s)."""

    async def main() -> None:
        b = start(model, max_inflight=2)
        timed_model(model, 0.02)
        for i in range(10):
            await b.submit("k", request(i, 1), 1)
        timed_model(model, 0.5)
        await b.submit("k", request(100, 1), 1)
        model.cost = lambda rows: 0.0
        held = await running(b, model, 200)
        t0 = now()
        beside = asyncio.create_task(b.submit("k", request(300, 1), 1))
        await until(lambda: int(model.calls[-1].x[0, 0]) == 300)
        waited = model.calls[-1].at - t0
        assert 0.02 <= waited < 0.2, f"waited {waited:.3f} s: one slow batch set the wait"
        model.gate.set()
        await asyncio.gather(held, beside)
        await b.drain()

    virtual_time.run(main())


def test_auto_with_one_slot_goes_when_the_running_batch_ends(model: LoopModel) -> None:
    """One batch in flight: the request queued behind it is every row present, so it goes as soon
    as the running batch ends."""
    timed_model(model, 0.3)

    async def main() -> None:
        b = start(model, max_inflight=1)
        await b.submit("k", request(0, 1), 1)
        model.cost = lambda rows: 0.0
        held = await running(b, model, 10)
        waiting = asyncio.create_task(b.submit("k", request(20, 1), 1))
        await asyncio.sleep(0.05)
        opened = now()
        model.gate.set()
        await asyncio.gather(held, waiting)
        assert model.calls[-1].at - opened < 0.05
        await b.drain()

    virtual_time.run(main())


# Sentence 3 ---------------------------------------------------------------------------------


def test_at_most_max_inflight_batches_execute(model: LoopModel) -> None:
    async def main() -> None:
        b = start(model, timeout_s=0.0, max_inflight=2, max_batch_rows=1)
        model.gate.clear()
        tasks = [asyncio.create_task(b.submit("k", request(i, 1), 1)) for i in range(5)]
        await until(lambda: len(model.calls) == 2)
        await asyncio.sleep(0.1)
        assert len(model.calls) == 2
        model.gate.set()
        await asyncio.gather(*tasks)
        assert sorted([r for batch in model.batches() for r in batch]) == [0, 1, 2, 3, 4]
        await b.drain()

    virtual_time.run(main())


def test_beyond_max_queued_rows_a_request_is_refused(model: LoopModel) -> None:
    async def main() -> None:
        b = start(model, timeout_s=0.0, max_inflight=1, max_queued_rows=4)
        held = await running(b, model, 0)
        queued = asyncio.create_task(b.submit("k", request(10, 3), 3))
        await asyncio.sleep(0.01)
        await refused(b.submit("k", request(20, 2), 2), "queue full: 3 rows waiting for the model, bound 4")
        model.gate.set()
        await asyncio.gather(held, queued)
        await b.drain()

    virtual_time.run(main())


@pytest.mark.parametrize(("rows", "padded"), [(1, 2), (2, 2), (3, 4), (5, 8), (8, 8)])
def test_a_batch_is_padded_to_the_next_allowed_size(
    model: LoopModel, rows: int, padded: int
) -> None:
    """The model sees the allowed size, the padding a copy of the batch's first row; each request
    gets only its own rows back."""

    async def main() -> None:
        b = start(model, timeout_s=0.0, max_inflight=1, max_batch_rows=8, allowed_batch_sizes=(2, 4, 8))
        held = await running(b, model, 100)
        parts = [request(10 * i, 1, width=3) for i in range(rows)]
        tasks = [asyncio.create_task(b.submit("k", p, 1)) for p in parts]
        await asyncio.sleep(0.01)
        model.gate.set()
        answers = await asyncio.gather(held, *tasks)
        for part, answer in zip(parts, answers[1:], strict=True):
            assert_answer(part, answer.outputs)
        last: Call = model.calls[-1]
        assert last.rows == padded
        assert [int(v) for v in last.x[:, 0]] == [10 * i for i in range(rows)] + [0] * (padded - rows)
        await b.drain()

    virtual_time.run(main())


def test_a_request_larger_than_the_largest_size_is_split_then_padded(
    model: LoopModel
) -> None:
    async def main() -> None:
        b = start(model, timeout_s=0.0, max_batch_rows=4, allowed_batch_sizes=(2, 4))
        answer = await b.submit("k", request(0, 7), 7)
        assert_answer(request(0, 7), answer.outputs)
        assert [c.rows for c in model.calls] == [4, 4], "4 rows, then 3 padded to 4"
        assert model.batches()[1] == [4, 5, 6, 4]
        await b.drain()

    virtual_time.run(main())


# The batch cost the auto wait reads ------------------------------------------------------------


def test_batch_cost_fits_fixed_and_per_row_parts() -> None:
    cost = BatchCost()
    for rows in (1, 4, 2, 8, 3, 6, 1, 5):
        cost.add(rows, 0.001 + 0.0005 * rows)
    assert cost.fixed_seconds == pytest.approx(0.001, rel=1e-6)
    assert 0.001 < cost.seconds < 0.001 + 0.0005 * 8


def test_batch_cost_is_all_fixed_while_batches_do_not_vary() -> None:
    cost = BatchCost()
    assert (cost.seconds, cost.fixed_seconds) == (0.0, 0.0)
    cost.add(1, 0.004)
    assert (cost.seconds, cost.fixed_seconds) == (0.004, 0.004)
    cost.add(1, 0.002)
    assert cost.seconds == pytest.approx(0.0036)
    assert cost.fixed_seconds == cost.seconds


def test_batch_cost_of_a_per_row_model_is_not_fixed() -> None:
    cost = BatchCost()
    for rows in (1, 3, 2, 5, 4):
        cost.add(rows, 0.02 * rows)
    assert cost.fixed_seconds == pytest.approx(0.0, abs=1e-9)
