"""Prometheus metrics, declared once at import (architecture.md, example 12).

Names carry base units, histograms have explicit buckets, and label sets are small and fixed.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
ROW_BUCKETS = tuple(float(2**i) for i in range(13))  # 1 .. 4096 rows

REQUESTS = Counter(
    "mirrorserve_requests_total", "RPCs answered, by model, method and gRPC status code.",
    ["model", "method", "code"],
)
REQUEST_SECONDS = Histogram(
    "mirrorserve_request_duration_seconds",
    "Server-side time from receiving an RPC to its answer, by model and method.",
    ["model", "method"], buckets=LATENCY_BUCKETS,
)
BATCH_ROWS = Histogram(
    "mirrorserve_batch_rows", "Rows per executed batch (all replicas together).",
    ["model"], buckets=ROW_BUCKETS,
)
REPLICA_ROWS = Counter(
    "mirrorserve_replica_rows_total", "Rows executed by each replica.", ["model", "replica"],
)
TRACES = Counter(
    "mirrorserve_tf_function_traces_total",
    "tf.function traces of the replica program; flat in steady state.", ["model", "signature"],
)
