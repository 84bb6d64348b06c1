"""The busy share's clock (server.metrics.BusyClock), on a fake clock."""

from __future__ import annotations

from server.metrics import BusyClock


def run(clock: BusyClock, batches: list[tuple[float, float]]) -> float:
    """Busy seconds from (start, end) batches in time order, one in flight at a time."""
    busy = 0.0
    for start, end in batches:
        busy += clock.change(+1, start)
        busy += clock.change(-1, end)
    return busy


def test_back_to_back_batches_are_busy_all_the_time_whatever_their_length() -> None:
    for length in (0.001, 0.05):
        batches = [(i * length, (i + 1) * length) for i in range(int(10 / length))]
        assert abs(run(BusyClock(1, 1, 0.0), batches) / 10 - 1.0) < 1e-6


def test_rare_batches_are_busy_a_small_share() -> None:
    batches = [(i * 0.1, i * 0.1 + 0.001) for i in range(100)]  # 1 ms every 100 ms
    assert abs(run(BusyClock(1, 1, 0.0), batches) / 10 - 0.01) < 1e-6


def test_one_of_two_slots_is_half_busy_and_front_ends_average() -> None:
    clock = BusyClock(2, 1, 0.0)
    assert clock.change(+1, 0.0) == 0.0
    assert clock.change(-1, 4.0) == 2.0  # one batch of two slots for 4 s
    clock = BusyClock(1, 2, 0.0)  # one of two front-ends always busy: half the server's share
    assert clock.change(+1, 0.0) + clock.change(-1, 4.0) == 2.0
