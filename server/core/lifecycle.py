"""Model lifecycle: which versions are loaded, and moving them through their states live.

Every poll (--file-system-poll-wait-seconds) looks at each model's version folders, asks its
policy which of them to serve (the aspired versions), and reconciles, as TensorFlow Serving's
availability-preserving policy does:

- an aspired version not loaded yet is loaded and warmed up in the model worker beside the ones
  serving, and only then becomes AVAILABLE, the moment requests may reach it;
- a serving version that is no longer aspired is unloaded only once some aspired version is
  AVAILABLE (so a corrupt new version, or an emptied folder, leaves the old one serving): it leaves
  request resolution first, its batcher then finishes every request already queued or running,
  and only then does the worker free it;
- a failed load is logged, counted (mirrorserve_model_load_failures_total) and retried while the
  version stays aspired, after 1 s, 2 s, 4 s ... up to 60 s.

A new config (the config file changed, or HandleReloadConfigRequest) replaces the model list: a
removed model leaves resolution at once and its versions are drained and unloaded; an added one
is loaded like any new version. Everything runs on the event loop, one reconcile at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from server import metrics, tracing
from server.config import Settings
from server.core import batching_policy
from server.core.assembly import Tensors
from server.core.batcher import Batcher, Ran
from server.core.batching_policy import BatchingPolicy
from server.core.model_config import ConfigError, ModelSource, batching_changes, read_config_file
from server.core.model_process import LoadError
from server.core.prediction import Predictor
from server.core.servables import Model, Registry, Servable, State
from server.core.signatures import BatchKey, ModelInfo
from server.core.version_folders import scan_versions
from server.core.worker_protocol import Done, Loaded
from server.errors import InvalidInput, Unavailable

log = logging.getLogger("server.core.lifecycle")

RETRY_FIRST_S = 1.0
"""First retry of a failed load: soon, since a half-copied folder is usually whole a second later."""
RETRY_MAX_S = 60.0
"""Longest back-off: a corrupt version is retried about once a minute, not forever spinning."""
MAX_ENDED_RECORDS = 16
"""Unloaded versions kept per model for GetModelStatus (END); older ones are forgotten."""
UNAVAILABLE_CODE = 14
RETIRE_WAIT_S = 30.0
"""Longest a retiring version waits for the requests that resolved to it: long enough for any
request being decoded, short enough that a client trickling its body cannot keep it loaded."""


def plan(
    aspired: Collection[int], states: Mapping[int, State], reload_due: Collection[int]
) -> tuple[list[int], list[int]]:
    """(versions to load, highest first; versions to unload). `reload_due`: ENDed versions that may
    be loaded again now (unloaded cleanly, or failed and past their back-off)."""
    to_load = sorted((v for v in aspired if v not in states or (states[v] is State.END and v in reload_due)),
                     reverse=True)
    if not any(states.get(v) is State.AVAILABLE for v in aspired):
        return to_load, []
    to_unload = sorted(v for v, s in states.items() if s is State.AVAILABLE and v not in aspired)
    return to_load, to_unload


def retry_delay(failures: int) -> float:
    return float(min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** max(failures - 1, 0)))


def _fields(model: str, version: int) -> dict[str, object]:
    """Structured fields of a log record (separate keys in JSON logs)."""
    return {"model": model, "version": version}


def _unbatched(key: Hashable) -> bool:
    """Whether a request's batch key is an unbatched signature's: it runs alone (Batcher's whole)."""
    return isinstance(key, BatchKey) and key.whole


def check_sources(sources: Sequence[ModelSource]) -> None:
    """What a config can only be checked against on disk: each base path is a folder, and each
    request log's folder (its filename_prefix's) is one this process can write files in."""
    for source in sources:
        if not Path(source.base_path).is_dir():
            raise ConfigError(f"model '{source.name}': base path {source.base_path} is not a folder")
        if source.logging is not None:
            folder = Path(source.logging.filename_prefix).parent
            if not folder.is_dir():
                raise ConfigError(f"model '{source.name}': request log folder {folder} (of filename_prefix "
                                  f"{source.logging.filename_prefix}) is not a folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise ConfigError(f"model '{source.name}': request log folder {folder} (of filename_prefix "
                                  f"{source.logging.filename_prefix}) cannot be written by this process")


class Runner(Protocol):
    """What a batcher needs of the model worker: a front-end's link to it."""

    async def run(self, servable_id: int, signature: str, parts: Sequence[Tensors], rows: int = 1,
                  counted_rows: int = 1) -> Done:
        """Run one batch, the parts' rows in order (`rows` with padding, `counted_rows` without)."""


class Worker(Runner, Protocol):
    """What the lifecycle needs of the model worker: server.core.model_process.ModelProcess, or a
    fake in the unit tests. Each call raises Unavailable once the worker is gone."""

    async def load(self, servable_id: int, name: str, version: int, path: str,
                   warm_up_sizes: tuple[int, ...], max_inflight: int,
                   warm_up_failure_allowed_by: str | None = None, max_batch_rows: int = 0,
                   allowed_batch_sizes: tuple[int, ...] = (), measure_cost: bool = False) -> Loaded:
        """Load and warm up one version under the servable id; LoadError if it fails (its warm-up
        on generated rows included, unless `warm_up_failure_allowed_by` says what allows that).
        `max_batch_rows` and `allowed_batch_sizes`: how the worker may merge front-ends' batches;
        `measure_cost`: time its run cost for a latency target (Loaded.run_cost)."""

    async def unload(self, servable_id: int) -> None:
        """Free a servable that will be sent no more batches."""

    @property
    def alive(self) -> bool:
        """False once the worker is gone (health then says NOT_SERVING)."""


class WarmUp(Protocol):
    """A version's own warm-up requests (server.api.warmup: its warmup file)."""

    def covers(self, path: str) -> bool:
        """Whether the version folder at `path` has warm-up requests of its own to run."""

    def __call__(self, servable: Servable) -> Awaitable[object]:
        """Run them on the loaded version before it serves; LoadError fails its load."""


def batcher_for(servable: Servable, policy: BatchingPolicy, worker: Runner, devices: int,
                frontends: int = 1) -> Batcher:
    """A version's batcher, started: its batches go to the model worker through `worker` (this
    front-end's link to it)."""
    labels = (servable.name, str(servable.version))
    replica_rows = [metrics.REPLICA_ROWS.labels(*labels, str(i)) for i in range(devices)]
    servable_id = servable.id

    async def run_batch(key: Hashable, parts: Sequence[Tensors], rows: int) -> Ran:
        assert isinstance(key, BatchKey)
        handed = time.monotonic()
        sent = 1 if key.whole else sum(next(iter(p.values())).shape[0] for p in parts)
        done = await worker.run(servable_id, key.signature, parts, sent, rows)
        for counter, ran in zip(replica_rows, done.replica_rows, strict=False):
            counter.inc(ran)
        handing = 0.0 if done.started_at is None else done.started_at - handed
        if not done.run_rows:  # a worker that does not merge
            return Ran(done.outputs, done.seconds, handing)
        return Ran(done.outputs, done.seconds, handing, done.run_rows if done.run_rows != sent else 0,
                   done.counted_rows)

    batcher = Batcher(
        run_batch,
        max_batch_rows=policy.max_batch_size,
        timeout_s=policy.batch_timeout_s,
        max_queued_rows=policy.max_queued_rows,
        max_inflight=policy.max_inflight_batches,
        allowed_batch_sizes=policy.allowed_batch_sizes,
        observer=metrics.BatcherMetrics(*labels, servable.statistics, policy.max_inflight_batches, frontends),
        name=f"model '{servable.name}' version {servable.version}",
        whole=(lambda key: True) if not policy.batching else _unbatched,
        target_s=policy.target_latency_s if policy.batching else None,
        cost_seed=servable.run_cost,
        on_batch=tracing.batch_recorder(servable.name, servable.version, devices) if tracing.ENABLED else None,
        trace_context=tracing.current_context,
    )
    batcher.start()
    metrics.QUEUE_ROWS_LIMIT.labels(*labels).set(policy.max_queued_rows)
    return batcher


def _check_target(servable: Servable, policy: BatchingPolicy) -> None:
    """A latency target that a lone row cannot meet is said at load, not left to silent misses: a
    WARNING, the target's feasibility gauge at 0, and the version's status message
    (Servable.target_note: GetModelStatus, Triton's repository index)."""
    target = policy.target_latency_s
    if target is None or not policy.batching:
        return
    note = servable.target_note()
    metrics.LATENCY_TARGET.labels(servable.name, str(servable.version)).set(target)
    metrics.LATENCY_TARGET_FEASIBLE.labels(servable.name, str(servable.version)).set(int(not note))
    if note:
        log.warning("model=%s version=%d: %s", servable.name, servable.version, note,
                    extra=_fields(servable.name, servable.version))


async def retire(servable: Servable) -> None:
    """Wait for the requests that resolved to the version (out of resolution by now) to be
    answered, at most RETIRE_WAIT_S (a client still sending its body may hold it longer), and
    finish what its batcher holds; then this front-end has nothing of it left in the worker."""
    if not await servable.unheld(RETIRE_WAIT_S):
        log.warning("model=%s version=%d: %d requests still hold it after %gs; unloading it anyway (they "
                    "are answered UNAVAILABLE)", servable.name, servable.version, servable.holders,
                    RETIRE_WAIT_S, extra=_fields(servable.name, servable.version))
    if servable.predictor is not None:
        await servable.predictor.batcher.drain()
    servable.predictor = None
    servable.cache.clear()


class Lifecycle:
    def __init__(self, settings: Settings, worker: Worker, registry: Registry, devices: int,
                 batching: BatchingPolicy, *, on_change: Callable[[], None] = lambda: None,
                 may_serve_none: bool = False, warm_up: WarmUp | None = None,
                 publish: Callable[[], Awaitable[None]] | None = None) -> None:
        """`may_serve_none`: ready with no model configured (a repository in explicit mode).
        `warm_up`: run on each loaded version before it turns AVAILABLE, its requests through the
        version's own batcher (server.api.warmup: its warmup file); a LoadError fails the load.
        `publish`: tell the other front-end processes the models as they are now, and return once
        each routes by it (server.frontends.fleet); awaited after every change that routing sees."""
        self._publish_to = publish
        self._settings = settings
        self._warm_up = warm_up
        self._batching = batching
        self._worker = worker
        self._registry = registry
        self._devices = devices
        self._on_change = on_change
        self._lock = asyncio.Lock()
        self._by_id: dict[int, Servable] = {}
        self._removed: list[Model] = []
        self._missing_logged: set[str] = set()
        self.configured: list[str] = []
        self._may_serve_none = may_serve_none

    # ---- config ------------------------------------------------------------------------------

    async def apply(self, sources: Sequence[ModelSource]) -> list[str]:
        """Serve exactly these models; returns, for each model the config adds, why it has no
        AVAILABLE version after one reconcile ([] when every added model serves)."""
        async with self._lock:
            models = self._registry.models
            self._check_batching_unchanged(sources)
            added = [s.name for s in sources if s.name not in models]
            for name in [n for n in models if n not in {s.name for s in sources}]:
                log.info("model=%s removed from the config; unloading its versions", name, extra={"model": name})
                self._removed.append(models.pop(name))
            for source in sources:
                model = models.get(source.name)
                if model is None:
                    models[source.name] = Model(source)
                elif model.source != source:
                    model.source = source
            self.configured = [s.name for s in sources]
            await self._reconcile()
            await self._publish()
        problems = []
        for name in added:
            model = models.get(name)
            if model is not None and model.default is None:
                failed = [s for s in model.versions.values() if s.error is not None]
                why = failed[0].error[1] if failed and failed[0].error else "no version folder its policy serves"
                problems.append(f"'{name}': {why}")
        return problems

    def _check_batching_unchanged(self, sources: Sequence[ModelSource]) -> None:
        """A model's batching_parameters take effect when a version loads (the worker merges and
        warms up by them); so a change to them while versions are loaded is refused, naming the
        fields, rather than silently ignored until the next version."""
        for source in sources:
            model = self._registry.models.get(source.name)
            if model is None or model.source.batching == source.batching:
                continue
            loaded = sorted(v for v, s in model.versions.items() if s.state in (State.LOADING, State.AVAILABLE))
            if loaded:
                changes = "; ".join(batching_changes(model.source.batching, source.batching))
                raise InvalidInput(
                    f"model '{source.name}': batching_parameters changed ({changes}) while version(s) "
                    f"{', '.join(map(str, loaded))} are loaded; they take effect when a version loads, so serve "
                    f"the change with a new version, or remove the model from the config and add it back")

    async def poll_versions(self) -> None:
        """Re-read the version folders every --file-system-poll-wait-seconds (0: never again)."""
        interval = self._settings.file_system_poll_wait_seconds
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            try:
                async with self._lock:
                    await self._reconcile()
            except Exception:  # a bug must not stop every later poll
                log.exception("reconciling the models failed; trying again at the next poll")

    async def poll_config_file(self, path: str, first_text: str) -> None:
        """Re-read the config file every --model-config-file-poll-wait-seconds; apply it when its
        text changed and it is valid (a bad file is logged once and the current config kept)."""
        interval = self._settings.model_config_file_poll_wait_seconds
        if interval <= 0:
            return
        seen = first_text
        while True:
            await asyncio.sleep(interval)
            try:
                text = Path(path).read_text()
            except OSError as exc:
                if seen != "":
                    log.error("cannot read model config file %s: %s; keeping the current config", path, exc)
                seen = ""
                continue
            if text == seen:
                continue
            seen = text
            try:
                sources = read_config_file(path)
                check_sources(sources)
            except ConfigError as exc:
                log.error("model config file changed but is not valid, keeping the current config: %s", exc)
                continue
            log.info("model config file %s changed: models %s", path, ",".join(s.name for s in sources))
            try:
                await self.apply(sources)
            except InvalidInput as exc:
                log.error("model config file changed but cannot be applied, keeping the current config: %s", exc)
            except Exception:
                log.exception("applying the changed model config failed")

    # ---- reconcile ---------------------------------------------------------------------------

    async def _reconcile(self) -> None:
        while self._removed:
            model = self._removed.pop()
            for servable in list(model.versions.values()):
                if servable.state is State.AVAILABLE:
                    await self._unload(model, servable)
                metrics.forget_version(servable.name, str(servable.version))
        for model in list(self._registry.models.values()):
            await self._reconcile_model(model)

    async def _reconcile_model(self, model: Model) -> None:
        source = model.source
        try:
            on_disk = scan_versions(source.base_path)
            self._missing_logged.discard(source.name)
        except OSError as exc:
            if source.name not in self._missing_logged:
                log.warning("model=%s: %s; its loaded versions keep serving", source.name, exc,
                            extra={"model": source.name})
                self._missing_logged.add(source.name)
            return
        aspired = source.policy.aspired(sorted(on_disk))
        now = time.monotonic()
        to_load, _ = plan(aspired, self._states(model), self._reload_due(model, now))
        for version in to_load:
            if self._registry.models.get(source.name) is not model:
                return  # removed by a config change meanwhile
            await self._load(model, version, str(on_disk[version]))
        _, to_unload = plan(aspired, self._states(model), ())
        for version in to_unload:
            await self._unload(model, model.versions[version])
        self._forget_old(model)

    @staticmethod
    def _states(model: Model) -> dict[int, State]:
        return {v: s.state for v, s in model.versions.items()}

    @staticmethod
    def _reload_due(model: Model, now: float) -> set[int]:
        return {v for v, s in model.versions.items()
                if s.state is State.END and (s.error is None or s.retry_at <= now)}

    async def _load(self, model: Model, version: int, path: str) -> None:
        name = model.source.name
        previous = model.versions.get(version)
        servable = Servable(name=name, version=version, path=path, state=State.LOADING,
                            failures=previous.failures if previous is not None and previous.error else 0)
        model.versions[version] = servable
        labels = (name, str(version))
        metrics.MODEL_READY.labels(*labels).set(0)
        metrics.MODEL_LOAD_FAILURES.labels(*labels)  # exported at 0 from the first attempt, so alerts see it
        self._on_change()
        started = time.monotonic()
        fields = _fields(name, version)
        policy = self._policy_for(model)
        log.info("loading model=%s version=%d path=%s batching: %s", name, version, path, policy.describe(),
                 extra=fields)
        try:
            loaded = await self._worker.load(servable.id, name, version, path, policy.warm_up_sizes(),
                                             policy.max_inflight_batches, self._warm_up_failure_allowed_by(path),
                                             policy.max_batch_size if policy.batching else 0,
                                             tuple(policy.allowed_batch_sizes),
                                             measure_cost=policy.batching and policy.target_latency_s is not None)
        except (LoadError, Unavailable) as exc:
            self._load_failed(servable, exc)
            return
        info = loaded.info
        await self._warm_batch_path(servable.id, info, policy.max_inflight_batches)
        servable.signature_defs = loaded.signature_defs
        servable.batching = policy
        servable.run_cost = loaded.run_cost
        _check_target(servable, policy)
        servable.predictor = Predictor(info, self._batcher_for(servable, policy))
        self._by_id[servable.id] = servable
        if self._warm_up is not None:
            try:
                await self._warm_up(servable)
            except (LoadError, Unavailable) as exc:
                await self._retire_and_free(servable)
                self._load_failed(servable, exc)
                return
        servable.state = State.AVAILABLE
        model.refresh()
        metrics.MODEL_READY.labels(*labels).set(1)
        metrics.MODEL_LOADS.labels(*labels).inc()
        metrics.MODEL_LOAD_SECONDS.labels(name).observe(time.monotonic() - started)
        served = sorted(info.signatures)
        log.info("available model=%s version=%d signatures=%s seconds=%.2f",
                 name, version, ",".join(served), time.monotonic() - started, extra=fields)
        self._on_change()
        await self._publish()

    def _load_failed(self, servable: Servable, exc: LoadError | Unavailable) -> None:
        """A load (or its warm-up) failed: END with the error, retried later while aspired."""
        labels = (servable.name, str(servable.version))
        servable.state = State.END
        servable.error = (exc.code if isinstance(exc, LoadError) else UNAVAILABLE_CODE, str(exc))
        servable.failures += 1
        delay = retry_delay(servable.failures)
        servable.retry_at = time.monotonic() + delay
        metrics.MODEL_LOAD_FAILURES.labels(*labels).inc()
        metrics.forget_version(*labels)
        metrics.MODEL_READY.labels(*labels).set(0)  # kept: alerts see a model with no ready version
        log.error("model=%s version=%d failed to load (attempt %d; retrying in %gs while it is aspired): %s",
                  servable.name, servable.version, servable.failures, delay, exc,
                  extra=_fields(servable.name, servable.version))
        self._on_change()

    def _warm_up_failure_allowed_by(self, path: str) -> str | None:
        """What lets a version serve though it failed on the generated warm-up rows: nothing by
        default (its load fails, and its status says why), --no-strict-warm-up, or a warmup file
        of its own, whose real requests then decide instead."""
        if not self._settings.strict_warm_up:
            return "--no-strict-warm-up"
        if self._warm_up is not None and self._warm_up.covers(path):
            return "its warmup file decides: its requests run next, and a failure fails the load"
        return None

    async def _warm_batch_path(self, servable_id: int, info: ModelInfo, inflight: int) -> None:
        """One 1-row batch of each signature, `inflight` at once, through the hand-off real batches
        take: the worker warmed the version up on its loader thread, but a batch thread's first
        call of a program, and the first batch's shared-memory slot, still cost set-up that must
        not land on the first request. A failure here is only logged: the worker's warm-up on the
        same rows has already passed, or was allowed to fail (_warm_up_failure_allowed_by)."""
        for name, signature in info.signatures.items():
            batch = signature.example(1)
            results = await asyncio.gather(*(self._worker.run(servable_id, name, [batch]) for _ in range(inflight)),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    log.debug("warm-up batch of signature '%s' failed: %s", name, result)

    def _policy_for(self, model: Model) -> BatchingPolicy:
        """The server's batching, with the model's own config fields over it."""
        if model.source.batching is None:
            return self._batching
        return batching_policy.apply(self._batching, model.source.batching)

    def _batcher_for(self, servable: Servable, policy: BatchingPolicy) -> Batcher:
        return batcher_for(servable, policy, self._worker, self._devices, self._settings.frontends)

    async def _unload(self, model: Model, servable: Servable) -> None:
        labels = (servable.name, str(servable.version))
        servable.state = State.UNLOADING  # out of resolution from here on
        model.refresh()
        metrics.MODEL_READY.labels(*labels).set(0)
        self._on_change()
        fields = _fields(servable.name, servable.version)
        log.info("unloading model=%s version=%s: finishing its queued requests", *labels, extra=fields)
        await self._publish()  # every front-end has stopped routing to it and drained its requests
        await self._retire_and_free(servable)
        servable.state = State.END
        metrics.forget_version(*labels)
        gc.collect()  # the version's objects are younger than the start-up freeze: this frees them
        log.info("unloaded model=%s version=%s", *labels, extra=fields)
        self._on_change()

    async def _retire_and_free(self, servable: Servable) -> None:
        """Retire the version here (retire), free it in the worker, and drop what this process
        kept of it (an unload, or a load whose warm-up failed)."""
        await retire(servable)
        with contextlib.suppress(Unavailable):  # the worker is gone; the server is stopping anyway
            await self._worker.unload(servable.id)
        servable.signature_defs = {}
        self._by_id.pop(servable.id, None)

    async def _publish(self) -> None:
        if self._publish_to is not None:
            await self._publish_to()

    def _forget_old(self, model: Model) -> None:
        ended = sorted((v for v, s in model.versions.items() if s.state is State.END and s.error is None))
        for version in ended[:-MAX_ENDED_RECORDS]:
            del model.versions[version]

    # ---- queries -----------------------------------------------------------------------------

    def sources(self) -> list[ModelSource]:
        """The models configured now, in order."""
        models = self._registry.models
        return [models[n].source for n in self.configured if n in models]

    def servable(self, servable_id: int) -> Servable | None:
        return self._by_id.get(servable_id)

    def every_model_available(self) -> bool:
        models = self._registry.models
        return self._worker.alive and (bool(self.configured) or self._may_serve_none) and all(
            models[n].default is not None for n in self.configured if n in models)

    async def drain(self) -> None:
        """Finish every request queued or running in any version (the server is stopping)."""
        for model in [*self._registry.models.values(), *self._removed]:
            for servable in model.versions.values():
                if servable.predictor is not None:
                    metrics.MODEL_READY.labels(servable.name, str(servable.version)).set(0)
                    await servable.predictor.batcher.drain()
