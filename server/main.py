"""Composition root and lifecycle.

Start: the config is read and checked (a bad one exits 2, naming the line); the gRPC port opens,
with health NOT_SERVING and Predict answering UNAVAILABLE, so probes see the truth while
TensorFlow loads. TensorFlow runs in a child process (server.worker.loop: devices, the strategy,
then every model version the lifecycle asks for, warmed up); once every configured model has an
AVAILABLE version, health turns SERVING and one start-up line is logged. From then on
server.core.lifecycle polls version folders (and the config file) and rolls versions in and out. If
the worker dies, the server drains and exits 1, so the orchestrator restarts both.

HTTP (server.api.rest: both REST APIs and /metrics) opens beside gRPC, on the same event loop,
before the models load.

Stop (SIGTERM or SIGINT), in the order of architecture.md, example 9: health NOT_SERVING (and
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
import ssl
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from prometheus_client import start_http_server

from server import event_loop, logs, loop_lag, memory, metrics, monitoring_config
from server.api import rest, rest_tfs, rest_v2, tfs, tfs_model_service, v2
from server.api.admission import ConcurrencyLimit
from server.api.control import ControlPlane, default_roots, read_tokens
from server.api.health import Health, add_health_and_reflection
from server.api.request_log import RequestLogs
from server.api.rest_body import MAX_WAITING, BodyDecoder
from server.api.tfs_examples import ExampleCalls
from server.api.warmup import Warmup
from server.config import Settings, parse_settings
from server.core import batching_policy, model_config
from server.core.example_methods import ExampleMethods
from server.core.lifecycle import Lifecycle, check_sources
from server.core.model_process import ModelProcess
from server.core.repository import Repository, repository_sources
from server.core.servables import Registry
from server.grpc_options import grpc_options
from server.ssl_config import read_ssl_config

log = logging.getLogger("server")


def _server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    if settings.ssl_config_file is not None:
        ssl_config = read_ssl_config(settings.ssl_config_file)  # a bad file exits 2
        return grpc.ssl_server_credentials([(ssl_config.key, ssl_config.cert)], root_certificates=ssl_config.client_ca,
                                           require_client_auth=ssl_config.client_ca is not None)
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    with open(settings.tls_key_file, "rb") as key, open(settings.tls_cert_file, "rb") as cert:
        pair = (key.read(), cert.read())
    client_ca = None
    if settings.tls_client_ca_file is not None:
        with open(settings.tls_client_ca_file, "rb") as ca:
            client_ca = ca.read()
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _rest_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The same certificate, key and client CA as gRPC's TLS, for HTTPS on the REST port."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if settings.tls_client_ca_file is not None:
        context.load_verify_locations(settings.tls_client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


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
    tokens = read_tokens(settings.admin_token_file) if settings.admin_token_file else {}
    control = ControlPlane(settings.enable_model_management, tokens, settings.tls_client_ca_file is not None,
                           settings.model_roots)
    registry = Registry()
    health = Health((tfs.SERVICE.full_name, tfs_model_service.SERVICE.full_name, v2.SERVICE.full_name))
    await health.set_serving(False)
    limit = ConcurrencyLimit(settings.max_concurrent_rpcs)
    decoder = BodyDecoder(max_waiting_bytes=MAX_WAITING * settings.max_message_bytes)
    logs = RequestLogs(registry, settings.request_log_file_bytes, settings.request_log_max_files)
    examples = ExampleCalls(ExampleMethods(settings.signature_method_name_check), decoder, settings.max_message_bytes)
    servicer = tfs.PredictionServicer(registry, settings.max_message_bytes, examples, logs,
                                      typed_outputs=not settings.tensor_content_outputs)
    announced = False
    # v2's ServerReady says what health says: every start-up model serves, and no drain has begun.
    def ready() -> bool:
        return not registry.starting and not stop.is_set()

    lifecycle: Lifecycle | None = None
    repository = Repository(registry, lambda: lifecycle, settings.model_repository, settings.model_control_mode)
    v2_servicer = v2.V2Servicer(registry, settings.max_message_bytes, ready, repository, lambda: control)
    rest_timeout_s = settings.rest_api_timeout_ms / 1000 if settings.rest_api_timeout_ms > 0 else None
    tfs_rest = rest_tfs.TfsRest(registry, settings.max_message_bytes, decoder, examples.methods, rest_timeout_s, logs)
    v2_rest = rest_v2.V2Rest(registry, settings.max_message_bytes, ready, decoder, repository, lambda: control,
                             rest_timeout_s)
    front_ends = (servicer, v2_servicer, tfs_rest, v2_rest)
    server = grpc.aio.server(options=grpc_options(settings))
    tfs.add_to_server(servicer, server, limit)
    v2.add_to_server(v2_servicer, server, limit)
    credentials = _server_credentials(settings)
    address = _grpc_address(settings.grpc_bind_address, settings.port)
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind gRPC port {settings.port}")
    rest_server: rest.RestServer | None = None
    rest_port = -1
    if settings.rest_api_port >= 0:
        rest_server = rest.RestServer(rest.build_app(tfs_rest.routes() + v2_rest.routes(),
                                                     settings.max_message_bytes, limit, metrics_paths))
        rest_port = await rest_server.start(settings.rest_bind_address, settings.rest_api_port,
                                            _rest_ssl_context(settings))
    metrics_port = -1
    if settings.metrics_port >= 0:
        http_server, _ = start_http_server(settings.metrics_port, addr=settings.rest_bind_address or "0.0.0.0")
        metrics_port = http_server.server_port

    exit_code = 0

    def worker_lost(why: str) -> None:
        nonlocal exit_code
        exit_code = 1
        log.error("stopping: the model worker process is gone (%s)", why)
        if not stop_requested_at:
            stop_requested_at.append(time.monotonic())
        stop.set()

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

    worker = ModelProcess(settings, on_traces=count_traces, on_lost=worker_lost)

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
        assert lifecycle is not None
        effective = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(settings).items())
        log.info(
            "serving model=%s version=%s signatures=%s path=%s grpc_port=%d rest_api_port=%d metrics_port=%d "
            "replicas=%d "
            "devices=%s %s tls=%s | settings: %s",
            *_describe(registry, lifecycle.configured), port, rest_port, metrics_port, len(started.devices),
            ",".join(started.devices), batching.describe(), settings.tls_mode, effective,
        )

    def models_changed() -> None:
        nonlocal announced
        logs.retire(registry)  # a model removed, or its logging_config gone: its writer stops
        if not announced and lifecycle is not None and lifecycle.every_model_available():
            announced = True
            tasks.append(loop.create_task(announce(), name="announce"))

    tfs_model_service.add_to_server(
        tfs_model_service.ModelServiceServicer(registry, lambda: lifecycle, lambda: control), server, limit)
    add_health_and_reflection(server, health)
    await server.start()
    log.info("listening grpc_port=%d rest_api_port=%d metrics_port=%d tls=%s; loading models (health NOT_SERVING)",
             port, rest_port, metrics_port, settings.tls_mode)
    try:
        started = await worker.start()
    except BaseException:
        worker.close()
        await server.stop(0)
        if rest_server is not None:
            await rest_server.stop()
        raise
    if sources is None:
        assert started.demo_base_path is not None
        sources = model_config.shorthand(started.demo_base_path, settings.model_name)
    if not settings.model_roots:
        control = control.with_roots(default_roots(sources) if settings.model_repository is None
                                     else (settings.model_repository,))
    if settings.enable_model_management:
        log.info("model management is on: tokens=%d mutual_tls=%s model_roots=%s", len(tokens),
                 settings.tls_client_ca_file is not None, ",".join(control.roots))
    lifecycle = Lifecycle(settings, worker, registry, len(started.devices), batching, on_change=models_changed,
                          may_serve_none=settings.model_repository is not None,
                          warm_up=Warmup(settings.warmup_iterations, settings.max_message_bytes, examples)
                          if settings.model_warmup else None)
    tasks.append(loop.create_task(lifecycle.poll_versions(), name="poll-versions"))
    problems = await lifecycle.apply(sources)
    if problems:
        log.warning("not serving yet (health NOT_SERVING); retrying: %s", "; ".join(problems))
    if settings.model_config_file is not None:
        tasks.append(loop.create_task(
            lifecycle.poll_config_file(settings.model_config_file, config_text), name="poll-config"))

    tasks.append(loop.create_task(loop_lag.watch(), name="loop-lag"))
    memory.trim_periodically()
    await stop.wait()
    for task in tasks:
        task.cancel()
    await health.start_drain()
    log.info("draining: health NOT_SERVING; still accepting for %gs", settings.drain_delay_s)
    await asyncio.sleep(settings.drain_delay_s)
    # Refuse in our own handlers first (a clean UNAVAILABLE) while the accepted requests finish;
    # grpc's own stop comes after, when nothing of ours is left in flight. Calls caught inside
    # grpc's queue at that instant are cancelled by grpc itself.
    for front_end in front_ends:
        front_end.refuse_new()
    deadline = stop_requested_at[0] + settings.grace_period_s - 0.5  # leave time to exit
    log.info("refusing new RPCs; finishing %d accepted", sum(f.in_flight for f in front_ends))
    while any(f.in_flight for f in front_ends) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    await server.stop(grace=max(deadline - time.monotonic(), 0.1))
    if rest_server is not None:
        await rest_server.stop()
    await lifecycle.drain()
    worker.close()
    decoder.close()
    await asyncio.to_thread(logs.close, 2.0)  # what is queued reaches the request logs
    accepted, answered = sum(f.accepted for f in front_ends), sum(f.answered for f in front_ends)
    log.log(logging.WARNING if accepted > answered else logging.INFO,
            "drained: accepted=%d answered=%d", accepted, answered)
    return exit_code


def _grpc_address(host: str, port: int) -> str:
    """grpc's address for a bind address (empty: every interface)."""
    if not host or host == "::":
        return f"[::]:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    logs.configure(settings.log_format, settings.log_level)
    try:
        return event_loop.run(serve(settings), settings.event_loop)
    except (FileNotFoundError, ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
