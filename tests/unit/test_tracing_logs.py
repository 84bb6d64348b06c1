"""With --tracing, a JSON log line carries the trace and span it was logged in (OpenTelemetry's
logging instrumentation, named trace_id and span_id by server.logs), and the service is named by
OTEL_SERVICE_NAME when set ("mirrorserve" otherwise). Run in a child process: the tracer provider
and the log record factory are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import io, logging
from server import logs, tracing
logs.configure("json", "INFO")
stream = io.StringIO()
logging.getLogger().handlers[0].stream = stream
tracing.configure("otlp")
span = tracing.start_request("svc/M", [("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")],
                             "grpc")
with tracing.current(span):
    logging.getLogger("x").warning("inside")
logging.getLogger("x").warning("outside")
print(stream.getvalue())
"""


def lines(**env: str) -> list[dict[str, object]]:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", **env}, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_json_lines_carry_the_trace_and_span_they_were_logged_in() -> None:
    inside, outside = lines()
    assert inside["message"] == "inside" and inside["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert len(str(inside["span_id"])) == 16 and inside["span_id"] != "0"
    assert outside["trace_id"] == "0" and inside["service_name"] == "mirrorserve"
    assert lines(OTEL_SERVICE_NAME="ranker-serving")[0]["service_name"] == "ranker-serving"
