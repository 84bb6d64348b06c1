"""HTTP on --rest-api-port: TensorFlow Serving's REST API (/v1, server.api.rest_tfs), the Open
Inference Protocol's (/v2, server.api.rest_v2) and the Prometheus page (/metrics, and TF Serving's
/monitoring/prometheus/metrics), served by aiohttp on the server's own event loop.

What both REST APIs share lives here: JSON answers and `{"error": "..."}` failures with the HTTP
status of the one status table (server.api.status), the body-size limit (checked against
Content-Length before reading, and while reading), the client's deadline from the `Grpc-Timeout`
header (gRPC's own format, as grpc-gateway reads it), and a bound on requests handled at once.
"""

from __future__ import annotations

import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.api import json_codec
from server.api.admission import Admission
from server.api.status import http_status_for
from server.core.servables import Servable
from server.errors import InvalidInput, TooLarge

DEADLINE_HEADER = "Grpc-Timeout"
METRICS_PATHS = ("/metrics", "/monitoring/prometheus/metrics")
_TIMEOUT = re.compile(r"(\d{1,8})([HMSmun])")
_UNIT_SECONDS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=json_codec.dumps(value), status=status, content_type="application/json")


def error_response(status: int, message: str) -> web.Response:
    return json_response({"error": message}, status)


def deadline_of(request: web.Request) -> float | None:
    """The client's deadline on time.monotonic's clock (Grpc-Timeout: 500m, 2S, ...), or None."""
    text = request.headers.get(DEADLINE_HEADER)
    if text is None:
        return None
    match = _TIMEOUT.fullmatch(text.strip())
    if match is None:
        raise InvalidInput(f"{DEADLINE_HEADER} '{text}' is not a gRPC timeout: up to 8 digits and a unit, "
                           f"H M S m u or n (e.g. 500m for 500 ms)")
    return time.monotonic() + int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, refused (413) once it is over `limit` bytes, before it is read when the
    client declared its length."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise TooLarge(f"the body has {declared} bytes; the limit is {limit} (--max-message-bytes)")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise TooLarge(f"the body is over the limit of {limit} bytes (--max-message-bytes)") from None


class RestFrontEnd(Admission):
    """An inference REST API: counted for the drain like the gRPC front-ends, and failing through
    the same recorder and status table."""

    def failure(self, method: str, exc: BaseException, started: float, servable: Servable | None = None,
                name: str = "") -> web.Response:
        code, message = self._recorder.failed(method, exc, started, servable, name)
        return error_response(http_status_for(exc, code), message)

    def refusal(self, method: str, started: float) -> web.Response:
        return error_response(503, self.refused(method, started))


def _limit_concurrency(limit: int) -> Any:
    """Refuse (429) a request beyond `limit` in progress, before its body is read; and answer the
    router's own failures (unknown path, wrong method) as JSON errors too."""
    active = 0

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        nonlocal active
        if active >= limit:
            return error_response(429, f"{active} requests are in progress; the limit is {limit} "
                                       f"(--max-concurrent-rpcs); retry later")
        active += 1
        try:
            return await handler(request)
        except web.HTTPException as exc:
            return error_response(exc.status, f"{exc.reason}: {request.method} {request.path}")
        finally:
            active -= 1

    return middleware


async def _metrics_page(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(routes: list[web.RouteDef], max_body_bytes: int, max_concurrent: int) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_limit_concurrency(max_concurrent)])
    app.add_routes(routes)
    app.add_routes([web.get(path, _metrics_page) for path in METRICS_PATHS])
    return app


def _listening_socket(port: int) -> socket.socket:
    """One socket for IPv6 and IPv4 both (so port 0 gets one port), or IPv4 alone without IPv6."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address: tuple[str, int] = ("::", port)
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = ("0.0.0.0", port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class RestServer:
    def __init__(self, app: web.Application) -> None:
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)

    async def start(self, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Listen on `port` (0: any free one); the port bound."""
        sock = _listening_socket(port)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, ssl_context=ssl_context).start()
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Close the listener and every connection (callers wait for in-flight requests first)."""
        await self._runner.cleanup()
