"""Each request's own server time, told to its client on every protocol: where it queued, where it
computed, and its total, so a client under concurrency need not diff aggregate statistics.

- gRPC (TF Serving and v2): trailing metadata `mirrorserve-queue-seconds`,
  `mirrorserve-compute-seconds` and `mirrorserve-server-seconds` (seconds, 6 decimals);
- v2 (gRPC and REST): also the response parameters `queue_ns` and `compute_ns`;
- REST: a `Server-Timing` header (W3C Server Timing; `dur` in milliseconds):
  `queue;dur=0.120, compute;dur=0.510, total;dur=1.020`.

`compute` is the model's own time on the request's batches (server.core.statistics.RequestTiming's
`infer`); decoding, hand-over and encoding are in `total`, not in `queue` or `compute`.
"""

from __future__ import annotations

from server.core.inference import Inference
from server.core.statistics import RequestTiming

QUEUE_TRAILER = "mirrorserve-queue-seconds"
COMPUTE_TRAILER = "mirrorserve-compute-seconds"
TOTAL_TRAILER = "mirrorserve-server-seconds"
QUEUE_PARAMETER = "queue_ns"
COMPUTE_PARAMETER = "compute_ns"
SERVER_TIMING = "Server-Timing"
TRACE_ID_TRAILER = "mirrorserve-trace-id"
"""The request's trace id (32 hex digits), when it is traced (--tracing): a client finds its trace."""


def trailers(timing: RequestTiming, trace_id: str = "") -> tuple[tuple[str, str], ...]:
    """The timing trailers, and the request's trace id when it is traced (server.tracing)."""
    told = (
        (QUEUE_TRAILER, f"{timing.queue_seconds:.6f}"),
        (COMPUTE_TRAILER, f"{timing.infer_seconds:.6f}"),
        (TOTAL_TRAILER, f"{timing.total_seconds:.6f}"),
    )
    return (*told, (TRACE_ID_TRAILER, trace_id)) if trace_id else told


def v2_parameters(result: Inference) -> dict[str, int]:
    """Known once the request ran (before its response is encoded, which JSON needs)."""
    return {
        QUEUE_PARAMETER: round(result.queue_seconds * 1e9),
        COMPUTE_PARAMETER: round(result.compute_seconds * 1e9),
    }


def server_timing(timing: RequestTiming) -> str:
    return (f"queue;dur={timing.queue_seconds * 1e3:.3f}, compute;dur={timing.infer_seconds * 1e3:.3f}, "
            f"total;dur={timing.total_seconds * 1e3:.3f}")
