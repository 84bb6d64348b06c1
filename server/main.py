"""Composition root: settings -> devices -> model -> replicas -> batcher -> servicer -> grpc.aio.

TensorFlow-touching steps run in a fixed order: logical devices must be configured before
anything (the demo model build included) initialises the runtime.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client import start_http_server

from protos.tensorflow_serving import prediction_service_pb2_grpc
from server import metrics
from server.assembly import Tensors
from server.batcher import Batcher
from server.config import Settings, parse_settings
from server.prediction import Predictor
from server.servicer import PredictionServicer
from server.signatures import BatchKey

log = logging.getLogger("server")


def _grpc_options(settings: Settings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
    ]


async def serve(settings: Settings) -> None:
    # Imported here: these pull in TensorFlow, and --help should not.
    from server import demo_model, model, replicas

    devices = replicas.configure_devices(settings.replicas)
    base_path = settings.model_base_path or str(demo_model.ensure_demo_model())
    strategy = replicas.make_strategy(devices)
    loaded = model.load(base_path, settings.model_name, strategy)
    info = loaded.info
    for name, problem in info.unservable.items():
        log.warning("signature '%s' will not be served: %s", name, problem)

    replica_rows = [metrics.REPLICA_ROWS.labels(info.name, str(i)) for i in range(len(devices))]
    runners = {
        name: replicas.SignatureRunner(
            strategy, loaded.functions[name], signature,
            on_trace=metrics.TRACES.labels(info.name, name).inc,
            on_replica_rows=lambda replica, rows: replica_rows[replica].inc(rows),
        )
        for name, signature in info.signatures.items()
        if name not in info.unservable
    }
    for runner in runners.values():
        runner.warm_up()

    batch_rows = metrics.BATCH_ROWS.labels(info.name)

    def run_batch(key: object, batch: Tensors) -> Tensors:
        assert isinstance(key, BatchKey)
        batch_rows.observe(next(iter(batch.values())).shape[0])
        return runners[key.signature](batch)

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    batcher = Batcher(
        run_batch, executor,
        max_batch_rows=settings.max_batch_size,
        timeout_s=settings.batch_timeout_s,
        max_queued_rows=settings.max_queued_rows,
    )
    batcher.start()
    predictor = Predictor(info, batcher)

    server = grpc.aio.server(options=_grpc_options(settings))
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionServicer(predictor, settings.max_message_bytes, loaded.signature_defs), server
    )
    port = server.add_insecure_port(f"[::]:{settings.port}")
    if port == 0:
        raise OSError(f"could not bind gRPC port {settings.port}")
    metrics_port = -1
    if settings.metrics_port >= 0:
        http_server, _ = start_http_server(settings.metrics_port)
        metrics_port = http_server.server_port
    await server.start()
    log.info(
        "serving model=%s version=%d signatures=%s path=%s grpc_port=%d metrics_port=%d replicas=%d "
        "devices=%s max_batch_size=%d batch_timeout_ms=%g max_queued_rows=%d",
        info.name, info.version, ",".join(sorted(runners)), loaded.path, port, metrics_port,
        len(devices), ",".join(devices), settings.max_batch_size, settings.batch_timeout_ms,
        settings.max_queued_rows,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: finishing accepted requests")
    await server.stop(grace=10)
    await batcher.drain()
    executor.shutdown(wait=True)
    log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        asyncio.run(serve(settings))
    except (FileNotFoundError, ValueError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    return 0
