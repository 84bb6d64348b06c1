"""Logging set-up: text for people, JSON (python-json-logger) for log pipelines."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            # with --tracing, the trace and span a line was logged in (server.tracing)
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger", "otelTraceID": "trace_id",
                           "otelSpanID": "span_id", "otelServiceName": "service_name",
                           "otelTraceSampled": "trace_sampled"},
        ))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
