"""Prometheus metrics, declared once at import, so every series exists from the start.

Names carry base units, histograms have explicit buckets (aggregatable across pods, unlike
summaries), and label sets are small and bounded: protocol, model and version (only configured models; a
request for an unknown one counts under model=""), method, code, replica, reason, signature. The
gauges of a version are removed when it is unloaded, so none lingers for versions long gone.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.core import Metric

if TYPE_CHECKING:  # plain data only: the metrics stay importable from anywhere
    from collections.abc import Hashable

    from server.core.batcher import Answer, BatchTiming
    from server.core.latency_target import Plan
    from server.core.statistics import VersionStatistics

MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
"""Several front-end processes (--frontends): each process writes its values to files in that
folder (server.metrics_dir), and a scrape of any of them reads them all (page_registry). Counters
and histograms add up over the processes, dead ones included, so counts stay exact when a
front-end is restarted; each gauge says how its processes' values combine (multiprocess_mode)."""

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
ROW_BUCKETS = tuple(float(2**i) for i in range(13))  # 1 .. 4096 rows
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)

REQUESTS = Counter(
    "mirrorserve_requests_total",
    "RPCs answered, by protocol (tfserving, v2, tfserving-rest, v2-rest), model, version (empty when none was "
    "resolved), method and gRPC status code.",
    ["protocol", "model", "version", "method", "code"],
)
REQUEST_SECONDS = Histogram(
    "mirrorserve_request_duration_seconds",
    "Server-side time from receiving an RPC to its answer, by protocol, model, version and method.",
    ["protocol", "model", "version", "method"], buckets=LATENCY_BUCKETS,
)
QUEUE_SECONDS = Histogram(
    "mirrorserve_queue_duration_seconds",
    "Time a request waited in the batcher: before its batch (and between its batches when it was split), "
    "not counting its batches' hand-over to the model, run and return. Same value as the "
    "mirrorserve-queue-seconds trailer and Triton's ModelStatistics queue.",
    ["model", "version"], buckets=LATENCY_BUCKETS,
)
BATCH_SECONDS = Histogram(
    "mirrorserve_batch_duration_seconds", "Execution time of one batch across all replicas.",
    ["model", "version"], buckets=LATENCY_BUCKETS,
)
BATCH_ROWS = Histogram(
    "mirrorserve_batch_rows", "Requests' rows per model run (all replicas together; with several front-ends, "
    "their batches that ran as one run count once).",
    ["model", "version"], buckets=ROW_BUCKETS,
)
REPLICA_ROWS = Counter(
    "mirrorserve_replica_rows_total",
    "Rows executed by each replica (a batch with fewer rows than replicas leaves the rest idle).",
    ["model", "version", "replica"],
)
QUEUE_ROWS = Gauge("mirrorserve_queue_rows", "Rows waiting for a batch (all front-ends together).",
                   ["model", "version"], multiprocess_mode="livesum")
QUEUE_ROWS_LIMIT = Gauge(
    "mirrorserve_queue_rows_limit",
    "The bound on queued rows (--max-queued-rows, in each front-end: all of theirs together); queue_rows / this is "
    "how full the queue is.", ["model", "version"], multiprocess_mode="livesum",
)
QUEUE_REQUESTS = Gauge("mirrorserve_queue_requests", "Requests with rows waiting for a batch (all front-ends "
                       "together).", ["model", "version"], multiprocess_mode="livesum")
BATCHES_IN_FLIGHT = Gauge("mirrorserve_batches_in_flight", "Batches executing now, or handed to the model worker "
                          "(all front-ends together).", ["model", "version"], multiprocess_mode="livesum")
MODEL_BUSY_SECONDS = Counter(
    "mirrorserve_model_busy_seconds_total", "Seconds the version had batches in flight, weighted by 1 / its "
    "in-flight limit (and averaged over front-ends): its rate is the share of time the model is busy, 0 idle to 1 "
    "saturated, which the autoscaler scales on (server.metrics.BusyClock).", ["model", "version"])
LATENCY_TARGET = Gauge(
    "mirrorserve_latency_target_seconds", "The version's latency target (server.core.latency_target), if it has one.",
    ["model", "version"], multiprocess_mode="max")
LATENCY_TARGET_FEASIBLE = Gauge(
    "mirrorserve_latency_target_feasible", "0 when a one-row run alone, as warmed up, exceeds the latency target.",
    ["model", "version"], multiprocess_mode="min")
TARGET_BATCH_SIZE = Gauge(
    "mirrorserve_latency_target_batch_size", "The batch size B* the latency target chose last for the signature "
    "(rows).", ["model", "version", "signature"], multiprocess_mode="max")
TARGET_WAIT = Gauge(
    "mirrorserve_latency_target_wait_seconds", "The longest the latency target lets a batch's oldest request wait "
    "for B* rows while the model is busy (seconds).", ["model", "version", "signature"], multiprocess_mode="max")
TARGET_FIT = Gauge(
    "mirrorserve_latency_target_fit_seconds", "The fitted run time: part a (seconds a batch), b (seconds a row) or "
    "spread (root mean square of the fit's residuals, seconds).", ["model", "version", "signature", "part"],
    multiprocess_mode="max")
ARRIVAL_RATE = Gauge(
    "mirrorserve_arrival_rows_per_second", "Rows arriving a second over the last second (with a latency target).",
    ["model", "version", "signature"], multiprocess_mode="sum")
TARGET_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
"""Request time over the target: 1.0 is an exact edge for every model, whatever its target."""
TARGET_RATIO = Histogram(
    "mirrorserve_latency_target_ratio", "Answered inferences' server-side time over their version's latency target: "
    "the bucket le=\"1.0\" holds exactly those within it, so 1 - that bucket / the count is the share over it.",
    ["model", "version"], buckets=TARGET_RATIO_BUCKETS)
TRACE_SPANS_DROPPED = Counter(
    "mirrorserve_trace_spans_dropped_total", "Trace spans dropped, never waited for (--tracing otlp), by reason: "
    "export_failed (a collector down or refusing) or queue_full (the exporter stuck, on a slow or down collector, "
    "while the span queue filled).", ["reason"])
OVER_TARGET = Counter(
    "mirrorserve_over_target_total", "Answered requests that took longer than their version's latency target; "
    "over mirrorserve_requests_total, the exact share over the target.", ["model", "version"])
SHED = Counter(
    "mirrorserve_shed_total", "Requests refused at arrival to keep a latency target (reason over_target: their "
    "predicted time exceeded it while the model could not keep up).", ["model", "version", "reason"])
FRONTEND_BUSY_SECONDS = Counter(
    "mirrorserve_frontend_busy_seconds_total", "CPU seconds of the front-end processes over their count: its rate "
    "is the average front-end's share of the one core its GIL allows, 0 idle to about 1 saturated "
    "(server.frontends.cpu_share).", [])
MODEL_READY = Gauge(
    "mirrorserve_model_ready",
    "1 while the version is loaded, warmed up and serving; 0 while it loads, unloads or the server drains.",
    ["model", "version"], multiprocess_mode="livemax",  # set by the primary front-end, which owns the lifecycle
)
MODEL_LOADS = Counter(
    "mirrorserve_model_loads_total", "Versions loaded and warmed up successfully.", ["model", "version"],
)
MODEL_LOAD_FAILURES = Counter(
    "mirrorserve_model_load_failures_total",
    "Failed loads of a version (corrupt or half-copied folder, ...); each retry that fails counts.",
    ["model", "version"],
)
MODEL_LOAD_SECONDS = Histogram(
    "mirrorserve_model_load_duration_seconds", "Time to load and warm up a version.",
    ["model"], buckets=LOAD_BUCKETS,
)
DROPPED = Counter(
    "mirrorserve_dropped_requests_total",
    "Requests dropped before compute because their deadline passed or their client cancelled.",
    ["model", "version", "reason"],
)
MODEL_FAILURES = Counter(
    "mirrorserve_model_failures_total",
    "Requests the model failed on, after isolating them from their batch: its own errors (with TensorFlow's code, "
    "INVALID_ARGUMENT for most) and INTERNAL failures around it.",
    ["model", "version"],
)
TRACES = Counter(
    "mirrorserve_tf_function_traces_total",
    "tf.function traces of the replica programs (one per count of replicas a batch may use, at load); flat in "
    "steady state.", ["model", "version", "signature"],
)

REQUEST_LOG_RECORDS = Counter(
    "mirrorserve_request_log_records_total", "Sampled requests written to the model's request log "
    "(logging_config).", ["model"],
)
REQUEST_LOG_BYTES = Counter(
    "mirrorserve_request_log_bytes_total", "Bytes written to the model's request log files.", ["model"],
)
REQUEST_LOG_DROPPED = Counter(
    "mirrorserve_request_log_dropped_total", "Sampled requests not logged: queue_full (the writer was a "
    "file's worth behind) or write_error (the file could not be written).", ["model", "reason"],
)

EVENT_LOOP_LAG = Histogram(
    "mirrorserve_event_loop_lag_seconds",
    "How late the event loop (gRPC, REST, batching) woke for a timer set 0.1 s ahead: time it could run "
    "nothing else, which every request waiting on it waited too.",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

# ---- TF Serving's own series, by its names, labels and units (µs), beside ours ------------------
# So that TF Serving's dashboards and alerts work unchanged. Its exporter writes
# `/tensorflow/serving/request_count` as `:tensorflow:serving:request_count`, with no `_total`
# suffix; its histograms have exponential buckets in microseconds.

TFS_LATENCY_BUCKETS_US = tuple(10 * 1.8**i for i in range(33))
TFS_QUEUE_BUCKETS_US = tuple(100 * 1.2**i for i in range(52))
TFS_BATCH_BUCKETS = tuple(float(2**i) for i in range(14))
TFS_THREAD_POOL = "batch_threads"
"""BatchingParameters.thread_pool_name's default: the label TF Serving's queuing latency carries."""

TFS_REQUEST_LATENCY = Histogram(
    ":tensorflow:serving:request_latency", "TF Serving's name: latency of OK inference requests, µs, by "
    "model_name, API (Predict, Classify, Regress, MultiInference; predict, classify, regress on REST; ModelInfer, "
    "infer for v2) and entrypoint (GRPC or REST).",
    ["model_name", "API", "entrypoint"], buckets=TFS_LATENCY_BUCKETS_US,
)
TFS_RUNTIME_LATENCY = Histogram(
    ":tensorflow:serving:runtime_latency", "TF Serving's name: the model's time on an OK request's batches, µs.",
    ["model_name", "API", "runtime"], buckets=TFS_LATENCY_BUCKETS_US,
)
TFS_QUEUING_LATENCY = Histogram(
    ":tensorflow:serving:batching_session:queuing_latency", "TF Serving's name: a request's wait for its batch, µs.",
    ["thread_pool_name"], buckets=TFS_QUEUE_BUCKETS_US,
)
TFS_WARMUP_LATENCY = Histogram(
    ":tensorflow:serving:model_warmup_latency", "TF Serving's name: time to replay a version's warmup file, "
    "µs, by model_path (the version's folder) and status (OK, or the failure's code).",
    ["model_path", "status"], buckets=TFS_LATENCY_BUCKETS_US,
)
TFS_PROCESSED_BATCH_SIZE = Histogram(
    ":tensorflow:serving:batching_session:processed_batch_size", "TF Serving's name: the size of each executed "
    "batch, padding included.", [], buckets=TFS_BATCH_BUCKETS,
)


class _TfServingRequestCount:
    """`:tensorflow:serving:request_count{model_name,status}`, exactly so named (a Counter would add
    `_total`): inference requests answered, by gRPC status name. With several front-ends it is a
    gauge of mode sum underneath (the one kind whose multiprocess files keep a bare name), every
    process's count added up, dead ones' included."""

    HELP = "TF Serving's name: inference requests answered, by model_name and status."

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self._shared = Gauge(":tensorflow:serving:request_count", self.HELP, ["model_name", "status"],
                             multiprocess_mode="sum", registry=None) if MULTIPROCESS else None

    def inc(self, model_name: str, status: str) -> None:
        if self._shared is not None:
            self._shared.labels(model_name, status).inc()
            return
        key = (model_name, status)
        self.counts[key] = self.counts.get(key, 0) + 1

    def collect(self) -> list[Metric]:
        metric = Metric(":tensorflow:serving:request_count", self.HELP, "unknown")
        for (model_name, status), count in sorted(self.counts.items()):
            metric.add_sample(":tensorflow:serving:request_count", {"model_name": model_name, "status": status},
                              count)
        return [metric]


TFS_REQUEST_COUNT = _TfServingRequestCount()
REGISTRY.register(TFS_REQUEST_COUNT)
_PAGE: list[CollectorRegistry] = []


def page_registry() -> CollectorRegistry:
    """What /metrics shows: this process's registry, or with several front-ends every process's
    values, read from their files (prometheus_client's MultiProcessCollector)."""
    if not MULTIPROCESS:
        return REGISTRY
    if not _PAGE:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        _PAGE.append(registry)
    return _PAGE[0]


def process_gone(pid: int) -> None:
    """A front-end process died: its live gauges stop counting (its counters keep their counts)."""
    if MULTIPROCESS:
        multiprocess.mark_process_dead(pid)


VERSION_GAUGES = (QUEUE_ROWS, QUEUE_ROWS_LIMIT, QUEUE_REQUESTS, BATCHES_IN_FLIGHT, MODEL_READY, LATENCY_TARGET,
                  LATENCY_TARGET_FEASIBLE)


def forget_version(model: str, version: str) -> None:
    """Remove an unloaded version's gauges (its counters stay, so rates stay right). With several
    front-ends prometheus_client cannot remove a series from the processes' files: the gauges stay,
    at the values the version left (mirrorserve_model_ready 0, empty queues)."""
    if MULTIPROCESS:
        return
    for gauge in VERSION_GAUGES:
        with contextlib.suppress(KeyError):
            gauge.remove(model, version)


class BusyClock:
    """How busy a version's model is: the share of wall time with a batch in flight, over the
    in-flight limit; what the autoscaler scales on.

    Queue time mixes the deliberate batching wait with the wait behind a running batch, so a model
    of 50 ms batches passes any fixed queue-time target at modest load, and a 1 ms model only at
    saturation. The busy share means the same for both: 0 idle, 1 when a batch is always in flight
    (every slot of --max-inflight-batches, with several front-ends in each of them, on average).

    Exported as a counter of busy seconds (mirrorserve_model_busy_seconds_total), so its rate over
    any window is the busy share over that window. Each front-end weighs its own in-flight batches by
    1 / (in-flight limit x front-ends): their counters add up to the average over front-ends.
    Pure: the caller passes the clock."""

    def __init__(self, max_inflight: int, frontends: int, now: float) -> None:
        self._weight = 1.0 / (max_inflight * frontends)
        self._in_flight = 0
        self._since = now

    def change(self, delta: int, now: float) -> float:
        """A batch went in flight (+1) or came back (-1) at `now`: the busy seconds since the last
        change, to add to the counter."""
        busy = max(now - self._since, 0.0) * self._in_flight * self._weight
        self._since = now
        self._in_flight += delta
        return busy


class BatcherMetrics:
    """The batcher's observer (server.core.batcher.BatchObserver), with the labels bound once; it
    records the version's statistics (Triton's ModelStatistics) from the same readings."""

    def __init__(self, model: str, version: str, statistics: VersionStatistics, max_inflight: int = 1,
                 frontends: int = 1) -> None:
        # The queue gauges are read when scraped rather than set on every change: the batcher
        # reports a change several times per request, and each set takes a lock.
        self.queued_rows = 0
        self.queued_requests = 0
        self._shared_queue = (QUEUE_ROWS.labels(model, version), QUEUE_REQUESTS.labels(model, version))
        if not MULTIPROCESS:  # files are read, not functions: with several front-ends, queue_changed sets them
            self._shared_queue[0].set_function(lambda: self.queued_rows)
            self._shared_queue[1].set_function(lambda: self.queued_requests)
        self._in_flight = BATCHES_IN_FLIGHT.labels(model, version)
        self._busy = BusyClock(max_inflight, frontends, time.monotonic())
        self._busy_seconds = MODEL_BUSY_SECONDS.labels(model, version)
        self._batch_rows = BATCH_ROWS.labels(model, version)
        self._batch_seconds = BATCH_SECONDS.labels(model, version)
        self._queue_seconds = QUEUE_SECONDS.labels(model, version)
        self._tfs_queuing = TFS_QUEUING_LATENCY.labels(TFS_THREAD_POOL)
        self._statistics = statistics
        self._dropped = {reason: DROPPED.labels(model, version, reason) for reason in ("deadline", "cancelled")}
        self._labels = (model, version)

    def queue_changed(self, rows: int, requests: int) -> None:
        if MULTIPROCESS and (rows, requests) != (self.queued_rows, self.queued_requests):
            self._shared_queue[0].set(rows)
            self._shared_queue[1].set(requests)
        self.queued_rows = rows
        self.queued_requests = requests

    def batch_started(self, rows: int) -> None:
        self._in_flight.inc()
        self._busy_seconds.inc(self._busy.change(+1, time.monotonic()))

    def batch_finished(self, rows: int, padded: int, timing: BatchTiming | None, counted: int) -> None:
        self._in_flight.dec()
        self._busy_seconds.inc(self._busy.change(-1, time.monotonic()))
        if counted:
            self._batch_rows.observe(counted)
        if timing is not None:
            self._batch_seconds.observe(timing.infer_seconds)
            TFS_PROCESSED_BATCH_SIZE.observe(padded)
            self._statistics.batch_ran(rows, padded, timing.input_seconds, timing.infer_seconds,
                                       timing.output_seconds)

    def request_finished(self, answer: Answer) -> None:
        self._queue_seconds.observe(answer.queue_seconds)
        self._tfs_queuing.observe(answer.queue_seconds * 1e6)
        self._statistics.request_queued(answer.queue_seconds)

    def request_dropped(self, reason: str) -> None:
        self._dropped[reason].inc()

    def request_shed(self, reason: str) -> None:
        SHED.labels(*self._labels, reason).inc()

    def target_planned(self, key: Hashable, plan: Plan, wait_s: float, fit: tuple[float, float, float],
                       rows_per_second: float) -> None:
        """A latency target's new plan (once a batch), labelled with the signature it is for: each
        has its own fit and plan (of a signature's input layouts, the one planned last)."""
        labels = (*self._labels, str(getattr(key, "signature", key)))
        TARGET_BATCH_SIZE.labels(*labels).set(plan.batch_size)
        TARGET_WAIT.labels(*labels).set(wait_s)
        for part, value in zip(("a", "b", "spread"), fit, strict=True):
            TARGET_FIT.labels(*labels, part).set(value)
        ARRIVAL_RATE.labels(*labels).set(rows_per_second)
