"""The entry point of a front-end process other than the primary (--frontends N, N > 1).

Spawned by the primary (server.frontends.fleet), it imports no TensorFlow: it answers gRPC and
REST on the primary's ports (SO_REUSEPORT), batches what reaches it, and sends its batches to the
model worker over a channel of its own. Its registry follows the primary's views
(server.frontends.follower); control calls go to the primary. It ignores SIGINT and SIGTERM: the
primary tells it to drain (Drain), and when the primary is gone it drains at once and exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection

from server import event_loop, logs, memory
from server.api.control import ControlPlane
from server.config import Settings
from server.core.model_process import WorkerLink
from server.core.servables import Registry
from server.core.watchdog import HangRule
from server.core.worker_channel import WorkerChannel
from server.frontends import cpu_share, loop_lag
from server.frontends.follower import Follower, RemoteModels
from server.frontends.front_end import FrontEnd
from server.frontends.view import (
    Applied,
    Drain,
    SourcesApplied,
    StatisticsFound,
    StatisticsWanted,
    View,
    WorkerHung,
    own_statistics,
)

log = logging.getLogger("server.frontends.secondary")

PRIMARY_GONE_GRACE_S = 5.0
"""How long a front-end whose primary died still finishes its accepted calls."""


def run(settings: Settings, index: int, primary: socket.socket, worker: socket.socket, worker_handles: Connection,
        worker_pid: int, ports: tuple[int, int], devices: int, control: ControlPlane,
        metrics_paths: tuple[str, ...]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logs.configure(settings.log_format, settings.log_level)
    code = event_loop.run(_serve(settings, index, primary, worker, worker_handles, worker_pid, ports, devices,
                                 control, metrics_paths), settings.event_loop)
    sys.exit(code)


async def _serve(settings: Settings, index: int, primary_sock: socket.socket, worker_sock: socket.socket,
                 worker_handles: Connection, worker_pid: int, ports: tuple[int, int], devices: int,
                 control: ControlPlane, metrics_paths: tuple[str, ...]) -> int:
    registry = Registry()
    stopping = asyncio.Event()
    drain_delay: list[float] = []
    serving = [False]
    exit_code = [0]

    def stop(delay_s: float, code: int = 0) -> None:
        if not stopping.is_set():
            drain_delay.append(delay_s)
            exit_code[0] = code
            stopping.set()

    def hung(servable_id: int, why: str) -> None:
        """Tell the primary, which stops every front-end (we stop when it says Drain)."""
        found = [(s.name, s.version) for m in registry.models.values() for s in m.versions.values()
                 if s.id == servable_id]
        where = f"model {found[0][0]} version {found[0][1]}" if found else "a model"
        log.error("front-end %d: the model worker is hung (%s: %s)", index, where, why)
        live.append(asyncio.ensure_future(front.health.set_live(False)))
        channel.send(WorkerHung(f"{where}: {why}"))

    live: list[asyncio.Future[None]] = []
    link = WorkerLink(on_lost=lambda why: stop(0.0, 1), on_hung=hung, hang_rule=HangRule(settings.hang_timeout_s))
    await link.connect(worker_sock, worker_handles, worker_pid)

    async def on_serving(now: bool) -> None:
        serving[0] = now
        if not stopping.is_set():
            await front.health.set_serving(now)

    follower = Follower(registry, link, devices, on_serving, settings.frontends)
    views: asyncio.Queue[View] = asyncio.Queue()

    def on_message(message: object) -> None:
        if isinstance(message, View):
            views.put_nowait(message)
        elif isinstance(message, SourcesApplied):
            models.answered(message)
        elif isinstance(message, Drain):
            stop(message.delay_s)
        elif isinstance(message, StatisticsWanted):
            channel.send(StatisticsFound(message.call, own_statistics(registry, message.ids)))
        elif isinstance(message, StatisticsFound):
            models.statistics_found(message)
        else:
            log.error("unexpected message from the primary front-end: %r", type(message).__name__)

    def on_lost(why: str) -> None:
        models.lost(why)
        if not stopping.is_set():
            log.error("front-end %d: the primary front-end is gone (%s); stopping", index, why)
        stop(0.0, 1)

    channel = await WorkerChannel.open(primary_sock, on_message, on_lost)
    models = RemoteModels(channel.send, follower, registry)
    front = FrontEnd(settings, registry, ready=lambda: serving[0] and not stopping.is_set(),
                     models=lambda: models, control=lambda: control, metrics_paths=metrics_paths,
                     peers=models.statistics)
    await front.open(*ports)

    async def follow() -> None:
        while True:
            view = await views.get()
            try:
                await follower.apply(view)
            except Exception:  # a bug here must not stop every later view
                log.exception("front-end %d: applying view %d failed", index, view.seq)
            channel.send(Applied(view.seq))

    tasks = [asyncio.create_task(follow(), name="follow"), asyncio.create_task(loop_lag.watch(), name="loop-lag"),
             asyncio.create_task(link.watch(), name="hang-watch"),
             asyncio.create_task(cpu_share.count(settings.frontends), name="cpu-share")]
    memory.trim_periodically()
    log.debug("front-end %d listening grpc_port=%d rest_api_port=%d", index, front.port, front.rest_port)
    await stopping.wait()
    began = time.monotonic()
    await front.health.start_drain()
    await asyncio.sleep(drain_delay[0])
    grace = settings.grace_period_s - drain_delay[0] if exit_code[0] == 0 else PRIMARY_GONE_GRACE_S
    await front.finish(began + max(grace - 1.0, 0.5))
    for task in tasks:
        task.cancel()
    await follower.drain()
    link.close()
    await front.close()
    channel.close()
    log.log(logging.WARNING if front.accepted > front.answered else logging.INFO,
            "front-end %d drained: accepted=%d answered=%d", index, front.accepted, front.answered)
    return exit_code[0]
