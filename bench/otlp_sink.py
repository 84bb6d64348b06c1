"""A collector that takes every export and keeps only a count: the other end of `--tracing otlp`
when its cost is measured. It answers OpenTelemetry's TraceService/Export without parsing the
request (an empty ExportTraceServiceResponse is zero bytes), so on a machine the server shares
with it, it takes as little CPU as a gRPC call can; a real collector runs elsewhere.

usage: python -m bench.otlp_sink PORT_FILE   (writes the port it listens on to PORT_FILE; runs
until killed, printing how many exports and bytes it took when it stops)
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class Sink:
    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def export(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            self.exports += 1
            self.bytes += len(request)
        return b""


def main(argv: list[str]) -> int:
    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(sink.export)  # raw bytes both ways: nothing parsed
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        EXPORT.split("/")[1], {EXPORT.split("/")[2]: handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(argv[0]).write_text(str(port))
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait()
    server.stop(0)
    print(f"exports taken: {sink.exports}, {sink.bytes:,} bytes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
