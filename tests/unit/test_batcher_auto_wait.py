"""The batcher's auto wait (timeout 0): at once while requests come one at a time; a bounded wait
once batches show that they come together (while they stay small, only as long as another batch
executes); back to at once when they stop."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from batcher_fakes import FakeModel, on_thread, request, until

from server.core import batcher as batcher_module
from server.core.batcher import Batcher

pytestmark = pytest.mark.timeout(30)


def start(model: FakeModel, executor: ThreadPoolExecutor, **limits: Any) -> Batcher:
    settings: dict[str, Any] = {"max_batch_rows": 64, "timeout_s": 0.0, "max_queued_rows": 1000,
                                "max_auto_wait_s": 0.15}
    settings.update(limits)
    b = Batcher(on_thread(model, executor), **settings)
    b.start()
    return b


async def lone(b: Batcher, model: FakeModel, first: int) -> float:
    """Submit one 1-row request with nothing else queued; seconds until the model saw it."""
    t0 = time.monotonic()
    await b.submit("k", request(first, 1), 1)
    return model.calls[-1].at - t0


async def crowd(b: Batcher, model: FakeModel, first: int, rows: int = 40) -> None:
    """One request runs while `rows` more queue behind it: the next batch carries `rows` rows."""
    model.gate.clear()
    head = asyncio.create_task(b.submit("k", request(first, 1), 1))
    await until(lambda: model.calls and int(model.calls[-1].x[0, 0]) == first)
    rest = [asyncio.create_task(b.submit("k", request(first + 1 + i, 1), 1)) for i in range(rows)]
    await asyncio.sleep(0.01)
    model.gate.set()
    await asyncio.gather(head, *rest)


def test_lone_requests_never_wait(model: FakeModel, executor: ThreadPoolExecutor,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batcher_module, "AUTO_WAIT_MIN_S", 0.1)

    async def main() -> None:
        b = start(model, executor)
        waits = [await lone(b, model, i * 10) for i in range(5)]
        assert max(waits) < 0.05, waits
        await b.drain()

    asyncio.run(main())


@pytest.mark.parametrize(("floor_s", "cap_s"), [(0.1, 0.15), (5.0, 0.1)], ids=["floor", "cap"])
def test_after_crowded_batches_a_batch_waits_within_the_bounds(
    model: FakeModel, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch, floor_s: float, cap_s: float
) -> None:
    """The fake model is instant, so the wait is the floor (AUTO_WAIT_MIN_S) unless the cap is lower."""
    monkeypatch.setattr(batcher_module, "AUTO_WAIT_MIN_S", floor_s)

    async def main() -> None:
        b = start(model, executor, max_auto_wait_s=cap_s)
        await crowd(b, model, 100)  # batches of 1 then 40 rows: average 8.8, not small
        waited = await lone(b, model, 200)
        assert 0.099 <= waited < 0.5, waited
        await b.drain()

    asyncio.run(main())


def test_a_full_batch_goes_without_the_wait(model: FakeModel, executor: ThreadPoolExecutor,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batcher_module, "AUTO_WAIT_MIN_S", 5.0)

    async def main() -> None:
        b = start(model, executor, max_batch_rows=40, max_auto_wait_s=5.0)
        await crowd(b, model, 100)  # batches of 1 then 40 rows: average 8.8, so the wait is on
        t0 = time.monotonic()
        await b.submit("k", request(200, 40), 40)
        assert model.calls[-1].at - t0 < 0.05
        await b.drain()

    asyncio.run(main())


@pytest.mark.parametrize(("max_auto_wait_s", "crowd_rows"), [(0.0, 40), (0.15, 6)],
                         ids=["wait turned off", "small batches, idle model"])
def test_a_lone_request_after_a_crowd_goes_at_once(
    model: FakeModel, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch,
    max_auto_wait_s: float, crowd_rows: int,
) -> None:
    """With --max-auto-wait-ms 0 never any wait; with batches of 1 then 6 rows (average 2.0,
    small) none while nothing executes."""
    monkeypatch.setattr(batcher_module, "AUTO_WAIT_MIN_S", 0.1)

    async def main() -> None:
        b = start(model, executor, max_auto_wait_s=max_auto_wait_s)
        await crowd(b, model, 100, rows=crowd_rows)
        assert await lone(b, model, 200) < 0.05
        await b.drain()

    asyncio.run(main())


def test_back_to_lone_traffic_it_stops_waiting(model: FakeModel, executor: ThreadPoolExecutor,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batcher_module, "AUTO_WAIT_MIN_S", 0.02)

    async def main() -> None:
        b = start(model, executor, max_auto_wait_s=0.02)
        await crowd(b, model, 100)
        waits = [await lone(b, model, 200 + 10 * i) for i in range(8)]
        assert waits[0] >= 0.019, waits  # still averaging over the crowded batch
        assert waits[-1] < 0.015, waits  # the average fell under 6 rows and the model is idle: at once
        await b.drain()

    asyncio.run(main())


def test_small_batches_wait_while_another_batch_runs_and_go_when_it_ends(
    model: FakeModel, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batcher_module, "AUTO_WAIT_MIN_S", 0.2)
    monkeypatch.setattr(batcher_module, "SHORT_BATCH_S", 1.0)  # the gated crowd's batches count as short

    async def main() -> None:
        b = start(model, executor, max_inflight=2)
        await crowd(b, model, 100, rows=6)
        model.gate.clear()
        running = asyncio.create_task(b.submit("k", request(200, 1), 1))
        await until(lambda: int(model.calls[-1].x[0, 0]) == 200)  # went at once; now held
        t0 = time.monotonic()
        waiting = asyncio.create_task(b.submit("k", request(300, 1), 1))
        await asyncio.sleep(0.05)
        assert int(model.calls[-1].x[0, 0]) == 200, "a free slot, but the batch waits for rows"
        model.gate.set()  # the running batch ends: the model is idle, so the waiting one goes now
        await asyncio.gather(running, waiting)
        assert int(model.calls[-1].x[0, 0]) == 300
        assert 0.045 <= model.calls[-1].at - t0 < 0.15, "went when the other ended, not at the 0.2 s floor"
        await b.drain()

    asyncio.run(main())


def test_small_batches_do_not_wait_for_a_batch_that_outlasts_the_wait(
    model: FakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of 0.6 s against a 0.2 s longest wait: after two of them the average batch time
    (0.12, then 0.22 s) passes the wait, so a small batch no longer waits for the running one
    (it could not outwait it) and goes at once into the free slot. Two model threads, so the
    second batch can run beside the first."""
    monkeypatch.setattr(batcher_module, "AUTO_WAIT_MIN_S", 0.2)
    monkeypatch.setattr(batcher_module, "SHORT_BATCH_S", 1.0)  # the longest wait decides, not this

    def slow(key: Any, batch: dict[str, Any]) -> dict[str, Any]:
        time.sleep(0.6)
        return {"y": batch["x"] * 2}

    model.respond = slow

    async def main(executor: ThreadPoolExecutor) -> None:
        b = start(model, executor, max_inflight=2, max_auto_wait_s=0.2)
        await crowd(b, model, 100, rows=6)  # batches of 1 then 6 rows: average 2.0, small
        running = asyncio.create_task(b.submit("k", request(200, 1), 1))
        await until(lambda: int(model.calls[-1].x[0, 0]) == 200)  # the model is idle: at once
        t0 = time.monotonic()
        beside = asyncio.create_task(b.submit("k", request(300, 1), 1))
        await until(lambda: int(model.calls[-1].x[0, 0]) == 300)
        assert model.calls[-1].at - t0 < 0.1, "waited although the running batch outlasts the wait"
        await asyncio.gather(running, beside)
        await b.drain()

    with ThreadPoolExecutor(2, thread_name_prefix="fake-model") as executor:
        asyncio.run(main(executor))


@pytest.mark.parametrize(("rows", "waits"), [(1, True), (64, False)], ids=["one row waits", "a full batch goes"])
def test_with_short_batches_a_batch_waits_for_the_running_one_past_the_wait(
    model: FakeModel, monkeypatch: pytest.MonkeyPatch, rows: int, waits: bool
) -> None:
    """Crowded batches (1 then 40 rows: average 8.8) that end within the longest wait (the fake
    model is instant): a second batch does not start beside a running one, even once its own
    wait (the 0.02 s floor) is over; it goes when the running batch ends, with every row that came
    meanwhile. A full batch has nothing to wait for and takes the free slot at once. Two model
    threads, so a second batch could run beside the first."""
    monkeypatch.setattr(batcher_module, "AUTO_WAIT_MIN_S", 0.02)
    monkeypatch.setattr(batcher_module, "SHORT_BATCH_S", 1.0)  # the gated crowd's batches count as short

    async def main(executor: ThreadPoolExecutor) -> None:
        b = start(model, executor, max_inflight=2)
        await crowd(b, model, 100)
        model.gate.clear()
        running = asyncio.create_task(b.submit("k", request(200, 1), 1))
        await until(lambda: int(model.calls[-1].x[0, 0]) == 200)  # after its 0.02 s; now held
        t0 = time.monotonic()
        second = asyncio.create_task(b.submit("k", request(300, rows), rows))
        if not waits:
            await until(lambda: int(model.calls[-1].x[0, 0]) == 300)
            assert model.calls[-1].at - t0 < 0.05
            model.gate.set()
            await asyncio.gather(running, second)
            return await b.drain()
        await asyncio.sleep(0.2)  # past the floor, and past the 0.15 s cap that bounds its own wait
        assert int(model.calls[-1].x[0, 0]) == 200, "started beside a short running batch"
        third = asyncio.create_task(b.submit("k", request(400, 1), 1))
        await asyncio.sleep(0.01)
        opened = time.monotonic()
        model.gate.set()  # the running batch ends: the waiting one goes at once, with both rows
        await asyncio.gather(running, second, third)
        assert model.batches()[-1] == [300, 400]
        assert model.calls[-1].at - opened < 0.05
        await b.drain()

    with ThreadPoolExecutor(2, thread_name_prefix="fake-model") as executor:
        asyncio.run(main(executor))


def test_a_wait_ends_once_as_many_rows_are_queued_as_were_lately_present(
    model: FakeModel, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The crowd had 41 rows present at once (1 executing, 40 queued). With nothing executing, a
    batch under a 5 s wait keeps waiting with 40 rows queued, and goes as soon as the 41st comes:
    in a closed loop nobody else could."""
    monkeypatch.setattr(batcher_module, "AUTO_WAIT_MIN_S", 5.0)

    async def main() -> None:
        b = start(model, executor, max_auto_wait_s=5.0)
        await crowd(b, model, 100)  # batches of 1 then 40 rows: average 8.8, so the wait is on
        calls = len(model.calls)
        queued = [asyncio.create_task(b.submit("k", request(200 + i, 1), 1)) for i in range(40)]
        await asyncio.sleep(0.3)
        assert len(model.calls) == calls, "went before every row lately present was queued"
        t0 = time.monotonic()
        await asyncio.gather(*queued, b.submit("k", request(240, 1), 1))
        assert model.batches()[-1] == list(range(200, 241))
        assert model.calls[-1].at - t0 < 0.5
        await b.drain()

    asyncio.run(main())
