"""tensorflow.serving.PredictionService over grpc.aio. It only translates: protos to plain
types, the model spec to a servable (server.core.servables), one call into its Predictor, plain types
back to protos, and domain errors to status codes through server.api.status's table."""

from __future__ import annotations

import logging
from typing import Any

import grpc

from protos.tensorflow_serving import get_model_metadata_pb2, model_pb2, predict_pb2, prediction_service_pb2
from server import codec
from server.api import request_log, request_timing
from server.api.admission import Admission, Call, ConcurrencyLimit, add_limited_handlers, deadline_of, grpc_call
from server.api.recording import Recorder
from server.api.request_log import RequestLogs
from server.api.status import parse
from server.core.inference import infer
from server.core.servables import Registry, Servable
from server.errors import InvalidInput

log = logging.getLogger(__name__)

SERVICE = prediction_service_pb2.DESCRIPTOR.services_by_name["PredictionService"]
PROTOCOL = "tfserving"
"""The protocol label of this front-end's request metrics."""
SIGNATURE_DEF = "signature_def"


def version_choice(spec: Any) -> tuple[int | None, str | None]:
    """A ModelSpec's (version, label), either or neither set."""
    choice = spec.WhichOneof("version_choice")
    if choice == "version":
        return int(spec.version.value), None
    if choice == "version_label":
        return None, str(spec.version_label)
    return None, None


def signature_def_map(servable: Servable) -> Any:
    """The version's SignatureDefMap, what GetModelMetadata returns under signature_def."""
    signature_map = get_model_metadata_pb2.SignatureDefMap()
    for signature_name, definition in servable.signature_defs.items():
        sdef = signature_map.signature_def[signature_name]
        for protos, infos in ((sdef.inputs, definition.inputs), (sdef.outputs, definition.outputs)):
            for key, info in infos.items():
                proto = protos[key]
                proto.name = info.name
                proto.dtype = info.dtype
                proto.tensor_shape.SetInParent()
                if info.dims is None:
                    proto.tensor_shape.unknown_rank = True
                for size, name in info.dims or ():
                    proto.tensor_shape.dim.add(size=size, name=name)
        sdef.method_name = definition.method_name
    return signature_map


class PredictionServicer(Admission):
    """Answers from whichever version the registry resolves a request to; UNAVAILABLE while a
    model loads, NOT_FOUND for what is not served.

    Handlers take the raw request bytes and parse them here, so a malformed message is an
    INVALID_ARGUMENT naming the problem (grpc's own deserializer would answer INTERNAL). Predict
    calls are counted for the drain (server.api.admission).
    """

    def __init__(self, registry: Registry, max_tensor_bytes: int, logs: RequestLogs | None = None) -> None:
        super().__init__(Recorder(registry, PROTOCOL))
        self._registry = registry
        self._max_tensor_bytes = max_tensor_bytes
        self._logs = logs

    @staticmethod
    def _model_spec(servable: Servable, signature: str) -> Any:
        """The response's ModelSpec for a version and signature, built once."""
        key = ("tfs-spec", signature)
        spec = servable.cache.get(key)
        if spec is None:
            spec = servable.cache[key] = model_pb2.ModelSpec(name=servable.name, signature_name=signature)
            spec.version.value = servable.version
        return spec

    @grpc_call("Predict", drained=True, counted=True)
    async def predict(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        deadline = deadline_of(context)
        request = parse(predict_pb2.PredictRequest, raw)
        spec = request.model_spec
        call.name = spec.name
        call.servable = servable = self._registry.resolve(spec.name, *version_choice(spec))
        inputs = {name: codec.to_ndarray(tensor, name=name, max_bytes=self._max_tensor_bytes)
                  for name, tensor in request.inputs.items()}
        result = await call.infer(infer(servable, spec.signature_name, inputs, request.output_filter, deadline))
        response = predict_pb2.PredictResponse(model_spec=self._model_spec(result.servable, result.signature))
        for output, array in result.outputs.items():
            codec.fill_tensor_proto(response.outputs[output], array)
        context.set_trailing_metadata(request_timing.trailers(call.answered()))
        logger = None if self._logs is None else self._logs.sample(result.servable)
        if logger is not None:
            logger.put(request_log.predict_record(result.servable, result.signature, logger.rate, request, response))
        return response

    @grpc_call("GetModelMetadata", drained=True)
    async def get_model_metadata(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        request = parse(get_model_metadata_pb2.GetModelMetadataRequest, raw)
        spec = request.model_spec
        call.name = spec.name
        call.servable = servable = self._registry.resolve(spec.name, *version_choice(spec))
        fields = list(request.metadata_field)
        if not fields:
            raise InvalidInput(f"metadata_field is empty; supported: {SIGNATURE_DEF}")
        unknown = sorted(set(fields) - {SIGNATURE_DEF})
        if unknown:
            raise InvalidInput(f"metadata_field {', '.join(unknown)} is not supported; supported: {SIGNATURE_DEF}")
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        response.model_spec.name = servable.name
        response.model_spec.version.value = servable.version
        # Deterministic: the maps in key order, the same bytes from every process.
        response.metadata[SIGNATURE_DEF].Pack(signature_def_map(servable), deterministic=True)
        return response


def add_to_server(servicer: PredictionServicer, server: grpc.aio.Server, limit: ConcurrencyLimit) -> None:
    """Register the PredictionService methods, names taken from the service descriptor, each
    within the server's concurrency limit."""
    add_limited_handlers(server, SERVICE, {
        "Predict": (servicer.predict, predict_pb2.PredictResponse),
        "GetModelMetadata": (servicer.get_model_metadata, get_model_metadata_pb2.GetModelMetadataResponse),
    }, servicer.recorder, limit)
