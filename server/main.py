"""Composition root and lifecycle.

Start: the gRPC port opens first, with health NOT_SERVING and Predict answering UNAVAILABLE, so
probes see the truth while TensorFlow loads. TensorFlow runs in a child process (server.model_worker:
devices, the model under the strategy's scope, one runner per signature, warm-up); when it says
ready, the batcher starts, health turns SERVING, and one start-up line is logged. If the worker
dies, the server drains and exits 1, so the orchestrator restarts both.

Stop (SIGTERM or SIGINT), in the order of architecture.md, example 9: health NOT_SERVING while
still accepting for --drain-delay-s; then refuse new RPCs and finish every accepted one (queued
and in flight); exit 0 within --grace-period-s of the signal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
import time
from collections.abc import Hashable, Sequence

import grpc
from prometheus_client import start_http_server
from tensorflow.core.protobuf import meta_graph_pb2

from server import event_loop, logs, metrics
from server.assembly import Tensors, replica_bounds
from server.batcher import Batcher
from server.config import Settings, parse_settings
from server.health import Health, add_health_and_reflection
from server.model_process import ModelProcess
from server.prediction import Predictor
from server.servicer import PredictionServicer, add_to_server
from server.signatures import BatchKey

log = logging.getLogger("server")


def _server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
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


def _grpc_options(settings: Settings) -> list[tuple[str, int]]:
    options = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
    ]
    if settings.grpc_max_connection_age_ms:
        options += [
            ("grpc.max_connection_age_ms", settings.grpc_max_connection_age_ms),
            ("grpc.max_connection_age_grace_ms", settings.grpc_max_connection_age_grace_ms),
        ]
    return options


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

    health = Health()
    await health.set_serving(False)
    servicer = PredictionServicer(settings.model_name, settings.max_message_bytes)
    server = grpc.aio.server(options=_grpc_options(settings), maximum_concurrent_rpcs=settings.max_concurrent_rpcs)
    add_to_server(servicer, server)
    add_health_and_reflection(server, health)
    credentials = _server_credentials(settings)
    address = f"[::]:{settings.port}"
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind gRPC port {settings.port}")
    metrics_port = -1
    if settings.metrics_port >= 0:
        http_server, _ = start_http_server(settings.metrics_port)
        metrics_port = http_server.server_port
    await server.start()
    log.info("listening grpc_port=%d metrics_port=%d tls=%s; loading model (health NOT_SERVING)",
             port, metrics_port, settings.tls_mode)

    exit_code = 0
    traces_seen: dict[str, int] = {}

    def count_traces(traces: dict[str, int]) -> None:
        for name, total in traces.items():
            if total > traces_seen.get(name, 0):
                metrics.TRACES.labels(settings.model_name, name).inc(total - traces_seen.get(name, 0))
                traces_seen[name] = total

    def worker_lost(why: str) -> None:
        nonlocal exit_code
        exit_code = 1
        log.error("stopping: the model worker process is gone (%s)", why)
        if not stop_requested_at:
            stop_requested_at.append(time.monotonic())
        stop.set()

    worker = ModelProcess(settings, on_traces=count_traces, on_lost=worker_lost)
    try:
        ready = await worker.start()
    except BaseException:
        worker.close()
        await server.stop(0)
        raise
    info = ready.info
    count_traces(ready.traces)
    signature_defs = {k: meta_graph_pb2.SignatureDef.FromString(v) for k, v in ready.signature_defs.items()}
    served = sorted(set(info.signatures) - set(info.unservable))
    ready_gauge = metrics.MODEL_READY.labels(info.name, str(info.version))
    replica_rows = [metrics.REPLICA_ROWS.labels(info.name, str(i)) for i in range(len(ready.devices))]

    async def run_batch(key: Hashable, parts: Sequence[Tensors]) -> tuple[Tensors, float]:
        assert isinstance(key, BatchKey)
        answer = await worker.run(key.signature, parts)
        rows = sum(next(iter(part.values())).shape[0] for part in parts)
        for counter, (lo, hi) in zip(replica_rows, replica_bounds(rows, len(replica_rows)), strict=True):
            counter.inc(hi - lo)
        return answer

    batcher = Batcher(
        run_batch,
        max_batch_rows=settings.max_batch_size,
        timeout_s=settings.batch_timeout_s,
        max_auto_wait_s=settings.max_auto_wait_s,
        max_queued_rows=settings.max_queued_rows,
        max_inflight=settings.max_inflight_batches,
        observer=metrics.BatcherMetrics(info.name),
    )
    # Loading TensorFlow and the model leaves ~270k Python objects; one full garbage collection over
    # them stalls the event loop for ~160 ms here. Collect once now and freeze the survivors out of
    # every later collection, so no request pays for that pause.
    gc.collect()
    gc.freeze()
    batcher.start()
    metrics.QUEUE_ROWS_LIMIT.labels(info.name).set(settings.max_queued_rows)
    servicer.ready(Predictor(info, batcher), signature_defs)
    if not stop.is_set():
        await health.set_serving(True)
        ready_gauge.set(1)
    effective = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(settings).items())
    log.info(
        "serving model=%s version=%d signatures=%s path=%s grpc_port=%d metrics_port=%d replicas=%d "
        "devices=%s max_batch_size=%d batch_timeout_ms=%g max_queued_rows=%d tls=%s | settings: %s",
        info.name, info.version, ",".join(served), ready.path, port, metrics_port,
        len(ready.devices), ",".join(ready.devices), settings.max_batch_size, settings.batch_timeout_ms,
        settings.max_queued_rows, settings.tls_mode, effective,
    )

    await stop.wait()
    await health.start_drain()
    ready_gauge.set(0)
    log.info("draining: health NOT_SERVING; still accepting for %gs", settings.drain_delay_s)
    await asyncio.sleep(settings.drain_delay_s)
    # Refuse in our own handlers first (a clean UNAVAILABLE) while the accepted requests finish;
    # grpc's own stop comes after, when nothing of ours is left in flight. Calls caught inside
    # grpc's queue at that instant are cancelled by grpc itself.
    servicer.refuse_new()
    deadline = stop_requested_at[0] + settings.grace_period_s - 0.5  # leave time to exit
    log.info("refusing new RPCs; finishing %d accepted", servicer.in_flight)
    while servicer.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    await server.stop(grace=max(deadline - time.monotonic(), 0.1))
    await batcher.drain()
    worker.close()
    lost = servicer.accepted - servicer.answered
    log.log(logging.WARNING if lost else logging.INFO,
            "drained: accepted=%d answered=%d", servicer.accepted, servicer.answered)
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    logs.configure(settings.log_format, settings.log_level)
    try:
        return event_loop.run(serve(settings), settings.event_loop)
    except (FileNotFoundError, ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
