"""The picture of one trace in the README (docs/trace.png): a collector that keeps every span it
is sent (OpenTelemetry's TraceService/Export, from opentelemetry-proto; the tests receive with
it too), and a timeline of one request's spans beside the batch that served it.

usage: python -m bench.trace_picture [--model cnn] [--out docs/trace.png]
Starts the server on a bench model with `--tracing otlp`, sends 16 requests at once (one of
them with a caller's `traceparent`), and draws that request's trace: its span, its queue wait,
and the batch span linked to it and its model run, with the other requests the batch served beneath.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.launch import ROOT, start_server
from bench.run import SHAPES, build_models

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate: Callable[[Any], bool], timeout: float = 20.0) -> list[Any]:
        """The spans that match, once there is one (empty after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = [s for s in self.spans if predicate(s)]
            if found:
                return found
            time.sleep(0.1)
        return []


@contextlib.contextmanager
def receiving(receiver: Receiver | None = None) -> Iterator[tuple[Receiver, int]]:
    """A collector (`receiver`, or one that keeps every span) on a free loopback port: (it, the port)."""
    receiver = receiver or Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(0)


def render(spans: list[Any], trace_id: str, path: Path) -> None:
    """A timeline PNG of trace `trace_id`'s request span and queue span, the batch span linked to
    it and its model run, and the other requests that batch served, in milliseconds from the
    request's start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (request,) = [s for s in spans if s.trace_id.hex() == trace_id and s.kind == s.SPAN_KIND_SERVER]
    queue = [s for s in spans if s.name == "queue" and s.parent_span_id == request.span_id]
    batch = [s for s in spans if s.name == "batch" and any(link.span_id == request.span_id for link in s.links)]
    others = {link.span_id for b in batch for link in b.links} - {request.span_id}
    served = sorted((s for s in spans if s.span_id in others), key=lambda s: s.start_time_unix_nano)
    zero = request.start_time_unix_nano

    def ms(ns: int) -> float:
        return float(ns - zero) / 1e6

    rows: list[tuple[str, Any, str]] = [(f"{request.name}\n(trace {trace_id[:8]}…)", request, "#4c72b0")]
    rows += [("  queue (waiting for its batch)", q, "#dd8452") for q in queue]
    for b in batch:
        found = attributes(b)
        rows.append((f"batch: {found['mirrorserve.rows']} rows, {found['mirrorserve.requests']} requests, "
                     f"{found['mirrorserve.replicas']} replica(s)", b, "#55a868"))
        rows += [("  model run (in the worker)", s, "#8172b3") for s in spans
                 if s.name == "model run" and s.parent_span_id == b.span_id]
    rows += [(f"  linked request (trace {s.trace_id.hex()[:8]}…)", s, "#8c8c8c") for s in served]
    figure, axes = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    for y, (_, span, colour) in enumerate(rows):
        start, end = ms(span.start_time_unix_nano), ms(span.end_time_unix_nano)
        axes.barh(y, end - start, left=start, color=colour, height=0.6)
        axes.text(end, y, f" {end - start:.1f} ms", va="center", fontsize=8)
    axes.set_yticks(range(len(rows)), [label for label, _, _ in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("ms from the request's arrival")
    axes.set_title("One Predict's trace: its span, its queue wait, and the batch span linked to it", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def attributes(span: Any) -> dict[str, Any]:
    """A received span's attributes as a dict (the string or integer values our spans carry)."""
    return {kv.key: kv.value.string_value or kv.value.int_value for kv in span.attributes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "trace.png")
    opts = parser.parse_args(argv)
    from protos.tensorflow_serving import predict_pb2, prediction_service_pb2_grpc
    from server.api.tensor_codec import fill_tensor_proto

    base = build_models([opts.model], ROOT / "build" / "bench" / "models")[opts.model]
    name, shape = SHAPES[opts.model]
    with receiving() as (receiver, port), tempfile.TemporaryDirectory() as work:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_BSP_SCHEDULE_DELAY": "100"}  # over the caller's environment (start_server merges it)
        server = start_server(["--model-base-path", str(base), "--model-name", opts.model, "--tracing", "otlp",
                               "--drain-delay-s", "0"], Path(work) / "server.log", env, timeout=240)
        try:
            request = predict_pb2.PredictRequest()
            request.model_spec.name = opts.model
            fill_tensor_proto(request.inputs[name], np.ones(shape, np.float32))
            with grpc.insecure_channel(server.target) as channel, futures.ThreadPoolExecutor(16) as pool:
                stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
                stub.Predict(request, timeout=60)  # warm
                caller = (("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"),)
                list(pool.map(lambda i: stub.Predict(request, timeout=60, metadata=caller if i == 8 else ()),
                              range(16)))
            if not receiver.wait_for(lambda s: s.name == "batch" and len(s.links) > 1):
                raise RuntimeError("no batch span served several requests")
            time.sleep(0.5)  # the rest of the batch's requests
            with receiver.lock:
                render(list(receiver.spans), CALLER_TRACE, opts.out)
        finally:
            server.stop()
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
