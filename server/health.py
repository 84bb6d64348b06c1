"""grpc.health.v1 and server reflection, driven by real readiness.

Health says NOT_SERVING (overall, "", and per service) until the model is loaded and warmed up,
SERVING after, and NOT_SERVING again from the moment a drain starts. Service names are taken from
the descriptors, never typed out (architecture.md, example 10).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.tensorflow_serving import prediction_service_pb2

PREDICTION_SERVICE = prediction_service_pb2.DESCRIPTOR.services_by_name["PredictionService"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVED = ("", PREDICTION_SERVICE)
"""Names health reports on: "" is the whole server (what Kubernetes' grpc probe asks by default)."""


class Health:
    """Create inside the running event loop: the servicer holds asyncio conditions."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in SERVED:
            await self.servicer.set(name, status)

    async def start_drain(self) -> None:
        """NOT_SERVING everywhere, and no later change can flip it back."""
        await self.servicer.enter_graceful_shutdown()


def add_health_and_reflection(server: grpc.aio.Server, checks: Health) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(checks.servicer, server)
    reflection.enable_server_reflection((PREDICTION_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
