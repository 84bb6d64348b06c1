"""The gRPC server's channel arguments, from the settings. Apart from server.main so that tests
can check them without importing the servicers (and their generated protos)."""

from __future__ import annotations

from server.config import Settings


def grpc_options(settings: Settings) -> list[tuple[str, int]]:
    pending = settings.grpc_max_pending_rpcs or 4 * settings.max_concurrent_rpcs
    options = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        # HTTP/2 rapid reset: with a stream limit, grpc's overload protection (on by default)
        # counts a stream the client reset until it is freed, so one connection's flood of
        # HEADERS + RST_STREAM cannot fill the queue of calls every connection shares. Measured
        # (tests/security/test_http2.py): without the limit another client's calls were CANCELLED
        # (86% OK, p99 247 ms); with it, 100% OK (p99 42 ms: each reset stream still costs the
        # loop about 75 us, and grpc has no reset-rate limit that would close the connection).
        ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
        ("grpc.http.overload_protection", 1),
        # Calls grpc has accepted but our loop has not yet picked up wait in grpc's own queue,
        # which cancels (CANCELLED) what does not fit: with its default (1,000) a burst of 1,500
        # calls had 3-60 of them CANCELLED, even on a bare grpc.aio server. A queue a few times
        # the concurrency limit lets the burst reach our refusal (RESOURCE_EXHAUSTED) instead.
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", 2 * pending),
    ]
    if settings.grpc_max_connection_age_ms:
        options += [
            ("grpc.max_connection_age_ms", settings.grpc_max_connection_age_ms),
            ("grpc.max_connection_age_grace_ms", settings.grpc_max_connection_age_grace_ms),
        ]
    return options
