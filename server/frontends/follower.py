"""A front-end process other than the primary: its registry follows the primary's views.

Views are applied one at a time, in order. A version the view serves and this front-end does not
know yet gets a Servable of its own here (same id, so its batches name the same servable in the
worker) with a batcher whose batches go to the worker through this front-end's link. A version
it served that the view no longer serves leaves resolution at once, then is retired here (its
holders answered, its batcher drained) before Applied is sent: so the primary frees it in the
worker only when no front-end can still send it a batch. Control calls that change the model list
are sent to the primary (RemoteModels), which applies them once for every front-end.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from server.core.lifecycle import Runner, batcher_for, retire
from server.core.model_config import ModelSource
from server.core.prediction import Predictor
from server.core.servables import Model, Registry, Servable, State
from server.core.statistics import VersionStatistics
from server.errors import Unavailable
from server.frontends.view import ApplySources, SourcesApplied, StatisticsFound, StatisticsWanted, View

STATISTICS_WAIT_S = 3.0
"""Longest a statistics call waits for the other front-ends' figures through the primary."""

log = logging.getLogger("server.frontends.follower")


class Follower:
    def __init__(self, registry: Registry, worker: Runner, devices: int,
                 on_serving: Callable[[bool], Any], frontends: int = 1) -> None:
        self._registry = registry
        self._worker = worker
        self._devices = devices
        self._frontends = frontends
        self._on_serving = on_serving
        self.configured: tuple[str, ...] = ()
        self._by_id: dict[int, Servable] = {}

    async def apply(self, view: View) -> None:
        registry = self._registry
        serving_ids = set()
        retiring: list[Servable] = []
        names = {m.source.name for m in view.models}
        for name in [n for n in registry.models if n not in names]:
            registry.models.pop(name)
        for model_view in view.models:
            model = registry.models.get(model_view.source.name)
            if model is None:
                model = registry.models[model_view.source.name] = Model(model_view.source)
            model.source = model_view.source
            versions: dict[int, Servable] = {}
            for v in model_view.versions:
                servable = self._by_id.get(v.id)
                if v.state is State.AVAILABLE and v.info is not None and v.batching is not None:
                    serving_ids.add(v.id)
                    if servable is None:
                        servable = Servable(name=model_view.source.name, version=v.version, path=v.path, id=v.id)
                        servable.signature_defs = v.signature_defs
                        servable.batching = v.batching
                        servable.run_cost = v.run_cost
                        servable.predictor = Predictor(v.info, batcher_for(servable, v.batching, self._worker,
                                                                           self._devices, self._frontends))
                        self._by_id[v.id] = servable
                    servable.state = State.AVAILABLE
                elif servable is None:  # not served here: a record for its status only
                    servable = Servable(name=model_view.source.name, version=v.version, path=v.path, id=v.id,
                                        state=v.state, error=v.error)
                else:
                    servable.state = v.state if v.state is not State.AVAILABLE else State.UNLOADING
                    servable.error = v.error
                versions[v.version] = servable
            model.versions = versions
        for servable_id in [i for i in self._by_id if i not in serving_ids]:
            servable = self._by_id.pop(servable_id)
            if servable.state is State.AVAILABLE:
                servable.state = State.UNLOADING
            retiring.append(servable)
        for model in registry.models.values():
            model.refresh()
        self.configured = view.configured
        registry.starting = view.starting
        await self._on_serving(view.serving)
        if retiring:
            await asyncio.gather(*(retire(s) for s in retiring))

    async def drain(self) -> None:
        """Finish every request queued or running here (the server is stopping)."""
        await asyncio.gather(*(s.predictor.batcher.drain() for s in self._by_id.values() if s.predictor is not None))


class RemoteModels:
    """The lifecycle's control side (apply, sources) in a front-end other than the primary: the
    change goes to the primary, which applies it once, for every front-end, and answers when each
    routes by it."""

    def __init__(self, send: Callable[[object], None], follower: Follower, registry: Registry) -> None:
        self._send = send
        self._follower = follower
        self._registry = registry
        self._calls = itertools.count()
        self._waiting: dict[int, asyncio.Future[SourcesApplied]] = {}
        self._statistics: dict[int, asyncio.Future[dict[int, list[VersionStatistics]]]] = {}

    def sources(self) -> list[ModelSource]:
        models = self._registry.models
        return [models[n].source for n in self._follower.configured if n in models]

    async def apply(self, sources: list[ModelSource]) -> list[str]:
        call = next(self._calls)
        future: asyncio.Future[SourcesApplied] = asyncio.get_running_loop().create_future()
        self._waiting[call] = future
        self._send(ApplySources(call, tuple(sources)))
        try:
            answer = await future
        finally:
            self._waiting.pop(call, None)
        if answer.error is not None:
            raise Unavailable(answer.error)
        return list(answer.problems)

    def answered(self, answer: SourcesApplied) -> None:
        future = self._waiting.get(answer.call)
        if future is not None and not future.done():
            future.set_result(answer)

    async def statistics(self, ids: list[int]) -> dict[int, list[VersionStatistics]]:
        """Every other front-end's figures of these servables, gathered by the primary."""
        call = next(self._calls)
        future: asyncio.Future[dict[int, list[VersionStatistics]]] = asyncio.get_running_loop().create_future()
        self._statistics[call] = future
        self._send(StatisticsWanted(call, tuple(ids)))
        try:
            async with asyncio.timeout(STATISTICS_WAIT_S):
                return await future
        except TimeoutError:
            return {}
        finally:
            self._statistics.pop(call, None)

    def statistics_found(self, answer: StatisticsFound) -> None:
        future = self._statistics.get(answer.call)
        if future is not None and not future.done():
            future.set_result(answer.found)

    def lost(self, why: str) -> None:
        for found in self._statistics.values():
            if not found.done():
                found.set_result({})
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(Unavailable(f"the primary front-end is gone ({why}); retry"))
