"""Each request's own timing: where a batch's round trip goes (the batcher's split, on virtual
time, exact), how a version's statistics add it up, and the names clients read it under."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

import pytest
import virtual_time
from batcher_fakes import RecordingObserver, Tensors, request
from virtual_time import now

from server.api import request_timing
from server.core.assembly import concat_rows
from server.core.batcher import Batcher, BatchTiming, Ran
from server.core.statistics import RequestTiming, VersionStatistics

HAND_OVER, MODEL, BACK = 0.010, 0.050, 0.020


async def worker_like(key: Hashable, parts: list[Tensors], rows: int) -> Ran:
    """A batch handed over in 10 ms, run for 50 ms, its outputs back 20 ms later."""
    await asyncio.sleep(HAND_OVER + MODEL + BACK)
    return Ran({"y": concat_rows(parts)["x"] * 2}, MODEL, HAND_OVER)


def test_a_batch_round_trip_splits_into_hand_over_model_and_return_and_the_rest_is_queue() -> None:
    observer = RecordingObserver()

    async def main() -> None:
        b = Batcher(worker_like, max_batch_rows=4, timeout_s=0.1, max_queued_rows=100, clock=now,
                    observer=observer)
        b.start()
        first = asyncio.create_task(b.submit("k", request(0, 1), 1))
        await asyncio.sleep(0.03)
        # 6 rows: 3 fill the first batch, which goes at once (t = 30 ms); the other 3 go T after the
        # request came (t = 130 ms, the first batch back at 110 ms).
        second = asyncio.create_task(b.submit("k", request(1, 6), 6))
        one, split = await asyncio.gather(first, second)
        assert one.queue_seconds == pytest.approx(0.03)
        assert (one.input_seconds, one.compute_seconds, one.output_seconds) == pytest.approx((HAND_OVER, MODEL, BACK))
        # Two batches carried it: twice each part; it waited 20 ms between them.
        assert split.compute_seconds == pytest.approx(2 * MODEL)
        assert (split.input_seconds, split.output_seconds) == pytest.approx((2 * HAND_OVER, 2 * BACK))
        assert split.queue_seconds == pytest.approx(0.02)
        await b.drain()

    virtual_time.run(main())
    assert observer.timings == [BatchTiming(pytest.approx(HAND_OVER), pytest.approx(MODEL),  # type: ignore[arg-type]
                                            pytest.approx(BACK))] * 2
    assert observer.request_queue_seconds == pytest.approx([0.03, 0.02])


def test_statistics_add_up_batches_and_requests_exactly() -> None:
    stats = VersionStatistics()
    stats.batch_ran(3, 4, 0.001, 0.010, 0.002)
    stats.batch_ran(1, 1, 0.001, 0.005, 0.001)
    stats.batch_ran(2, 4, 0.002, 0.020, 0.003)
    stats.request_queued(0.004)
    stats.request_succeeded(0.030, RequestTiming(0.004, 0.002, 0.010, 0.003, 0.030))
    stats.request_succeeded(0.001, None)
    stats.request_failed(0.0005)
    assert (stats.inference_count, stats.execution_count) == (6, 3)
    assert sorted(stats.batches) == [1, 4]
    four = stats.batches[4]
    assert (four.compute_infer.count, four.compute_infer.ns) == (2, 30_000_000)
    assert (four.compute_input.ns, four.compute_output.ns) == (3_000_000, 5_000_000)
    assert (stats.success.count, stats.success.ns) == (2, 31_000_000)
    assert (stats.fail.count, stats.fail.ns) == (1, 500_000)
    assert (stats.queue.count, stats.queue.ns) == (1, 4_000_000)
    assert (stats.compute_input.count, stats.compute_input.ns) == (1, 2_000_000)
    assert (stats.compute_infer.ns, stats.compute_output.ns) == (10_000_000, 3_000_000)
    assert stats.last_inference_ms > 0


def test_the_names_clients_read_timing_under() -> None:
    timing = RequestTiming(queue_seconds=0.00012, input_seconds=0.0001, infer_seconds=0.00051,
                           output_seconds=0.0001, total_seconds=0.00102)
    assert request_timing.trailers(timing) == (
        ("mirrorserve-queue-seconds", "0.000120"),
        ("mirrorserve-compute-seconds", "0.000510"),
        ("mirrorserve-server-seconds", "0.001020"),
    )
    assert request_timing.server_timing(timing) == "queue;dur=0.120, compute;dur=0.510, total;dur=1.020"
    assert request_timing.SERVER_TIMING == "Server-Timing"
    assert (request_timing.QUEUE_PARAMETER, request_timing.COMPUTE_PARAMETER) == ("queue_ns", "compute_ns")
