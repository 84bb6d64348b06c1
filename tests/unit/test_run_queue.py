"""The worker's run queue: several front-ends' batches of a servable, merged while it is busy."""

from __future__ import annotations

from collections import deque

from server.worker.run_queue import Part, Rules, RunQueue, cut, shares, take


def part(origin: str, rows: int, signature: str = "serving_default", servable_id: int = 1) -> Part[str]:
    return Part(origin, servable_id, signature, rows)


def origins(run: list[Part[str]] | None) -> list[str]:
    return [] if run is None else [p.origin for p in run]


def test_a_servable_runs_its_max_inflight_batches_and_the_rest_wait_to_be_merged() -> None:
    queue: RunQueue[str] = RunQueue()
    queue.add(1, Rules(max_inflight=1, max_rows=64))
    assert origins(queue.submit(part("a", 8))) == ["a"]
    assert queue.submit(part("b", 8)) is None
    assert queue.submit(part("c", 16)) is None
    assert queue.submit(part("d", 4)) is None
    assert origins(queue.finished(1)) == ["b", "c", "d"]  # 28 rows, one run
    assert queue.finished(1) is None
    assert origins(queue.submit(part("e", 1))) == ["e"]  # idle again: it runs at once


def test_merging_stops_at_the_row_budget_and_keeps_the_order_of_what_is_left() -> None:
    waiting = deque([part("a", 40), part("b", 30), part("c", 20), part("d", 5)])
    assert origins(take(waiting, Rules(1, 64))) == ["a", "c"]  # 40 + 20; b (70) and d (65) do not fit
    assert [p.origin for p in waiting] == ["b", "d"]


def test_only_one_signature_merges_and_an_unbatched_one_never_does() -> None:
    rules = Rules(1, 64, unbatched=frozenset({"detect"}))
    waiting = deque([part("a", 4, "other"), part("b", 4), part("c", 4, "other"), part("d", 1, "detect"),
                     part("e", 1, "detect")])
    assert origins(take(waiting, rules)) == ["a", "c"]
    assert origins(take(waiting, rules)) == ["b"]
    assert origins(take(waiting, rules)) == ["d"]
    assert origins(take(waiting, rules)) == ["e"]
    assert not waiting


def test_with_allowed_sizes_a_merged_run_has_one_of_them() -> None:
    rules = Rules(1, 32, allowed_sizes=(4, 8, 16, 32))
    waiting = deque([part("a", 8), part("b", 4), part("c", 8), part("d", 16)])
    assert origins(take(waiting, rules)) == ["a", "c", "d"]  # 8 + 8 = 16, + 16 = 32; 8 + 4 = 12 is not allowed
    assert origins(take(waiting, rules)) == ["b"]


def test_two_in_flight_then_merge() -> None:
    queue: RunQueue[str] = RunQueue()
    queue.add(1, Rules(max_inflight=2, max_rows=64))
    assert origins(queue.submit(part("a", 8))) == ["a"]
    assert origins(queue.submit(part("b", 8))) == ["b"]
    assert queue.submit(part("c", 8)) is None
    assert queue.submit(part("d", 8)) is None
    assert origins(queue.finished(1)) == ["c", "d"]
    assert queue.finished(1) is None
    assert queue.finished(1) is None
    assert origins(queue.submit(part("e", 8))) == ["e"]


def test_a_removed_servable_gives_back_its_waiting_batches_and_an_unknown_one_runs_to_be_failed() -> None:
    queue: RunQueue[str] = RunQueue()
    queue.add(1, Rules(1, 64))
    queue.submit(part("a", 1))
    queue.submit(part("b", 1))
    assert [p.origin for p in queue.remove(1)] == ["b"]
    assert queue.finished(1) is None
    assert origins(queue.submit(part("c", 1, servable_id=9))) == ["c"]


def test_each_part_gets_its_rows_and_its_share_of_each_replica() -> None:
    assert cut([3, 5, 1]) == [(0, 3), (3, 8), (8, 9)]
    replica_rows = (5, 4)  # 9 rows on 2 replicas: 0-4 and 5-8
    assert [shares(replica_rows, a, b) for a, b in cut([3, 5, 1])] == [(3, 0), (2, 3), (0, 1)]
    assert [sum(column) for column in zip(*(shares(replica_rows, a, b) for a, b in cut([3, 5, 1])),
                                          strict=True)] == list(replica_rows)
