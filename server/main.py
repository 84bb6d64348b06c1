"""Composition root and lifecycle.

Start: the config is read and checked (a bad one exits 2, naming the line); the gRPC port opens,
with health NOT_SERVING and Predict answering UNAVAILABLE, so probes see the truth while
TensorFlow loads. TensorFlow runs in a child process (server.worker.loop: devices, the strategy,
then every model version the lifecycle asks for, warmed up); once every configured model has an
AVAILABLE version, health turns SERVING and one start-up line is logged. From then on
server.core.lifecycle polls version folders (and the config file) and rolls versions in and out. If
the worker dies, the server drains and exits 1, so the orchestrator restarts both.

HTTP (server.api.http.server: both REST APIs and /metrics) opens beside gRPC, on the same event loop,
before the models load.

Stop (SIGTERM or SIGINT), in the order Kubernetes expects of a pod: health NOT_SERVING (and
/v2/health/ready 400) while still accepting for --drain-delay-s; then refuse new requests on every
front-end, gRPC and REST, and finish every accepted one (queued and in flight); exit 0 within
--grace-period-s of the signal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import start_http_server

from server import event_loop, logs, memory, metrics
from server.api.control import Admins, ControlPlane, default_roots, read_admins
from server.api.warmup import Warmup
from server.config import Settings, parse_settings
from server.core import batching_policy, model_config
from server.core.lifecycle import Lifecycle, check_sources
from server.core.model_process import ModelProcess
from server.core.repository import repository_sources
from server.core.servables import Registry
from server.core.statistics import VersionStatistics
from server.errors import Unavailable
from server.frontends import cpu_share, loop_lag, monitoring_config
from server.frontends.fleet import Fleet
from server.frontends.front_end import FrontEnd

log = logging.getLogger("server")


async def serve(settings: Settings) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_requested_at: list[float] = []

    def request_stop(signum: int) -> None:
        if not stop_requested_at:
            stop_requested_at.append(time.monotonic())
            log.info("received %s", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop, sig)

    for warning in settings.flag_warnings:
        log.warning("%s", warning)
    sources = _configured_sources(settings)
    metrics_paths = monitoring_config.metrics_paths(settings.monitoring_config_file)  # a bad file exits 2
    batching = batching_policy.server_policy(settings)  # a bad --batching_parameters_file exits 2
    config_text = Path(settings.model_config_file).read_text() if settings.model_config_file else ""
    admins = read_admins(settings.admin_token_file) if settings.admin_token_file else Admins({})
    admin_ca = Path(settings.admin_client_ca_file).read_bytes() if settings.admin_client_ca_file else b""
    control = ControlPlane(settings.enable_model_management, admins.tokens, settings.tls_client_ca_file is not None,
                           settings.model_roots, admins.certificates, admin_ca)
    registry = Registry()
    lifecycle: Lifecycle | None = None
    fleet: Fleet | None = None
    announced = False

    # v2's ServerReady says what health says: every start-up model serves, and no drain has begun.
    def ready() -> bool:
        return not registry.starting and not stop.is_set()

    async def peers(ids: list[int]) -> dict[int, list[VersionStatistics]]:
        return {} if fleet is None else await fleet.statistics(ids)

    front = FrontEnd(settings, registry, ready=ready, models=lambda: lifecycle, control=lambda: control,
                     metrics_paths=metrics_paths, peers=peers)
    health, logs = front.health, front.logs
    await front.open(settings.port, settings.rest_api_port)
    port, rest_port = front.port, front.rest_port
    metrics_port = -1
    if settings.metrics_port >= 0:
        http_server, _ = start_http_server(settings.metrics_port, addr=settings.rest_bind_address or "0.0.0.0",
                                           registry=metrics.page_registry())
        metrics_port = http_server.server_port

    exit_code = 0

    def worker_lost(why: str) -> None:
        nonlocal exit_code
        exit_code = 1
        log.error("stopping: the model worker process is gone (%s)", why)
        if not stop_requested_at:
            stop_requested_at.append(time.monotonic())
        stop.set()

    def worker_hung(why: str) -> None:
        """A batch outran its time limit (server.core.watchdog) here or in another front-end: the
        worker may never answer again. Drain (the other models are answered meanwhile) and exit 1,
        so the orchestrator restarts the server, as for a dead worker: a fresh process also gets
        a fresh device, which a hung kernel may have left unusable."""
        nonlocal exit_code
        exit_code = 1
        log.error("stopping: the model worker is hung (%s); liveness NOT_SERVING", why)
        tasks.append(loop.create_task(health.set_live(False), name="liveness"))
        if not stop_requested_at:
            stop_requested_at.append(time.monotonic())
        stop.set()

    def batch_hung(servable_id: int, why: str) -> None:
        servable = lifecycle.servable(servable_id) if lifecycle is not None else None
        where = f"model {servable.name} version {servable.version}" if servable is not None else "a model"
        worker_hung(f"{where}: {why}")

    tasks: list[asyncio.Task[None]] = []

    def count_traces(servable_id: int, traces: dict[str, int]) -> None:
        servable = lifecycle.servable(servable_id) if lifecycle is not None else None
        if servable is None:
            return
        seen = servable.cache.setdefault("traces", {})
        for name, total in traces.items():
            if total > seen.get(name, 0):
                metrics.TRACES.labels(servable.name, str(servable.version), name).inc(total - seen.get(name, 0))
                seen[name] = total

    worker = ModelProcess(settings, on_traces=count_traces, on_lost=worker_lost, on_hung=batch_hung)

    async def announce() -> None:
        # Loading TensorFlow and the models leaves ~270k Python objects; one full garbage
        # collection over them stalls the event loop for ~160 ms here. Collect once now and freeze
        # the survivors out of every later collection, so no request pays for that pause.
        gc.collect()
        gc.freeze()
        if stop.is_set():
            return
        registry.starting = False
        await health.set_serving(True)
        if fleet is not None:
            await fleet.publish()
        assert lifecycle is not None
        effective = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(settings).items())
        log.info(
            "serving model=%s version=%s signatures=%s path=%s grpc_port=%d rest_api_port=%d metrics_port=%d "
            "frontends=%d replicas=%d "
            "devices=%s %s tls=%s | settings: %s",
            *_describe(registry, lifecycle.configured), port, rest_port, metrics_port,
            1 + (fleet.count if fleet is not None else 0), len(started.devices),
            ",".join(started.devices), batching.describe(), settings.tls_mode, effective,
        )

    def models_changed() -> None:
        nonlocal announced
        if fleet is not None:
            fleet.push()
        logs.retire(registry)  # a model removed, or its logging_config gone: its writer stops
        if not announced and lifecycle is not None and lifecycle.every_model_available():
            announced = True
            tasks.append(loop.create_task(announce(), name="announce"))

    log.info("listening grpc_port=%d rest_api_port=%d metrics_port=%d tls=%s; loading models (health NOT_SERVING)",
             port, rest_port, metrics_port, settings.tls_mode)
    try:
        started = await worker.start()
    except BaseException:
        worker.close()
        await front.stop_listening()
        raise
    if sources is None:
        assert started.demo_base_path is not None
        sources = model_config.shorthand(started.demo_base_path, settings.model_name)
    if not settings.model_roots:
        control = control.with_roots(default_roots(sources) if settings.model_repository is None
                                     else (settings.model_repository,))
    if settings.enable_model_management:
        log.info("model management is on: tokens=%d admin_certificates=%d admin_client_ca=%s mutual_tls=%s "
                 "model_roots=%s", len(admins.tokens), len(admins.certificates), bool(admin_ca),
                 settings.tls_client_ca_file is not None, ",".join(control.roots))
    if settings.frontends > 1:
        fleet = Fleet(settings, worker, registry, devices=len(started.devices), ports=(port, rest_port),
                      control=control, metrics_paths=metrics_paths, serving=ready,
                      configured=lambda: lifecycle.configured if lifecycle is not None else (),
                      apply_sources=lambda sources: _apply(lifecycle, sources), on_hung=worker_hung)
        await fleet.start(settings.frontends - 1)
    lifecycle = Lifecycle(settings, worker, registry, len(started.devices), batching, on_change=models_changed,
                          may_serve_none=settings.model_repository is not None,
                          warm_up=Warmup(settings.warmup_iterations, settings.max_message_bytes, front.examples)
                          if settings.model_warmup else None,
                          publish=fleet.publish if fleet is not None else None)
    tasks.append(loop.create_task(lifecycle.poll_versions(), name="poll-versions"))
    problems = await lifecycle.apply(sources)
    if problems:
        log.warning("not serving yet (health NOT_SERVING); retrying: %s", "; ".join(problems))
    if settings.model_config_file is not None:
        tasks.append(loop.create_task(
            lifecycle.poll_config_file(settings.model_config_file, config_text), name="poll-config"))

    tasks.append(loop.create_task(loop_lag.watch(), name="loop-lag"))
    tasks.append(loop.create_task(worker.watch(), name="hang-watch"))
    tasks.append(loop.create_task(cpu_share.count(settings.frontends), name="cpu-share"))
    memory.trim_periodically()
    await stop.wait()
    for task in tasks:
        task.cancel()
    await health.start_drain()
    deadline = stop_requested_at[0] + settings.grace_period_s - 0.5  # leave time to exit
    draining = None
    if fleet is not None:
        draining = loop.create_task(fleet.drain(settings.drain_delay_s, deadline), name="drain-front-ends")
    log.info("draining: health NOT_SERVING; still accepting for %gs", settings.drain_delay_s)
    await asyncio.sleep(settings.drain_delay_s)
    log.info("refusing new RPCs; finishing %d accepted", front.in_flight)
    await front.finish(deadline)
    if draining is not None:
        await draining  # the other front-ends' calls still need the worker
    await lifecycle.drain()
    worker.close()
    if fleet is not None:
        fleet.close()
    await front.close()
    accepted, answered = front.accepted, front.answered
    log.log(logging.WARNING if accepted > answered else logging.INFO,
            "drained: accepted=%d answered=%d", accepted, answered)
    return exit_code


async def _apply(lifecycle: Lifecycle | None, sources: list[model_config.ModelSource]) -> list[str]:
    if lifecycle is None:
        raise Unavailable("the server is starting; retry shortly")
    return await lifecycle.apply(sources)


def _configured_sources(settings: Settings) -> list[model_config.ModelSource] | None:
    """The start-up models (None: the demo model, whose folder the worker builds). A bad config
    file or a missing base path stops the start with exit code 2, naming it."""
    if settings.model_repository is not None:
        sources = repository_sources(settings.model_repository, settings.model_control_mode, settings.load_models)
    elif settings.model_config_file is not None:
        sources = model_config.read_config_file(settings.model_config_file)
    elif settings.model_base_path is not None:
        sources = model_config.shorthand(settings.model_base_path, settings.model_name)
    else:
        return None
    check_sources(sources)
    return sources


def _describe(registry: Registry, names: Sequence[str]) -> tuple[str, str, str, str]:
    """model, version, signatures and path fields of the start-up line: one value per model,
    joined by ','; several versions of one model joined by '+'."""
    models = [registry.models[n] for n in names if n in registry.models]
    versions, signatures, paths = [], [], []
    for model in models:
        available = [model.versions[v] for v in model.available_versions()]
        versions.append("+".join(str(s.version) for s in available))
        paths.append("+".join(s.path for s in available))
        default = model.default
        served = [] if default is None or default.predictor is None else sorted(default.predictor.model.signatures)
        signatures.append("+".join(served))
    return ",".join(m.source.name for m in models), ",".join(versions), ",".join(signatures), ",".join(paths)


def main(argv: Sequence[str] | None = None, settings: Settings | None = None) -> int:
    if settings is None:
        settings = parse_settings(argv)
    logs.configure(settings.log_format, settings.log_level)
    try:
        return event_loop.run(serve(settings), settings.event_loop)
    except (FileNotFoundError, ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
