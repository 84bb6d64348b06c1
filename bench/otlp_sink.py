"""A collector that takes every span and keeps only a count: the other end of `--tracing otlp` when
its cost is measured (OpenTelemetry's own TraceService/Export, from opentelemetry-proto).

usage: python -m bench.otlp_sink PORT_FILE   (writes the port it listens on to PORT_FILE; runs
until killed, printing how many spans it took when it stops)
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        taken = sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
        with self._lock:
            self.spans += taken
        return trace_service_pb2.ExportTraceServiceResponse()


def main(argv: list[str]) -> int:
    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(argv[0]).write_text(str(port))
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait()
    server.stop(0)
    print(f"spans taken: {sink.spans}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
