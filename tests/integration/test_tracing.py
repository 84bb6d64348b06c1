"""OpenTelemetry traces (--tracing otlp) received by a real OTLP receiver: a gRPC server of
OpenTelemetry's own TraceService/Export (the opentelemetry-proto package), which gets what the
server's exporter sends. A Predict with a W3C traceparent gives a request span under that parent,
its queue span, and a batch span linked to it; concurrent requests that share batches give batch
spans whose links cover every request exactly once; the trace id comes back in a trailer."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from bench.trace_picture import Receiver, attributes, receiving, render
from protos.tensorflow_serving import predict_pb2, prediction_service_pb2_grpc
from server.api.tensor_codec import fill_tensor_proto
from tests.integration.conftest import start_server
from tests.integration.test_official_client import HERE, official_client_path

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
CONCURRENT = 32


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    with receiving() as found:
        yield found


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

            # TF Serving's own client, its answer read as its examples read it (.float_val)
            official = subprocess.run(
                [sys.executable, str(HERE / "official_traced_client.py"), server.target, "demo",
                 f"00-{TRACE_ID}-{PARENT_ID}-01"], env={**os.environ, "PYTHONPATH": official_client_path(),
                                                        "TF_CPP_MIN_LOG_LEVEL": "2"},
                capture_output=True, text=True, timeout=300, check=True)
            told = json.loads(official.stdout.strip().splitlines()[-1])
            assert told["trailers"]["mirrorserve-trace-id"] == TRACE_ID
            assert len(told["outputs"]["probabilities"]) == 2 * 3, told  # 2 rows of 3 classes
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
            # the worker's own timing places the model's run inside the round trip
            (run,) = collector.wait_for(lambda s: s.name == "model run" and s.parent_span_id == batch.span_id)
            assert batch.start_time_unix_nano <= run.start_time_unix_nano <= run.end_time_unix_nano \
                <= batch.end_time_unix_nano
            assert run.trace_id == batch.trace_id and attributes(run)["mirrorserve.rows"] == 2

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
            # the README's picture, drawn from what was received
            render(collector.spans, TRACE_ID, tmp_path / "trace.png")
            assert (tmp_path / "trace.png").read_bytes().startswith(b"\x89PNG")

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
            assert found["network.protocol.name"] == "http"
            assert found["mirrorserve.model"] == "demo" and found["http.response.status_code"] == 200
            assert collector.wait_for(lambda s, span=span: s.name == "batch" and any(
                link.span_id == span.span_id for link in s.links))

        # a control call has its span too: here refused (model management is off), as its status
        parent = "00000000000c0de1"
        sent = urllib.request.Request(f"{server.rest_url}/v2/repository/models/demo/load", data=b"{}",
                                      headers={"traceparent": f"00-{TRACE_ID}-{parent}-01"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(sent, timeout=30)
        (span,) = collector.wait_for(lambda s: s.parent_span_id.hex() == parent)
        assert span.name.startswith("POST /v2/repository/models/") and span.name.endswith("/load")
        assert attributes(span)["http.response.status_code"] == refused.value.code
        assert span.status.code == span.status.STATUS_CODE_ERROR and str(refused.value.code) in span.status.message
    finally:
        server.stop()


class Misbehaving(Receiver):
    """A collector that is slow (answers after 3 s, past the exporter's 1 s timeout) or refusing
    (PERMISSION_DENIED, which the exporter does not retry)."""

    mode = "slow"

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        if self.mode == "slow":
            time.sleep(3)
            return super().Export(request, context)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "this collector refuses everything")


PHASE = 340
"""Requests a side in each of the three phases: about 1,000 in all."""


def test_a_collector_slow_refusing_or_down_fails_nothing_and_its_spans_are_counted(model_dirs: dict[str, Path],
                                                                                   tmp_path: Path) -> None:
    """Traces to a collector that is slow, then refusing, then down (its port closed), against the
    same server untraced, in turns of 85 requests: every request is answered OK and, in each
    phase, no slower than untraced beyond noise; the spans the exporter could not send
    (export_failed) and those its full queue dropped meanwhile (queue_full: a queue of 64 here)
    are counted, and the SDK's warnings about them, one a span or an attempt, reach the log at
    most once a minute each."""
    collector = Misbehaving()
    with contextlib.ExitStack() as stack:
        collecting = contextlib.ExitStack()
        stack.callback(collecting.close)
        _, port = collecting.enter_context(receiving(collector))
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
               "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100",
               "OTEL_EXPORTER_OTLP_TIMEOUT": "1", "OTEL_BSP_MAX_QUEUE_SIZE": "64",
               "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "32"}
        flags = ["--model-base-path", str(model_dirs["demo"]), "--model-name", "demo", "--drain-delay-s", "0"]
        traced = start_server([*flags, "--tracing", "otlp"], tmp_path / "traced.log", env)
        stack.callback(traced.stop)
        plain = start_server(flags, tmp_path / "plain.log")
        stack.callback(plain.stop)
        pool = stack.enter_context(futures.ThreadPoolExecutor(8))
        stubs = {side: prediction_service_pb2_grpc.PredictionServiceStub(
            stack.enter_context(grpc.insecure_channel(server.target))) for side, server in
            (("traced", traced), ("plain", plain))}
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "demo"
        fill_tensor_proto(request.inputs["x"], np.ones((1, 8), np.float32))

        def timed(side: str) -> float:
            started = time.perf_counter()
            stubs[side].Predict(request, timeout=30)  # raises unless OK
            return time.perf_counter() - started

        def dropped(reason: str) -> float:
            return traced.metric("mirrorserve_trace_spans_dropped_total", reason=reason)

        def phase(name: str, counted: str) -> None:
            before = dropped(counted)
            seconds: dict[str, list[float]] = {"traced": [], "plain": []}
            for turn in range(2 * PHASE // 85):
                side = ("traced", "plain")[turn % 2]
                seconds[side] += pool.map(lambda _, side=side: timed(side), range(85))
            assert len(seconds["traced"]) == len(seconds["plain"]) == PHASE
            p50 = {side: float(np.median(found)) for side, found in seconds.items()}
            print(f"collector {name}: p50 {p50['traced'] * 1e3:.2f} ms, untraced {p50['plain'] * 1e3:.2f} ms")
            assert p50["traced"] <= 1.5 * p50["plain"] + 0.002, (name, p50)  # not the exporter's 1 s
            deadline = time.monotonic() + 30
            while dropped(counted) == before and time.monotonic() < deadline:
                time.sleep(0.2)
            assert dropped(counted) > before, (name, counted)

        phase("slow", "queue_full")  # the exporter waits on it while spans queue
        collector.mode = "refusing"
        phase("refusing", "export_failed")
        collecting.close()
        phase("down", "export_failed")
        log = traced.log()
        assert log.count("Queue full") == 1, "the queue's warning, once a minute"
        assert log.count("mirrorserve_trace_spans_dropped_total") == 1, "failed exports said once a minute"
