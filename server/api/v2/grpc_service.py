"""inference.GRPCInferenceService (the Open Inference Protocol, KServe v2) over grpc.aio. Like
the TF Serving front-end it only translates: the request to a servable (server.core.servables),
a signature and named arrays, one call into the same Predictor (so v2 and TF Serving requests of a
model share its batches), and the outputs back as raw_output_contents.

One signature per model is exposed: serving_default, or the one a request names with the string
parameter `signature_name`. Versions are the protocol's strings: empty for the highest available.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format

from protos.inference import grpc_service_pb2 as pb
from server.api import request_timing
from server.api.admission import Admission, Call, ConcurrencyLimit, add_limited_handlers, deadline_of, grpc_call
from server.api.control import ControlPlane, grpc_credentials
from server.api.recording import Recorder
from server.api.status import parse
from server.api.v2 import codec as v2_codec
from server.api.v2 import model as v2_model
from server.api.v2 import triton_model
from server.config import server_version
from server.core.inference import infer
from server.core.repository import Repository
from server.core.servables import Registry, Servable
from server.core.statistics import PeerStatistics
from server.errors import InvalidInput

PROTOCOL = "v2"
SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]

class V2Servicer(Admission):
    service_name = SERVICE.full_name

    def __init__(self, registry: Registry, max_tensor_bytes: int, ready: Callable[[], bool],
                 repository: Repository, control: Callable[[], ControlPlane],
                 peers: PeerStatistics | None = None) -> None:
        """`ready` says whether the server as a whole is ready (every start-up model serves and
        no drain has begun), as health does; `control` who may load and unload models; `peers`
        the other front-end processes' statistics."""
        self._peers = peers
        super().__init__(Recorder(registry, PROTOCOL))
        self._registry = registry
        self._max_tensor_bytes = max_tensor_bytes
        self._ready = ready
        self._repository = repository
        self._control = control
        self._metadata = pb.ServerMetadataResponse(name=v2_model.SERVER_NAME, version=server_version(),
                                                   extensions=triton_model.EXTENSIONS[1:])

    async def server_live(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=self._ready() and not self._refusing)

    async def server_metadata(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return self._metadata

    def _resolve(self, call: Call, name: str, version: str) -> Servable:
        """The version a model call addresses (the highest available when `version` is empty)."""
        call.name = name
        call.servable = self._registry.resolve(name, v2_model.parse_version(version, "version"))
        return call.servable

    @grpc_call("ModelReady")
    async def model_ready(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        """Ready or not; only a malformed request is an error (an unknown model is not ready)."""
        request = parse(pb.ModelReadyRequest, raw)
        ready = v2_model.is_ready(self._registry, request.name, request.version) and not self._refusing
        return pb.ModelReadyResponse(ready=ready)

    @grpc_call("ModelMetadata")
    async def model_metadata(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        request = parse(pb.ModelMetadataRequest, raw)
        servable = self._resolve(call, request.name, request.version)
        return json_format.ParseDict(v2_model.metadata(self._registry, servable), pb.ModelMetadataResponse())

    @grpc_call("ModelInfer", drained=True, counted=True)
    async def model_infer(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        deadline = deadline_of(context)
        request = parse(pb.ModelInferRequest, raw)
        call.name = request.model_name
        call.servable = servable = self._registry.resolve(request.model_name, v2_model.parse_version(
            request.model_version, "model_version"))
        signature = _signature_name(request.parameters)
        result = await call.infer(infer(servable, signature, self._inputs(request), [o.name for o in request.outputs],
                                        deadline))
        response = pb.ModelInferResponse(model_name=servable.name, model_version=str(servable.version), id=request.id)
        for output, array in result.outputs.items():
            datatype, data = v2_codec.encode_raw(array)
            response.outputs.add(name=output, datatype=datatype, shape=array.shape)
            response.raw_output_contents.append(data)
        for name, value in request_timing.v2_parameters(result).items():
            response.parameters[name].int64_param = value
        context.set_trailing_metadata(request_timing.trailers(call.answered(), call.trace_id))
        return response

    @grpc_call("ModelConfig")
    async def model_config(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        request = parse(pb.ModelConfigRequest, raw)
        servable = self._resolve(call, request.name, request.version)
        response = pb.ModelConfigResponse()
        json_format.ParseDict(triton_model.config(self._registry, servable), response.config)
        return response

    @grpc_call("ModelStatistics")
    async def model_statistics(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        request = parse(pb.ModelStatisticsRequest, raw)
        call.name = request.name
        found = await triton_model.statistics(self._registry, request.name, request.version, self._peers)
        return json_format.ParseDict(found, pb.ModelStatisticsResponse())

    @grpc_call("RepositoryIndex")
    async def repository_index(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        request = parse(pb.RepositoryIndexRequest, raw)
        _no_repository_name(request.repository_name)
        return json_format.ParseDict({"models": triton_model.index(self._repository, request.ready)},
                                     pb.RepositoryIndexResponse())

    @grpc_call("RepositoryModelLoad", traced=True)
    async def repository_model_load(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        await self._change(pb.RepositoryModelLoadRequest, raw, context, call, lambda name, parameters:
                           triton_model.load(self._repository, self._control(), name, parameters))
        return pb.RepositoryModelLoadResponse()

    @grpc_call("RepositoryModelUnload", traced=True)
    async def repository_model_unload(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        await self._change(pb.RepositoryModelUnloadRequest, raw, context, call, lambda name, parameters:
                           triton_model.unload(self._repository, name, parameters))
        return pb.RepositoryModelUnloadResponse()

    async def _change(self, message: Any, raw: bytes, context: grpc.aio.ServicerContext, call: Call,
                      work: Callable[[str, dict[str, Any]], Awaitable[None]]) -> None:
        """A call that changes the served models: authorized first (server.api.control), logged
        with its outcome."""
        control = self._control()
        caller = control.authorize(call.method, context.peer(), *grpc_credentials(
            context.invocation_metadata(), context.auth_context()))
        try:
            request = parse(message, raw)
            call.name = request.model_name
            _no_repository_name(request.repository_name)
            await work(call.name, {k: _parameter_value(v) for k, v in request.parameters.items()})
        except Exception as exc:
            control.done(caller, call.method, f"failed: {exc}")
            raise
        control.done(caller, call.method, f"OK: model {call.name}")

    def _inputs(self, request: Any) -> dict[str, Any]:
        raws = request.raw_input_contents
        if raws and len(raws) != len(request.inputs):
            raise InvalidInput(f"raw_input_contents has {len(raws)} entries for {len(request.inputs)} inputs; "
                               f"send one per input, in the order of inputs")
        inputs = {}
        for index, tensor in enumerate(request.inputs):
            if tensor.name in inputs:
                raise InvalidInput(f"input '{tensor.name}' is given twice")
            typed = {f.name: v for f, v in tensor.contents.ListFields()} if tensor.HasField("contents") else {}
            if raws:
                if typed:
                    raise InvalidInput(f"input '{tensor.name}' has typed contents and raw_input_contents is "
                                       f"used too; send all inputs one way")
                inputs[tensor.name] = v2_codec.decode_raw(tensor.name, tensor.datatype, tensor.shape, raws[index],
                                                          self._max_tensor_bytes)
            else:
                inputs[tensor.name] = v2_codec.decode_contents(tensor.name, tensor.datatype, tensor.shape, typed,
                                                               self._max_tensor_bytes)
        return inputs


def _no_repository_name(name: str) -> None:
    if name:
        raise InvalidInput(f"repository_name '{name[:80]}': this server has one model repository; leave it empty")


def _parameter_value(parameter: Any) -> Any:
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


def _signature_name(parameters: Any) -> str:
    if v2_model.SIGNATURE_PARAMETER not in parameters:
        return ""
    value = parameters[v2_model.SIGNATURE_PARAMETER]
    if value.WhichOneof("parameter_choice") != "string_param":
        raise InvalidInput(f"parameter '{v2_model.SIGNATURE_PARAMETER}' must be a string")
    return str(value.string_param)


def add_to_server(servicer: V2Servicer, server: grpc.aio.Server, limit: ConcurrencyLimit) -> None:
    """Register the GRPCInferenceService methods, names taken from the service descriptor, each
    within the server's concurrency limit."""
    add_limited_handlers(server, SERVICE, {
        "ServerLive": (servicer.server_live, pb.ServerLiveResponse),
        "ServerReady": (servicer.server_ready, pb.ServerReadyResponse),
        "ModelReady": (servicer.model_ready, pb.ModelReadyResponse),
        "ServerMetadata": (servicer.server_metadata, pb.ServerMetadataResponse),
        "ModelMetadata": (servicer.model_metadata, pb.ModelMetadataResponse),
        "ModelInfer": (servicer.model_infer, pb.ModelInferResponse),
        "ModelConfig": (servicer.model_config, pb.ModelConfigResponse),
        "ModelStatistics": (servicer.model_statistics, pb.ModelStatisticsResponse),
        "RepositoryIndex": (servicer.repository_index, pb.RepositoryIndexResponse),
        "RepositoryModelLoad": (servicer.repository_model_load, pb.RepositoryModelLoadResponse),
        "RepositoryModelUnload": (servicer.repository_model_unload, pb.RepositoryModelUnloadResponse),
    }, servicer.recorder, limit)

