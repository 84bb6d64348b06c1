"""What the other front-end processes are told of the served models, and what they say back.
Pure: plain data, pickled over each front-end's socket to the primary.

The primary front-end owns the lifecycle (versions, labels, config, loads in the worker). After
each change it sends every other front-end a View: each configured model, and each of its
versions with the state, id and everything a front-end needs to route and batch requests for it.
A front-end answers Applied(seq) once it routes by that view, including when a version the view
no longer serves has been drained there (its requests answered, its batcher empty): only then
does the primary free the version in the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from server.core.batching_policy import BatchingPolicy
from server.core.model_config import ModelSource
from server.core.servables import Registry, State
from server.core.signatures import ModelInfo, SignatureDefinition
from server.core.statistics import VersionStatistics


@dataclass(frozen=True)
class VersionView:
    id: int
    version: int
    path: str
    state: State
    error: tuple[int, str] | None
    info: ModelInfo | None
    """While it serves (AVAILABLE): its signatures, for requests and metadata."""
    signature_defs: Mapping[str, SignatureDefinition]
    batching: BatchingPolicy | None
    run_cost: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class ModelView:
    source: ModelSource
    versions: tuple[VersionView, ...]


@dataclass(frozen=True)
class View:
    seq: int
    models: tuple[ModelView, ...]
    starting: bool
    """Not every start-up model serves yet (the registry's `starting`)."""
    serving: bool
    """Health says SERVING (start-up done, no drain begun)."""
    configured: tuple[str, ...]
    """The configured model names, in config order (the lifecycle's `sources()`)."""


@dataclass(frozen=True)
class Applied:
    seq: int


@dataclass(frozen=True)
class ApplySources:
    """A control call on a front-end other than the primary: serve exactly these models (the
    lifecycle's `apply`); the primary answers SourcesApplied with the same `call`."""

    call: int
    sources: tuple[ModelSource, ...]


@dataclass(frozen=True)
class SourcesApplied:
    call: int
    problems: tuple[str, ...]
    error: str | None = None
    """Why the primary could not apply them (then `problems` is empty)."""


@dataclass(frozen=True)
class StatisticsWanted:
    """Each front-end records the requests it answered; a statistics call (ModelStatistics) adds
    up every front-end's figures of these servables. Asked of the primary by another front-end,
    it means "everyone's but mine"; asked of another front-end by the primary, "yours"."""

    call: int
    ids: tuple[int, ...]


@dataclass(frozen=True)
class StatisticsFound:
    call: int
    found: dict[int, list[VersionStatistics]]


def own_statistics(registry: Registry, ids: tuple[int, ...]) -> dict[int, list[VersionStatistics]]:
    wanted = set(ids)
    return {s.id: [s.statistics] for m in registry.models.values() for s in m.versions.values() if s.id in wanted}


def add_statistics(into: dict[int, list[VersionStatistics]], found: dict[int, list[VersionStatistics]]) -> None:
    for servable, statistics in found.items():
        into.setdefault(servable, []).extend(statistics)


@dataclass(frozen=True)
class WorkerHung:
    """A front-end other than the primary saw one of its batches outrun its time limit
    (server.core.watchdog): the primary stops the server, as for a dead worker."""

    why: str


@dataclass(frozen=True)
class Drain:
    """The server is stopping: turn health NOT_SERVING, refuse new calls after `delay_s`, finish
    the accepted ones, and exit."""

    delay_s: float


def snapshot(registry: Registry, seq: int, serving: bool, configured: tuple[str, ...]) -> View:
    """The registry as a View (the primary's side)."""
    models = []
    for model in registry.models.values():
        versions = []
        for servable in model.versions.values():
            predictor = servable.predictor
            available = servable.state is State.AVAILABLE and predictor is not None
            versions.append(VersionView(
                servable.id, servable.version, servable.path, servable.state, servable.error,
                predictor.model if available and predictor is not None else None,
                dict(servable.signature_defs) if available else {}, servable.batching if available else None,
                servable.run_cost))
        models.append(ModelView(model.source, tuple(versions)))
    return View(seq, tuple(models), registry.starting, serving, configured)
