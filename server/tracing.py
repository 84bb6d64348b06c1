"""OpenTelemetry traces (--tracing otlp): a span per request, a span per model run linked to every
request it served. Off by default, and then nothing here runs on a request (`ENABLED` is False).

Configured as OpenTelemetry users expect: the SDK reads its own environment variables
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG, OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*); spans leave through the SDK's BatchSpanProcessor and OTLP
gRPC exporter, off the request path. Spans are dropped, never waited for, when the exporter fails
(a collector down or refusing: reason export_failed) or while it is stuck and the processor's
queue (OTEL_BSP_MAX_QUEUE_SIZE) is full (a collector slow or down: reason queue_full); both are
counted in mirrorserve_trace_spans_dropped_total{reason}, and the SDK's own warnings about them,
one a span or an attempt, are let through at most once a minute.

The caller's W3C `traceparent` (and `tracestate`), in gRPC metadata or HTTP headers, makes the
request's span its child; without one the sampler decides. Our handlers take raw bytes, so the
gRPC and aiohttp instrumentations (which wrap generated servicers and aiohttp's own handlers)
do not fit them: the context is extracted with the API's propagator instead. The model worker
needs no OpenTelemetry: a batch's span is recorded here from the times the batcher kept.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from server import metrics

log = logging.getLogger("server.tracing")

ENABLED = False
"""Set once per process by `configure`; every hook checks it first."""
_tracer: Any = None
_propagated: frozenset[str] = frozenset()
"""The headers the configured propagators read (OTEL_PROPAGATORS; traceparent, tracestate, baggage)."""
LOG_EVERY_S = 60.0


def configure(kind: str) -> None:
    """Set this process's tracer provider for --tracing KIND (off: nothing)."""
    global ENABLED, _tracer, _propagated
    if kind != "otlp" or ENABLED:
        return
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, as the SDK reads them
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "mirrorserve"}))  # unless the user named it
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(_Counted(OTLPSpanExporter())))  # type: ignore[arg-type]
    for name in (QUEUE_LOGGER, EXPORTER_LOGGER):
        logging.getLogger(name).addFilter(_SdkWarnings())
    for reason in ("export_failed", "queue_full"):  # both series from the start, at 0: alerts see a rise
        metrics.TRACE_SPANS_DROPPED.labels(reason)
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("mirrorserve")
    from opentelemetry.propagate import get_global_textmap

    _propagated = frozenset(get_global_textmap().fields)  # a set built anew on every read
    # Every log record gets the current trace and span ids (otelTraceID, otelSpanID; server.logs
    # names them trace_id and span_id in JSON lines); the format of text lines is left alone.
    from opentelemetry.instrumentation.logging import LoggingInstrumentor

    LoggingInstrumentor().instrument(inject_trace_context=True, enable_log_auto_instrumentation=False)
    ENABLED = True


QUEUE_LOGGER = "opentelemetry.sdk._shared_internal"
"""Where the BatchSpanProcessor says "Queue full, dropping Span." for each span it drops (the SDK
counts them only in its own metrics pipeline, which this server does not run)."""
EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"
"""Where the OTLP exporter says, each attempt, that it failed or will retry."""


class _SdkWarnings(logging.Filter):
    """Counts the spans the processor's full queue drops, and lets the SDK's warnings through at
    most once a LOG_EVERY_S per logger: a collector that is down must not flood the log."""

    def __init__(self) -> None:
        super().__init__()
        self._logged = -LOG_EVERY_S

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == QUEUE_LOGGER and str(record.msg).startswith("Queue full"):
            metrics.TRACE_SPANS_DROPPED.labels("queue_full").inc()
        now = time.monotonic()
        if now - self._logged < LOG_EVERY_S:
            return False
        self._logged = now
        return True


class _Counted:
    """The exporter, counting the spans of every batch it fails to send (and saying so, rarely)."""

    def __init__(self, exporter: Any) -> None:
        self._exporter = exporter
        self._logged = -LOG_EVERY_S

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self._exporter.export(spans)
        except Exception as exc:  # an exporter must never take the server down
            result, why = SpanExportResult.FAILURE, repr(exc)
        else:
            why = "the collector did not take them"
        if result is not SpanExportResult.SUCCESS:
            metrics.TRACE_SPANS_DROPPED.labels("export_failed").inc(len(spans))
            now = time.monotonic()
            if now - self._logged >= LOG_EVERY_S:
                self._logged = now
                log.warning("dropped %d spans: %s (counted in mirrorserve_trace_spans_dropped_total)", len(spans),
                            why)
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self._exporter.force_flush(timeout_millis))


def start_request(name: str, carrier: Iterable[tuple[str, Any]], protocol: str) -> Any:
    """The span of a request, a child of the caller's `traceparent` if it sent one: `name` is
    SERVICE/METHOD over gRPC, "VERB ROUTE" over HTTP (OpenTelemetry's span names for each). The
    propagator runs only when a header it reads (its `fields`) is there: most requests carry none."""
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    # gRPC metadata keys are lower case already (HTTP/2); HTTP/1.1 header names may come in any case
    headers = dict(carrier) if protocol == "grpc" else {key.lower(): value for key, value in carrier}
    parent = extract(headers) if not _propagated.isdisjoint(headers) else None
    if protocol == "grpc":
        service, _, method = name.rpartition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
    else:
        verb, _, route = name.partition(" ")
        attributes = {"network.protocol.name": "http", "http.request.method": verb, "http.route": route}
    return _tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)


def trace_id(span: Any) -> str:
    """The trace id to tell the client: "" for a span the sampler dropped (no trace to find)."""
    return f"{span.get_span_context().trace_id:032x}" if span.is_recording() else ""


def finish_request(span: Any, code_name: str, model: str, version: int | None, signature: str, rows: int | None,
                   queue: tuple[float, float] | None, message: str = "") -> None:
    """End a request's span: its model, version, signature, rows and status code; an error or a
    refusal as the span's status; its queue wait as a child span (perf_counter seconds)."""
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    if not span.is_recording():  # the sampler dropped it: nothing to add, nothing to end
        return
    attributes: dict[str, Any] = {}
    if model:
        attributes["mirrorserve.model"] = model
    if rows is not None:
        attributes["mirrorserve.rows"] = rows
    if version is not None:
        attributes["mirrorserve.version"] = version
    if signature:
        attributes["mirrorserve.signature"] = signature
    if code_name.startswith("HTTP_"):
        attributes["http.response.status_code"] = int(code_name[5:])
    else:
        attributes["rpc.grpc.status_code"] = code_name
    span.set_attributes(attributes)  # at once: one lock, not one an attribute
    if queue is not None:
        start, end = (_epoch_ns(t, time.perf_counter) for t in queue)
        child = _tracer.start_span("queue", context=trace.set_span_in_context(span), start_time=start)
        child.end(end_time=end)
    if code_name not in ("OK", "HTTP_200"):
        span.set_status(Status(StatusCode.ERROR, f"{code_name}: {message}"[:500]))
    span.end()


def batch_recorder(model: str, version: int, replicas: int) -> Callable[
        [Hashable, list[Any], int, float, float, Any], None]:
    """What a batcher calls when a batch ends (server.core.batcher.BatchTrace): a span for the
    round trip, from handing the batch to the model worker to having its outputs back and split,
    linked to the spans of the requests it served (a batch serves many traces: links are
    OpenTelemetry's way), and its `model run` child, placed by the worker's own timings: after
    the hand-over, for as long as the model ran. A batch that served no traced request records
    nothing."""
    from opentelemetry import trace
    from opentelemetry.trace import Link

    def record(key: Hashable, contexts: list[Any], rows: int, handed: float, returned: float, timing: Any) -> None:
        # a split request is linked once (current_context gave None for one its sampler dropped)
        unique = {(c.trace_id, c.span_id): c for c in contexts if c is not None}
        links = [Link(context) for context in unique.values()]
        if not links:
            return
        start, end = _epoch_ns(handed, time.monotonic), _epoch_ns(returned, time.monotonic)
        span = _tracer.start_span("batch", links=links, start_time=start, attributes={
            "mirrorserve.model": model, "mirrorserve.version": version,
            "mirrorserve.signature": str(getattr(key, "signature", key)), "mirrorserve.rows": rows,
            "mirrorserve.requests": len(contexts), "mirrorserve.replicas": replicas,
            "mirrorserve.rows_per_replica": -(-rows // max(replicas, 1)),
            "mirrorserve.handed_unix_nano": start, "mirrorserve.returned_unix_nano": end,
            "mirrorserve.input_seconds": timing.input_seconds, "mirrorserve.output_seconds": timing.output_seconds})
        ran_from = start + int(timing.input_seconds * 1e9)
        run = _tracer.start_span("model run", context=trace.set_span_in_context(span), start_time=ran_from,
                                 attributes={"mirrorserve.rows": rows, "mirrorserve.replicas": replicas})
        run.end(end_time=min(end, ran_from + int(timing.infer_seconds * 1e9)))
        span.end(end_time=end)

    return record


def current(span: Any) -> contextlib.AbstractContextManager[Any]:
    """The request's span as the current one while its handler runs (its task's context, through
    the API's use_span), so the batcher can link the batch to it and log lines name it; a span
    the sampler dropped has nothing to link or log, and is not made current."""
    from opentelemetry import trace

    if not span.is_recording():
        return contextlib.nullcontext()
    return trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)


def current_context() -> Any:
    """The running request's span context (set by the protocol's hook), for the batcher to link."""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return context if context.trace_flags.sampled else None


def _epoch_ns(at: float, clock: Callable[[], float]) -> int:
    """A time on `clock` (seconds) as nanoseconds since the epoch, for a span's start or end."""
    return time.time_ns() - int((clock() - at) * 1e9)
