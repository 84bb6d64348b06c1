"""grpc.health.v1 and server reflection, driven by real readiness.

Health says NOT_SERVING (overall, "", and per service) until every model of the start-up config
has an AVAILABLE version, SERVING after, and NOT_SERVING again from the moment a drain starts.
Models added later by a config change do not flip a serving pod back (GetModelStatus tells
their state): a ConfigMap change reaches every pod at once, and must not take them all out.
The services are named by main from each front-end's descriptor, never typed out
(a renamed service cannot go unnoticed); this module imports no front-end.

Liveness is apart (service "liveness", Kubernetes' livenessProbe): SERVING from the start, loading
included, since a restart would not load faster; NOT_SERVING once the model worker has stopped
making progress (server.core.watchdog) or is gone, or a drain has begun. A front-end whose event
loop is stuck does not answer at all, which fails the probe too.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
LIVENESS = "liveness"


class Health:
    """Create inside the running event loop: the servicer holds asyncio conditions."""

    def __init__(self, services: Sequence[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self.names = ("", *services)
        """Names health reports on: "" is the whole server (what Kubernetes' grpc probe asks by default)."""

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self.names:
            await self.servicer.set(name, status)

    async def set_live(self, live: bool) -> None:
        await self.servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING if live
                                else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def start_drain(self) -> None:
        """NOT_SERVING everywhere, and no later change can flip it back."""
        await self.servicer.enter_graceful_shutdown()


def add_health_and_reflection(server: grpc.aio.Server, checks: Health) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(checks.servicer, server)
    names = (*[n for n in checks.names if n], HEALTH_SERVICE, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
