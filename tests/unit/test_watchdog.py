"""The worker watchdog's time limit (server.core.watchdog) and its use by a WorkerLink."""

from __future__ import annotations

import asyncio

import pytest

from server.core.model_process import WorkerLink
from server.core.watchdog import BatchTimes, HangRule
from server.errors import Unavailable


def times(*seconds: float) -> BatchTimes:
    recent = BatchTimes()
    for s in seconds:
        recent.add(s)
    return recent


def test_first_batches_of_a_version_get_three_times_the_floor() -> None:
    rule = HangRule(floor_s=30)
    assert rule.limit_s(BatchTimes()) == 90
    assert rule.limit_s(times(*[0.001] * 19)) == 90


def test_after_settling_the_limit_is_twenty_p99s_never_under_the_floor() -> None:
    rule = HangRule(floor_s=30)
    assert rule.limit_s(times(*[0.001] * 20)) == 30  # a 1 ms model: the floor
    assert rule.limit_s(times(*[0.05] * 100)) == 30  # 50 ms batches: 1 s, still the floor
    assert rule.limit_s(times(*[2.0] * 100)) == 40  # 2 s batches: 20 x 2 s
    slow_tail = [0.01] * 198 + [3.0, 3.0]  # 2 of 200 at 3 s: the p99 is 3 s
    assert rule.limit_s(times(*slow_tail)) == 60


def test_default_settings_notice_a_hang_within_two_minutes_for_models_under_six_seconds_a_batch() -> None:
    rule = HangRule()
    for batch_s in (0.001, 0.05, 1.0, 5.9):
        assert rule.limit_s(BatchTimes()) + 1 <= 120  # plus one watch tick
        assert rule.limit_s(times(*[batch_s] * 50)) + 1 <= 120


def test_times_keep_the_newest_window() -> None:
    recent = times(*range(300))
    assert recent.count == 300 and len(recent.seconds) == 200 and recent.seconds[0] == 100
    assert BatchTimes().p99() == 0


def test_zero_floor_turns_it_off() -> None:
    assert not HangRule(floor_s=0).enabled


class _Channel:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)


def test_a_link_fails_the_hung_versions_batches_refuses_its_next_and_spares_the_others() -> None:
    hung: list[tuple[int, str]] = []

    async def scenario() -> None:
        link = WorkerLink(on_hung=lambda servable_id, why: hung.append((servable_id, why)),
                          hang_rule=HangRule(floor_s=1))
        loop = asyncio.get_running_loop()
        slow: asyncio.Future[object] = loop.create_future()
        other: asyncio.Future[object] = loop.create_future()
        link._pending = {0: (slow, 0, 7, 100.0), 1: (other, 1, 8, 102.0)}  # type: ignore[dict-item]
        link.check_hung(102.9)  # 2.9 s: under 3 x the floor
        assert not hung and not slow.done()
        link.check_hung(103.5)
        assert hung == [(7, "a batch has run 4s, past its limit of 3s")]
        assert isinstance(slow.exception(), Unavailable) and not other.done()
        assert list(link._pending) == [1]
        link._channel = _Channel()  # type: ignore[assignment]
        with pytest.raises(Unavailable, match="hung"):
            await link.run(7, "serving_default", [])
        link.check_hung(103.6)
        assert len(hung) == 1  # told once

    asyncio.run(scenario())
