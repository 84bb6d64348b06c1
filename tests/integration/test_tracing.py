"""OpenTelemetry traces (--tracing otlp) received by a real OTLP receiver: a gRPC server of
OpenTelemetry's own TraceService/Export (the opentelemetry-proto package), which gets what the
server's exporter sends. A Predict with a W3C traceparent gives a request span under that parent,
its queue span, and a batch span linked to it; concurrent requests that share batches give batch
spans whose links cover every request exactly once; the trace id comes back in a trailer."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from protos.tensorflow_serving import predict_pb2, prediction_service_pb2_grpc
from server.api.tensor_codec import fill_tensor_proto
from tests.integration.conftest import start_server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
CONCURRENT = 32


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext) -> \
            trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout: float = 20.0) -> list:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = [s for s in self.spans if predicate(s)]
            if found:
                return found
            time.sleep(0.1)
        return []


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(0)


def attributes(span) -> dict:  # type: ignore[no-untyped-def]
    found = {}
    for kv in span.attributes:
        value = kv.value
        found[kv.key] = value.string_value or value.int_value
    return found


def test_predict_spans_under_the_callers_parent_and_batches_linked_once(
        model_dirs: dict[str, Path], tmp_path: Path, receiver: tuple[Receiver, int]) -> None:
    collector, port = receiver
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": "traced-test"}
    server = start_server(["--model-base-path", str(model_dirs["demo"]), "--model-name", "demo", "--tracing", "otlp",
                           "--batch-timeout-ms", "20", "--drain-delay-s", "0"], tmp_path / "server.log", env)
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)

            def predict(rows: int, metadata: tuple = ()) -> tuple:  # type: ignore[type-arg]
                request = predict_pb2.PredictRequest()
                request.model_spec.name = "demo"
                fill_tensor_proto(request.inputs["x"], np.ones((rows, 8), np.float32))
                _, call = stub.Predict.with_call(request, timeout=30, metadata=metadata)
                return call.trailing_metadata()

            told = dict(predict(2, (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)))
            assert told["mirrorserve-trace-id"] == TRACE_ID
            (request_span,) = collector.wait_for(lambda s: s.trace_id.hex() == TRACE_ID and s.name.endswith("/Predict"))
            assert request_span.parent_span_id.hex() == PARENT_ID
            assert request_span.name == "tensorflow.serving.PredictionService/Predict"
            found = attributes(request_span)
            assert found["rpc.system"] == "grpc" and found["rpc.method"] == "Predict"
            assert found["mirrorserve.model"] == "demo" and found["mirrorserve.version"] == 1
            assert found["mirrorserve.rows"] == 2 and found["rpc.grpc.status_code"] == "OK"
            assert found["mirrorserve.signature"] == "serving_default"
            (queue,) = collector.wait_for(lambda s: s.name == "queue" and s.parent_span_id == request_span.span_id)
            assert request_span.start_time_unix_nano <= queue.start_time_unix_nano <= queue.end_time_unix_nano \
                <= request_span.end_time_unix_nano
            (batch,) = collector.wait_for(lambda s: s.name == "batch" and any(
                link.span_id == request_span.span_id for link in s.links))
            assert attributes(batch)["mirrorserve.rows"] == 2 and attributes(batch)["mirrorserve.replicas"] >= 1

            # 32 at once: every request's span is linked from exactly one batch span
            with futures.ThreadPoolExecutor(CONCURRENT) as pool:
                ids = [dict(t)["mirrorserve-trace-id"] for t in pool.map(lambda _: predict(1), range(CONCURRENT))]
            assert len(set(ids)) == CONCURRENT  # no parent: the sampler started a trace each
            spans = collector.wait_for(lambda s: s.trace_id.hex() in ids and s.name.endswith("/Predict"))
            deadline = time.monotonic() + 20
            while len(spans) < CONCURRENT and time.monotonic() < deadline:
                time.sleep(0.1)
                spans = collector.wait_for(lambda s: s.trace_id.hex() in ids and s.name.endswith("/Predict"))
            assert len(spans) == CONCURRENT
            wanted = {s.span_id for s in spans}
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                with collector.lock:
                    linked = [link.span_id for s in collector.spans if s.name == "batch" for link in s.links
                              if link.span_id in wanted]
                if len(set(linked)) == CONCURRENT:
                    break
                time.sleep(0.1)
            assert sorted(linked) == sorted(wanted), "each request linked from exactly one batch"
            with collector.lock:
                shared = [s for s in collector.spans if s.name == "batch" and len(s.links) > 1]
            assert shared, "some batches served several requests"

        # REST, TF Serving's and v2's: the same request span under the caller's parent, and a batch
        for path, body in (("/v1/models/demo:predict", {"instances": [[1.0] * 8]}),
                           ("/v2/models/demo/infer", {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32",
                                                                  "data": [1.0] * 8}]})):
            parent = f"{hash(path) & 0xFFFFFFFFFFFFFFFF:016x}"
            sent = urllib.request.Request(f"{server.rest_url}{path}", data=json.dumps(body).encode(),
                                          headers={"traceparent": f"00-{TRACE_ID}-{parent}-01"})
            with urllib.request.urlopen(sent, timeout=30) as answer:
                assert answer.headers["mirrorserve-trace-id"] == TRACE_ID
            (span,) = collector.wait_for(lambda s, parent=parent: s.parent_span_id.hex() == parent)
            found = attributes(span)
            assert span.name.startswith("POST /v") and found["http.request.method"] == "POST"
            assert found["mirrorserve.model"] == "demo" and found["http.response.status_code"] == 200
            assert collector.wait_for(lambda s, span=span: s.name == "batch" and any(
                link.span_id == span.span_id for link in s.links))
    finally:
        server.stop()


def test_a_collector_that_is_down_fails_nothing_and_its_spans_are_counted(model_dirs: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """Traces to a port nobody listens on: every request is answered OK, and the spans the exporter
    could not send are counted (mirrorserve_trace_spans_dropped_total) and said once in the log."""
    import socket

    with socket.socket() as probe:  # a free port, closed again: connections to it are refused
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead}",
           "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
    server = start_server(["--model-base-path", str(model_dirs["demo"]), "--model-name", "demo", "--tracing", "otlp",
                           "--drain-delay-s", "0"], tmp_path / "server.log", env)
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            request = predict_pb2.PredictRequest()
            request.model_spec.name = "demo"
            fill_tensor_proto(request.inputs["x"], np.ones((1, 8), np.float32))
            with futures.ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda _: stub.Predict(request, timeout=30), range(300)))
            assert len(answers) == 300
        deadline = time.monotonic() + 30
        while server.metric("mirrorserve_trace_spans_dropped_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert server.metric("mirrorserve_trace_spans_dropped_total") > 0
        assert server.log().count("dropped") >= 1 and "mirrorserve_trace_spans_dropped_total" in server.log()
    finally:
        server.stop()
