"""One front-end: the gRPC and REST servers of every protocol over a registry, in one process.

The primary process and each other front-end process (--frontends) build the same FrontEnd; they
differ in where the registry's versions come from (the lifecycle, or the primary's views) and in
who applies control calls. Several front-ends answer on the same ports: grpc sets SO_REUSEPORT on
its listeners by default, and the REST listener sets it when asked (`reuse_port`), so the kernel
spreads new connections over the processes.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from server import tracing
from server.api.admission import ConcurrencyLimit
from server.api.control import ControlPlane
from server.api.health import Health, add_health_and_reflection
from server.api.http import server as rest
from server.api.http.body import MAX_WAITING, BodyDecoder
from server.api.request_log import RequestLogs
from server.api.tfserving import grpc_service as tfs
from server.api.tfserving import model_service as tfs_model_service
from server.api.tfserving import rest as rest_tfs
from server.api.tfserving.examples import ExampleCalls
from server.api.v2 import grpc_service as v2
from server.api.v2 import rest as rest_v2
from server.config import Settings
from server.core.example_methods import ExampleMethods
from server.core.repository import Repository
from server.core.servables import Registry
from server.core.statistics import PeerStatistics
from server.frontends.grpc_options import grpc_options


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    from server.frontends.ssl_config import read_ssl_config

    if settings.ssl_config_file is not None:
        ssl_config = read_ssl_config(settings.ssl_config_file)  # a bad file exits 2
        return grpc.ssl_server_credentials([(ssl_config.key, ssl_config.cert)], root_certificates=ssl_config.client_ca,
                                           require_client_auth=ssl_config.client_ca is not None)
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    with open(settings.tls_key_file, "rb") as key, open(settings.tls_cert_file, "rb") as cert:
        pair = (key.read(), cert.read())
    client_ca = None
    if settings.tls_client_ca_file is not None:
        client_ca = b"".join(Path(f).read_bytes() for f in _client_cas(settings))
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _client_cas(settings: Settings) -> list[str]:
    """The CA files a client certificate may come from: inference clients' and admins'."""
    return [f for f in (settings.tls_client_ca_file, settings.admin_client_ca_file) if f is not None]


def rest_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The same certificate, key and client CA as gRPC's TLS, for HTTPS on the REST port."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if settings.tls_client_ca_file is not None:
        for ca_file in _client_cas(settings):
            context.load_verify_locations(ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def grpc_address(host: str, port: int) -> str:
    """grpc's address for a bind address (empty: every interface)."""
    if not host or host == "::":
        return f"[::]:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class FrontEnd:
    """Every protocol's servers over `registry`. `models` returns what applies control calls (the
    lifecycle, or a RemoteModels; None until the worker has started)."""

    def __init__(self, settings: Settings, registry: Registry, *, ready: Callable[[], bool],
                 models: Callable[[], Any], control: Callable[[], ControlPlane],
                 metrics_paths: tuple[str, ...], peers: PeerStatistics | None = None) -> None:
        self.settings = settings
        self.registry = registry
        tracing.configure(settings.tracing)  # each front-end process its own provider (and exporter)
        self.health = Health((tfs.SERVICE.full_name, tfs_model_service.SERVICE.full_name, v2.SERVICE.full_name))
        # The limit bounds the server: each of its N front-ends admits its share.
        self.limit = ConcurrencyLimit(math.ceil(settings.max_concurrent_rpcs / settings.frontends),
                                      settings.request_bytes_budget // settings.frontends)
        self.decoder = BodyDecoder(max_waiting_bytes=MAX_WAITING * settings.max_message_bytes)
        self.logs = RequestLogs(registry, settings.request_log_file_bytes, settings.request_log_max_files)
        self.examples = ExampleCalls(ExampleMethods(settings.signature_method_name_check), self.decoder,
                                     settings.max_message_bytes)
        self.repository = Repository(registry, models, settings.model_repository, settings.model_control_mode)
        servicer = tfs.PredictionServicer(registry, settings.max_message_bytes, self.examples, self.logs,
                                          typed_outputs=not settings.tensor_content_outputs)
        v2_servicer = v2.V2Servicer(registry, settings.max_message_bytes, ready, self.repository, control, peers)
        rest_timeout_s = settings.rest_api_timeout_ms / 1000 if settings.rest_api_timeout_ms > 0 else None
        tfs_rest = rest_tfs.TfsRest(registry, settings.max_message_bytes, self.decoder, self.examples.methods,
                                    rest_timeout_s, self.logs)
        v2_rest = rest_v2.V2Rest(registry, settings.max_message_bytes, ready, self.decoder, self.repository, control,
                                 rest_timeout_s, peers)
        self.front_ends = (servicer, v2_servicer, tfs_rest, v2_rest)
        self.server = grpc.aio.server(options=grpc_options(settings))
        tfs.add_to_server(servicer, self.server, self.limit)
        v2.add_to_server(v2_servicer, self.server, self.limit)
        tfs_model_service.add_to_server(
            tfs_model_service.ModelServiceServicer(registry, models, control), self.server, self.limit)
        add_health_and_reflection(self.server, self.health)
        self._routes = tfs_rest.routes() + v2_rest.routes()
        self._metrics_paths = metrics_paths
        self.rest_server: rest.RestServer | None = None
        self.port = 0
        self.rest_port = -1

    async def open(self, grpc_port: int, rest_port: int) -> None:
        """Bind and start both servers (health NOT_SERVING until set_serving); port 0 picks one."""
        settings = self.settings
        await self.health.set_serving(False)
        await self.health.set_live(True)
        credentials = server_credentials(settings)
        address = grpc_address(settings.grpc_bind_address, grpc_port)
        port = (self.server.add_insecure_port(address) if credentials is None
                else self.server.add_secure_port(address, credentials))
        if port == 0:
            raise OSError(f"could not bind gRPC port {grpc_port}")
        self.port = port
        if rest_port >= 0:
            self.rest_server = rest.RestServer(rest.build_app(self._routes, settings.max_message_bytes, self.limit,
                                                              self._metrics_paths))
            self.rest_port = await self.rest_server.start(settings.rest_bind_address, rest_port,
                                                          rest_ssl_context(settings), reuse_port=settings.frontends > 1)
        await self.server.start()

    @property
    def in_flight(self) -> int:
        return sum(f.in_flight for f in self.front_ends)

    @property
    def accepted(self) -> int:
        return sum(f.accepted for f in self.front_ends)

    @property
    def answered(self) -> int:
        return sum(f.answered for f in self.front_ends)

    async def finish(self, deadline: float) -> None:
        """Refuse new requests in our own handlers (a clean UNAVAILABLE) and wait for the accepted
        ones until `deadline` (time.monotonic); then stop grpc and the REST server. Calls caught
        inside grpc's queue at that instant are cancelled by grpc itself."""
        for front_end in self.front_ends:
            front_end.refuse_new()
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await self.server.stop(grace=max(deadline - time.monotonic(), 0.1))
        if self.rest_server is not None:
            await self.rest_server.stop()

    async def close(self) -> None:
        self.decoder.close()
        await asyncio.to_thread(self.logs.close, 2.0)  # what is queued reaches the request logs

    async def stop_listening(self) -> None:
        """Close the servers at once (a start that failed)."""
        await self.server.stop(0)
        if self.rest_server is not None:
            await self.rest_server.stop()
