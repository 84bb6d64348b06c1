"""How busy the front-ends are: their CPU seconds, for the autoscaler's busy share.

A front-end is one Python process, and its GIL saturates it at about one core: past that, calls
wait in grpc and the event loop, not in a batch queue, and a model of 1 ms batches sits idle most
of the time (measured on 2 cores at 64 callers: batches in flight 15% of the time while the
front-end used 0.95 cores). So the model's busy share alone misses a pod that is saturated in
front of its model. Each front-end adds its CPU seconds over the number of front-ends to
mirrorserve_frontend_busy_seconds_total: its rate is the average front-end's share of its one
core, 0 idle to about 1 saturated; the autoscaler takes the larger of this and the model's.
"""

from __future__ import annotations

import asyncio
import time

from server import metrics

INTERVAL_S = 0.25


async def count(frontends: int, interval_s: float = INTERVAL_S) -> None:
    """Run until cancelled."""
    last = time.process_time()
    while True:
        await asyncio.sleep(interval_s)
        now = time.process_time()
        metrics.FRONTEND_BUSY_SECONDS.inc((now - last) / frontends)
        last = now
