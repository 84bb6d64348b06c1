"""Statistics over several front-end processes: each records what it answered; a call adds them up."""

from __future__ import annotations

from server.core.statistics import VersionStatistics, combined


def figures(rows: int, size: int, last_ms: int) -> VersionStatistics:
    stats = VersionStatistics()
    stats.batch_ran(rows, size, 0.001, 0.002, 0.003)
    stats.request_queued(0.004)
    stats.request_succeeded(0.010, None)
    stats.last_inference_ms = last_ms
    return stats


def test_counts_and_durations_add_up_and_the_last_inference_is_the_latest() -> None:
    one, two, three = figures(3, 4, 100), figures(5, 8, 300), figures(2, 4, 200)
    total = combined(one, [two, three])
    assert (total.inference_count, total.execution_count, total.last_inference_ms) == (10, 3, 300)
    assert (total.success.count, total.success.ns) == (3, 30_000_000)
    assert (total.queue.count, total.queue.ns) == (3, 12_000_000)
    assert sorted(total.batches) == [4, 8]
    assert total.batches[4].compute_infer.count == 2 and total.batches[8].compute_output.ns == 3_000_000
    assert one.inference_count == 3 and one.batches[4].compute_infer.count == 1  # the parts are not changed


def test_one_front_end_is_its_own_figures() -> None:
    one = figures(3, 4, 100)
    assert combined(one, []) is one
