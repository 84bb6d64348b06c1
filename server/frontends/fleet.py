"""The primary's side of the other front-end processes: it spawns them, tells them the models
(views), applies their control calls, restarts one that dies, and drains them on stop.

Each front-end gets, at spawn, the ports the primary bound (so port 0 works: they join the port it
got), a channel of its own to the model worker (ModelProcess.attach), and a socket to the primary.
`publish` sends the registry as it is now and returns once every live front-end has applied it
(server.frontends.follower): the lifecycle awaits it after each change that routing sees, so a
new version is routed everywhere when its load returns, and a retiring one is freed in the worker
only after every front-end has drained it. A front-end that dies is restarted after RESTART_S;
its clients reconnect (to any front-end), the others' see nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from server import metrics
from server.api.control import ControlPlane
from server.config import Settings
from server.core.model_config import ModelSource
from server.core.model_process import ModelProcess
from server.core.servables import Registry
from server.core.statistics import VersionStatistics
from server.core.worker_channel import WorkerChannel
from server.errors import ServingError
from server.frontends.view import (
    Applied,
    ApplySources,
    Drain,
    SourcesApplied,
    StatisticsFound,
    StatisticsWanted,
    WorkerHung,
    add_statistics,
    own_statistics,
    snapshot,
)

log = logging.getLogger("server.frontends.fleet")

RESTART_S = 1.0
"""Wait before restarting a front-end that died (so a crash loop costs one spawn a second)."""
PUBLISH_WAIT_S = 90.0
"""Longest a change waits for a front-end to route by it: its retiring versions' holders get up to
RETIRE_WAIT_S (30 s), then their batchers drain. A front-end that has not answered by then is
logged and the change goes on, so one stuck front-end cannot stop every later rollout."""
STATISTICS_WAIT_S = 2.0
"""Longest a statistics call waits for a front-end's figures (one that does not answer is left out)."""


def _secondary_main(*args: Any) -> None:
    from server.frontends import secondary

    secondary.run(*args)


@dataclass(eq=False)
class _Member:
    index: int
    process: Any
    channel: WorkerChannel | None = None
    applied: int = -1
    waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)
    statistics: dict[int, asyncio.Future[dict[int, list[VersionStatistics]]]] = field(default_factory=dict)
    gone: bool = False

    def settle(self) -> None:
        if self.gone:
            for found in self.statistics.values():
                if not found.done():
                    found.set_result({})
        for seq, future in self.waiters:
            if (self.gone or self.applied >= seq) and not future.done():
                future.set_result(None)
        self.waiters = [(s, f) for s, f in self.waiters if not f.done()]


class Fleet:
    def __init__(self, settings: Settings, worker: ModelProcess, registry: Registry, *, devices: int,
                 ports: tuple[int, int], control: ControlPlane, metrics_paths: tuple[str, ...],
                 serving: Callable[[], bool], configured: Callable[[], Sequence[str]],
                 apply_sources: Callable[[list[ModelSource]], Awaitable[list[str]]],
                 on_hung: Callable[[str], None]) -> None:
        self._settings = settings
        self._worker = worker
        self._registry = registry
        self._devices = devices
        self._ports = ports
        self._control = control
        self._metrics_paths = metrics_paths
        self._serving = serving
        self._configured = configured
        self._apply_sources = apply_sources
        self._on_hung = on_hung
        self._members: dict[int, _Member] = {}
        self._seq = 0
        self._stopping = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._calls = itertools.count()

    @property
    def count(self) -> int:
        """Front-end processes besides the primary, alive now."""
        return sum(not m.gone for m in self._members.values())

    async def start(self, count: int) -> None:
        """Spawn `count` front-ends and wait until each routes by the current view."""
        for index in range(1, count + 1):
            await self._spawn(index)
        await self.publish()

    async def _spawn(self, index: int) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that runs gRPC threads
        ours, theirs = socket.socketpair()
        worker_sock, worker_handles = self._worker.attach()
        process = context.Process(
            target=_secondary_main,
            args=(self._settings, index, theirs, worker_sock, worker_handles, self._worker.pid, self._ports,
                  self._devices, self._control, self._metrics_paths),
            # Not a daemon: a front-end starts a helper process of its own (server.api.http.body) for
            # large REST bodies. It exits by itself when the primary's socket closes.
            name=f"mirrorserve-frontend-{index}", daemon=False)
        member = _Member(index, process)
        self._members[index] = member
        member.channel = await WorkerChannel.open(ours, lambda m: self._on_message(member, m),
                                                  lambda why: self._on_lost(member, why))
        process.start()
        theirs.close()
        worker_sock.close()
        worker_handles.close()

    def _on_message(self, member: _Member, message: object) -> None:
        if isinstance(message, Applied):
            member.applied = max(member.applied, message.seq)
            member.settle()
        elif isinstance(message, ApplySources):
            self._spawn_task(self._apply_for(member, message))
        elif isinstance(message, StatisticsFound):
            found = member.statistics.pop(message.call, None)
            if found is not None and not found.done():
                found.set_result(message.found)
        elif isinstance(message, StatisticsWanted):
            self._spawn_task(self._statistics_for(member, message))
        elif isinstance(message, WorkerHung):
            self._on_hung(f"seen by front-end {member.index}: {message.why}")
        else:
            log.error("unexpected message from front-end %d: %r", member.index, type(message).__name__)

    async def statistics(self, ids: list[int], exclude: _Member | None = None) -> dict[int, list[VersionStatistics]]:
        """The other front-ends' figures of these servables (all but the primary's, and but `exclude`)."""
        loop = asyncio.get_running_loop()
        waiting = []
        for member in self._members.values():
            if member is exclude or member.gone or member.channel is None:
                continue
            call = next(self._calls)
            future: asyncio.Future[dict[int, list[VersionStatistics]]] = loop.create_future()
            member.statistics[call] = future
            member.channel.send(StatisticsWanted(call, tuple(ids)))
            waiting.append(future)
        gathered: dict[int, list[VersionStatistics]] = {}
        if waiting:
            done, _ = await asyncio.wait(waiting, timeout=STATISTICS_WAIT_S)
            for future in done:
                add_statistics(gathered, future.result())
        return gathered

    async def _statistics_for(self, member: _Member, wanted: StatisticsWanted) -> None:
        """A statistics call on another front-end: everyone's figures but its own."""
        found = await self.statistics(list(wanted.ids), exclude=member)
        add_statistics(found, own_statistics(self._registry, wanted.ids))
        if member.channel is not None and not member.gone:
            member.channel.send(StatisticsFound(wanted.call, found))

    async def _apply_for(self, member: _Member, call: ApplySources) -> None:
        try:
            problems = await self._apply_sources(list(call.sources))
            answer = SourcesApplied(call.call, tuple(problems))
        except ServingError as exc:
            answer = SourcesApplied(call.call, (), str(exc))
        except Exception as exc:
            log.exception("applying a control call from front-end %d failed", member.index)
            answer = SourcesApplied(call.call, (), f"{type(exc).__name__}")
        if member.channel is not None and not member.gone:
            member.channel.send(answer)

    def _on_lost(self, member: _Member, why: str) -> None:
        member.gone = True
        member.settle()
        if not self._stopping:  # on stop, drain() reaps them
            self._spawn_task(self._restart(member, why))

    async def _restart(self, member: _Member, why: str) -> None:
        """Reap the dead front-end off the event loop (for its exit code), stop counting its live
        gauges, and start another in its place after RESTART_S."""
        await asyncio.get_running_loop().run_in_executor(None, member.process.join, RESTART_S)
        if member.process.pid is not None and not member.process.is_alive():
            metrics.process_gone(member.process.pid)
        log.error("front-end %d is gone (exit code %s, %s); restarting it in %gs", member.index,
                  member.process.exitcode, why, RESTART_S)
        await asyncio.sleep(RESTART_S)
        if self._stopping or not self._worker.alive:
            return
        try:
            await self._spawn(member.index)
        except Exception:
            log.exception("restarting front-end %d failed", member.index)
            return
        await self.publish()

    def _spawn_task(self, work: Awaitable[Any]) -> None:
        task: asyncio.Task[Any] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def publish(self) -> None:
        """Send every front-end the registry as it is now; return once each live one routes by it."""
        if not self._members:
            return
        self._seq += 1
        view = snapshot(self._registry, self._seq, self._serving(), tuple(self._configured()))
        waiting: dict[asyncio.Future[None], _Member] = {}
        loop = asyncio.get_running_loop()
        for member in self._members.values():
            if member.gone or member.channel is None:
                continue
            future: asyncio.Future[None] = loop.create_future()
            member.waiters.append((view.seq, future))
            member.channel.send(view)
            waiting[future] = member
        if waiting:
            _, late = await asyncio.wait(waiting, timeout=PUBLISH_WAIT_S)
            if late:
                log.error("front-ends %s did not apply model view %d within %gs; going on without them",
                          ",".join(str(waiting[f].index) for f in late), view.seq, PUBLISH_WAIT_S)

    def push(self) -> None:
        """publish, without waiting (status changes: a load begun or failed, health)."""
        if self._members:
            self._spawn_task(self.publish())

    async def drain(self, delay_s: float, deadline: float) -> None:
        """Tell every front-end to drain (health NOT_SERVING now, new calls refused after
        `delay_s`, accepted ones finished) and wait for them to exit, until `deadline`."""
        self._stopping = True
        for member in self._members.values():
            if member.channel is not None and not member.gone:
                member.channel.send(Drain(delay_s))
        for member in self._members.values():
            await asyncio.get_running_loop().run_in_executor(
                None, member.process.join, max(deadline - time.monotonic(), 0.1))
            if member.process.is_alive():
                log.warning("front-end %d did not stop in time; killing it", member.index)
                member.process.kill()
        for task in list(self._tasks):
            task.cancel()

    def close(self) -> None:
        self._stopping = True
        for member in self._members.values():
            if member.channel is not None:
                member.channel.close()
            with contextlib.suppress(Exception):
                if member.process.is_alive():
                    member.process.kill()
