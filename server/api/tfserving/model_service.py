"""tensorflow.serving.ModelService over grpc.aio: every version's state (GetModelStatus) and
replacing the model config at run time (HandleReloadConfigRequest), as TensorFlow Serving has them.

HandleReloadConfigRequest changes what the server runs, so it is refused unless model management
is on and the caller is authorized, and its base paths lie inside the model roots
(server.api.control). It checks the whole config first (names, policies, labels, base paths):
an invalid one is INVALID_ARGUMENT and changes nothing. A valid one replaces the model list; the
call returns once every model it adds has an AVAILABLE version, or fails with UNKNOWN naming
the models that did not become available (they stay configured and keep being retried), as TF
Serving does. With --model-config-file-poll-wait-seconds on, the next change of the file wins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from protos.tensorflow_serving import get_model_status_pb2, model_management_pb2, model_service_pb2
from protos.tf.tensorflow.core.protobuf import error_codes_pb2
from server.api.admission import Admission, Call, ConcurrencyLimit, add_limited_handlers, grpc_call
from server.api.control import ControlPlane, grpc_credentials
from server.api.recording import Recorder
from server.api.status import parse
from server.api.tfserving.grpc_service import PROTOCOL, version_choice
from server.core.lifecycle import Lifecycle, check_sources
from server.core.model_config import ConfigError, from_proto
from server.core.servables import Registry
from server.errors import InvalidInput, NotFound, ReloadIncomplete, Unavailable

OK = error_codes_pb2.OK
SERVICE = model_service_pb2.DESCRIPTOR.services_by_name["ModelService"]


def model_status(registry: Registry, name: str, version: int | None, label: str | None) -> Any:
    """GetModelStatusResponse for a model: every version it knows, or the one asked for."""
    model = registry.model(name)
    if label is not None:
        version = registry.labelled_version(model, label)
    if version is None:
        servables = [model.versions[v] for v in sorted(model.versions)]
    elif version in model.versions:
        servables = [model.versions[version]]
    else:
        known = ", ".join(str(v) for v in sorted(model.versions)) or "none"
        raise NotFound(f"model '{name}' version {version} not found; versions known: {known}")
    response = get_model_status_pb2.GetModelStatusResponse()
    for servable in servables:
        status = response.model_version_status.add(version=servable.version, state=int(servable.state))
        status.status.error_code = servable.error[0] if servable.error else OK
        status.status.error_message = servable.error[1] if servable.error else servable.target_note()
    return response


class ModelServiceServicer(Admission):
    service_name = SERVICE.full_name

    def __init__(self, registry: Registry, lifecycle: Callable[[], Lifecycle | None],
                 control: Callable[[], ControlPlane]) -> None:
        """`lifecycle` returns None until the model worker has started; `control` says who may
        change the models, and where from (its roots are known once the start-up models are)."""
        super().__init__(Recorder(registry, PROTOCOL))
        self._registry = registry
        self._lifecycle = lifecycle
        self._control = control

    @grpc_call("GetModelStatus")
    async def get_model_status(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        request = parse(get_model_status_pb2.GetModelStatusRequest, raw)
        call.name = request.model_spec.name
        return model_status(self._registry, call.name, *version_choice(request.model_spec))

    @grpc_call("HandleReloadConfigRequest", traced=True)
    async def handle_reload_config_request(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        method = call.method
        control = self._control()
        caller = control.authorize(method, context.peer(), *grpc_credentials(
            context.invocation_metadata(), context.auth_context()))
        try:
            request = parse(model_management_pb2.ReloadConfigRequest, raw)
            try:
                sources = from_proto(request.config, "ReloadConfigRequest.config")
                control.check_paths(sources)
                check_sources(sources)
            except ConfigError as exc:
                raise InvalidInput(str(exc)) from None
            lifecycle = self._lifecycle()
            if lifecycle is None:
                raise Unavailable("the server is starting; retry shortly")
            problems = await lifecycle.apply(sources)
        except Exception as exc:
            control.done(caller, method, f"failed: {exc}")
            raise
        models = ", ".join(s.name for s in sources)
        if problems:
            control.done(caller, method, f"applied (models {models}); not available: {'; '.join(problems)}")
            raise ReloadIncomplete(f"{len(problems)} model(s) did not become available: {{{'; '.join(problems)}}}")
        control.done(caller, method, f"OK: serving models {models}")
        response = model_management_pb2.ReloadConfigResponse()
        response.status.error_code = OK
        return response


def add_to_server(servicer: ModelServiceServicer, server: grpc.aio.Server, limit: ConcurrencyLimit) -> None:
    """Register the ModelService methods, names taken from the service descriptor, each within the
    server's concurrency limit."""
    add_limited_handlers(server, SERVICE, {
        "GetModelStatus": (servicer.get_model_status, get_model_status_pb2.GetModelStatusResponse),
        "HandleReloadConfigRequest": (servicer.handle_reload_config_request,
                                      model_management_pb2.ReloadConfigResponse),
    }, servicer.recorder, limit)
