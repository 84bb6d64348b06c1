"""Watching the event loop for stalls. gRPC, REST, batching and the worker's answers all run on
one loop, so anything that holds it (a huge body decoded inline, a long garbage collection) delays
every client at once; this makes such a stall visible.

A task asks to wake every INTERVAL_S and measures how late it woke: that lateness is the time
the loop could not run anything, observed into mirrorserve_event_loop_lag_seconds. A lag over
WARN_S is logged as a WARNING, at most once every WARN_EVERY_S (with the worst lag meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from server import metrics

log = logging.getLogger("server.frontends.loop_lag")

INTERVAL_S = 0.1
WARN_S = 1.0
WARN_EVERY_S = 10.0


class LagWatch:
    """The bookkeeping, apart from the sleeping, so it can be tested with a fake clock."""

    def __init__(self, observe: Callable[[float], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._observe = observe
        self._clock = clock
        self._warned_at: float | None = None
        self._worst_unwarned = 0.0

    def woke(self, lag: float) -> bool:
        """Record one wake-up `lag` seconds late; True when it was logged as a warning."""
        self._observe(lag)
        if lag <= WARN_S:
            return False
        now = self._clock()
        if self._warned_at is not None and now - self._warned_at < WARN_EVERY_S:
            self._worst_unwarned = max(self._worst_unwarned, lag)
            return False
        worse = f" (and up to {self._worst_unwarned:.1f}s since the last warning)" if self._worst_unwarned else ""
        log.warning("the event loop was blocked for %.1fs: every request on every protocol waited that long%s",
                    lag, worse, extra={"lag_seconds": round(lag, 3)})
        self._warned_at = now
        self._worst_unwarned = 0.0
        return True


async def watch(interval_s: float = INTERVAL_S) -> None:
    """Run until cancelled."""
    lags = LagWatch(metrics.EVENT_LOOP_LAG.observe)
    while True:
        before = time.monotonic()
        await asyncio.sleep(interval_s)
        lags.woke(max(time.monotonic() - before - interval_s, 0.0))
