"""HTTP on --rest-api-port: TensorFlow Serving's REST API (/v1, server.api.tfserving.rest), the Open
Inference Protocol's (/v2, server.api.v2.rest) and the Prometheus page (/metrics, and TF Serving's
/monitoring/prometheus/metrics), served by aiohttp on the server's own event loop.

What both REST APIs share lives here: JSON answers and `{"error": "..."}` failures with the HTTP
status of the one status table (server.api.status), the client's deadline from the `Grpc-Timeout`
header (gRPC's own format, as grpc-gateway reads it), and the bound on requests handled at once
(shared with gRPC). Bodies are read by server.api.http.body; aiohttp does not decompress them, reads and
drops one a handler refused unread before it closes the connection (for up to LINGER_S), and a request it
cannot parse is counted and logged as a refusal, without a traceback.
"""

from __future__ import annotations

import functools
import logging
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server import metrics, tracing
from server.api.admission import Admission, Call, ConcurrencyLimit
from server.api.http import json_codec
from server.api.recording import Recorder
from server.api.refusals import count_refusal
from server.api.request_timing import TRACE_ID_TRAILER
from server.api.status import http_status_for
from server.core.servables import Servable
from server.errors import InvalidInput, OverTarget, QueueFull

DEADLINE_HEADER = "Grpc-Timeout"
RETRY_AFTER_S = "1"
"""Retry-After of a 503 for a full queue: a queue drains in a batch's time, but the header counts
whole seconds."""
METRICS_PATHS = ("/metrics", "/monitoring/prometheus/metrics")
_TIMEOUT = re.compile(r"(\d{1,8})([HMSmun])")
_UNIT_SECONDS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=json_codec.dumps(value), status=status, content_type="application/json")


LINGER_S = 5.0
"""How long a refused body is read and dropped after the answer before its connection closes."""

CLOSE_AFTER = (413, 415)
"""Answers after which the connection is closed: the body was refused for what it is, and the rest
of it is not worth keeping the connection for. (Any body left unread closes the connection too.)"""


def error_response(status: int, message: str) -> web.Response:
    response = json_response({"error": message}, status)
    if status in CLOSE_AFTER:
        response.force_close()
    return response


def deadline_of(request: web.Request, default_s: float | None = None) -> float | None:
    """The client's deadline on time.monotonic's clock (Grpc-Timeout: 500m, 2S, ...); without
    one, `default_s` from now (--rest-api-timeout-ms), or None."""
    text = request.headers.get(DEADLINE_HEADER)
    if text is None:
        return None if default_s is None else time.monotonic() + default_s
    match = _TIMEOUT.fullmatch(text.strip())
    if match is None:
        raise InvalidInput(f"{DEADLINE_HEADER} '{text}' is not a gRPC timeout: up to 8 digits and a unit, "
                           f"H M S m u or n (e.g. 500m for 500 ms)")
    return time.monotonic() + int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


class RestFrontEnd(Admission):
    """An inference REST API: counted for the drain like the gRPC front-ends, and failing through
    the same recorder and status table."""

    def __init__(self, recorder: Recorder, default_timeout_s: float | None = None) -> None:
        super().__init__(recorder)
        self._default_timeout_s = default_timeout_s

    def deadline(self, request: web.Request) -> float | None:
        """The request's deadline (deadline_of), the server's REST timeout when it sends none."""
        return deadline_of(request, self._default_timeout_s)

    def failure(self, method: str, exc: BaseException, started: float, servable: Servable | None = None,
                name: str = "", peer: str | None = None) -> web.Response:
        code, message = self._recorder.failed(method, exc, started, servable, name, peer or "")
        response = error_response(http_status_for(exc, code), message)
        if isinstance(exc, QueueFull | OverTarget):
            response.headers["Retry-After"] = RETRY_AFTER_S
        return response

    def refusal(self, method: str, started: float) -> web.Response:
        return error_response(503, self.refused(method, started))


R = TypeVar("R", bound=RestFrontEnd)


def rest_call(method: str, *, drained: bool = False, counted: bool = False, traced: bool = False) -> Callable[
        [Callable[[R, web.Request, Call], Awaitable[web.StreamResponse]]],
        Callable[[R, web.Request], Awaitable[web.StreamResponse]]]:
    """The bookkeeping of a REST handler `(self, request, call) -> response`, as server.api.admission's
    grpc_call does it for gRPC: a failure becomes `{"error": ...}` with the status table's HTTP status."""

    def decorate(body: Callable[[R, web.Request, Call], Awaitable[web.StreamResponse]]) -> Callable[
            [R, web.Request], Awaitable[web.StreamResponse]]:
        @functools.wraps(body)
        async def handler(self: R, request: web.Request) -> web.StreamResponse:
            call = self.begin(method, drained, counted)
            if call is None:
                return self.refusal(method, time.perf_counter())

            async def fail(exc: Exception) -> web.StreamResponse:
                assert call is not None
                response = self.failure(call.method, exc, call.started, call.servable, call.name, request.remote)
                if not request.content.at_eof():
                    # Refused before its body was read: the connection closes after this answer
                    # (the body is only read and dropped, for LINGER_S at most), so say so, and a
                    # keep-alive client reconnects instead of writing its next request into a
                    # closed socket.
                    response.force_close()
                call.code, call.message = f"HTTP_{response.status}", response.reason or ""
                return response

            if not (tracing.ENABLED and (counted or traced)):
                return await self.settle(call, counted, body(self, request, call), fail)
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else request.path
            call.span = tracing.start_request(f"{request.method} {route}", request.headers.items(), "http")
            call.code = "HTTP_200"  # unless `fail` answers otherwise
            call.trace_id = tracing.trace_id(call.span)
            with tracing.current(call.span):
                try:
                    answer = await self.settle(call, counted, body(self, request, call), fail)
                    if call.trace_id:
                        answer.headers[TRACE_ID_TRAILER] = call.trace_id
                    return answer
                finally:
                    call.end_span()

        return handler

    return decorate


def route_of(method: str, path: str) -> tuple[str, str]:
    """(protocol, method) labels of a request refused before its handler ran, from its URL alone."""
    if path.startswith("/v1/"):
        verb = path.rpartition(":")[2] if ":" in path.rpartition("/")[2] else ""
        if verb:
            return "tfserving-rest", verb[:1].upper() + verb[1:] if verb in ("predict", "classify", "regress") else ""
        return "tfserving-rest", "GetModelMetadata" if path.endswith("/metadata") else "GetModelStatus"
    if path.startswith("/v2"):
        for suffix, name in (("/infer", "ModelInfer"), ("/ready", "ModelReady"), ("/live", "ServerLive"),
                             ("/config", "ModelConfig"), ("/stats", "ModelStatistics"), ("/index", "RepositoryIndex"),
                             ("/load", "RepositoryModelLoad"), ("/unload", "RepositoryModelUnload")):
            if path.endswith(suffix):
                return "v2-rest", "ServerReady" if path == "/v2/health/ready" else name
        return "v2-rest", "ModelMetadata" if path.startswith("/v2/models/") else "ServerMetadata"
    return "http", "Metrics" if path in METRICS_PATHS else ""


JSON_HELD_FACTOR = 6
"""Bytes a JSON body holds in the serving process per byte of it, at its peak: the body as read,
its copy to the decoding helper, and the decoded tensors as they come back (pickled, then
unpickled). Measured: a 30 MB body of rows of zeros (53 MB once float32) raised the serving
process's RSS by 158 MB (5.3x) at its peak (tests/security/test_bodies.py)."""


INFLATION_FACTOR = 20
"""What a compressed body is taken to inflate to, per byte of it (JSON compresses 5-20 times); a
bomb inflates further only up to --max-message-bytes, where it is refused."""


def _body_bytes(request: web.Request, max_body_bytes: int) -> int:
    """What a request's body will hold once read and decoded (for the byte budget): its
    Content-Length (INFLATION_FACTOR times that when compressed), at most --max-message-bytes, or
    that when chunked; a JSON body JSON_HELD_FACTOR times that, a binary one twice (the body and
    its tensors)."""
    if not request.body_exists:
        return 0
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    size = max_body_bytes
    if request.content_length is not None:
        inflation = 1 if encoding in ("", "identity") else INFLATION_FACTOR
        size = min(request.content_length * inflation, max_body_bytes)
    return size * (2 if "octet-stream" in request.headers.get("Content-Type", "") else JSON_HELD_FACTOR)


def _limit_concurrency(limit: ConcurrencyLimit, max_body_bytes: int) -> Any:
    """Refuse (429) a request beyond the limit in progress, before its body is read (counted and
    logged as a refusal); and answer the router's own failures (unknown path, wrong method) as
    JSON errors too."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        size = _body_bytes(request, max_body_bytes)
        refusal = limit.refusal() if limit.full() else limit.bytes_refusal(size)
        if refusal is not None:
            protocol, method = route_of(request.method, request.path)
            count_refusal(protocol, method, grpc.StatusCode.RESOURCE_EXHAUSTED, str(refusal), request.remote or "")
            return error_response(429, str(refusal))
        limit.active += 1
        limit.hold(size)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            return error_response(exc.status, f"{exc.reason}: {request.method} {request.path[:200]}")
        finally:
            limit.active -= 1
            limit.release(size)

    return middleware


class _MalformedRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a 100 KB URL, a bad header line) as an ERROR with a
    traceback; here it is a refusal: counted, logged as one, and its traceback dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        peer = str(record.args[0]) if isinstance(record.args, tuple) and record.args else ""
        detail = f"{type(exc).__name__}: {str(exc.message)[:200]}"
        count_refusal("http", "", grpc.StatusCode.INVALID_ARGUMENT, detail, peer)
        return False


async def _metrics_page(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(metrics.page_registry()), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(routes: list[web.RouteDef], max_body_bytes: int, limit: ConcurrencyLimit,
              metrics_paths: Sequence[str] = METRICS_PATHS) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_limit_concurrency(limit, max_body_bytes)])
    app.add_routes(routes)
    app.add_routes([web.get(path, _metrics_page) for path in metrics_paths])
    return app


def _listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The listening socket: on every interface (host "" or "::"), one socket for IPv6 and IPv4
    both (so port 0 gets one port), or IPv4 alone without IPv6; else on the address given."""
    if host in ("", "::"):
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            address: tuple[Any, ...] = ("::", port)
        except OSError:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            address = ("0.0.0.0", port)
    else:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class RestServer:
    def __init__(self, app: web.Application) -> None:
        # auto_decompress off: server.api.http.body decompresses, bounded. A body a handler
        # refused unread is read and dropped (never decompressed) after the answer, for up to
        # LINGER_S, before the connection closes: closing with bytes unread resets it, and a
        # client still sending (as most HTTP/1.1 clients do before they read) would get that
        # reset instead of the answer. Measured: a 2 MB body refused at 1 MB came back as
        # "Broken pipe" to Python's http.client, now and then, when the connection closed unread.
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, auto_decompress=False,
                                     lingering_time=LINGER_S)
        logging.getLogger("aiohttp.server").addFilter(_MALFORMED)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None, *, reuse_port: bool = False) -> int:
        """Listen on `host`:`port` (0: any free port); the port bound. `reuse_port`: other
        front-end processes listen on the same port (SO_REUSEPORT)."""
        sock = _listening_socket(host, port, reuse_port)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, ssl_context=ssl_context).start()
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Close the listener and every connection (callers wait for in-flight requests first)."""
        await self._runner.cleanup()


_MALFORMED = _MalformedRequests()
