"""tensorflow.serving.PredictionService over grpc.aio: Predict, Classify, Regress, MultiInference
and GetModelMetadata. It only translates: protos to plain types, the model spec to a servable
(server.core.servables), one call into the core (Predict's `infer`, the example methods through
server.api.tfserving.examples), plain types back to protos, and domain errors to status codes through
server.api.status's table."""

from __future__ import annotations

import logging
from typing import Any

import grpc

from protos.tensorflow_serving import (
    classification_pb2,
    get_model_metadata_pb2,
    inference_pb2,
    model_pb2,
    predict_pb2,
    prediction_service_pb2,
    regression_pb2,
    serialized_input_pb2,
)
from server.api import request_log, request_timing
from server.api import tensor_codec as codec
from server.api.admission import Admission, Call, ConcurrencyLimit, add_limited_handlers, deadline_of, grpc_call
from server.api.recording import Recorder
from server.api.request_log import RequestLogs
from server.api.status import parse
from server.api.tfserving import examples as tfs_examples
from server.api.tfserving.examples import ExampleCalls
from server.core.example_methods import CLASSIFY, REGRESS, combined
from server.core.inference import Inference, infer
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


def response_spec(servable: Servable, signature: str) -> Any:
    """The ModelSpec a response names for a version and signature, built once."""
    key = ("tfs-spec", signature)
    spec = servable.cache.get(key)
    if spec is None:
        spec = servable.cache[key] = model_pb2.ModelSpec(name=servable.name, signature_name=signature)
        spec.version.value = servable.version
    return spec


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

    service_name = SERVICE.full_name

    def __init__(self, registry: Registry, max_tensor_bytes: int, examples: ExampleCalls,
                 logs: RequestLogs | None = None, *, typed_outputs: bool = True) -> None:
        """`typed_outputs`: Predict's outputs in each dtype's typed field, as TF Serving answers
        (False: numbers in tensor_content, its --enable_serialization_as_tensor_content)."""
        super().__init__(Recorder(registry, PROTOCOL))
        self._typed = typed_outputs
        self._registry = registry
        self._max_tensor_bytes = max_tensor_bytes
        self._examples = examples
        self._logs = logs

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
        response = predict_pb2.PredictResponse(model_spec=response_spec(result.servable, result.signature))
        for output, array in result.outputs.items():
            codec.fill_tensor_proto(response.outputs[output], array, typed=self._typed)
        context.set_trailing_metadata(request_timing.trailers(call.answered(), call.trace_id))
        self._log(result.servable, result.signature, "predict_log", raw, response)
        return response

    async def _example_call(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call, method: str) -> Any:
        """Classify or Regress: the same request fields, a different signature and result."""
        deadline = deadline_of(context)
        request = parse(serialized_input_pb2.SerializedExamplesRequest, raw)
        spec = request.model_spec
        call.name = spec.name
        call.servable = servable = self._registry.resolve(spec.name, *version_choice(spec))
        result = await call.infer(self._examples.run(servable, method, request, deadline))
        spec = response_spec(result.servable, result.signature)
        if method == CLASSIFY:
            response, kind = tfs_examples.classification_response(result, spec), "classify_log"
        else:
            response, kind = tfs_examples.regression_response(result, spec), "regress_log"
        context.set_trailing_metadata(request_timing.trailers(call.answered(), call.trace_id))
        self._log(result.servable, result.signature, kind, raw, response)
        return response

    def _log(self, servable: Servable, signature: str, kind: str, raw: bytes, response: Any) -> None:
        """Log a sampled call, its request as the client's bytes (`kind`: its PredictionLog field)."""
        logger = None if self._logs is None else self._logs.sample(servable)
        if logger is not None:
            logger.put(request_log.call_record(servable, signature, logger.rate, kind, raw, response))

    @grpc_call("Classify", drained=True, counted=True)
    async def classify(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        return await self._example_call(raw, context, call, CLASSIFY)

    @grpc_call("Regress", drained=True, counted=True)
    async def regress(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        return await self._example_call(raw, context, call, REGRESS)

    @grpc_call("MultiInference", drained=True, counted=True)
    async def multi_inference(self, raw: bytes, context: grpc.aio.ServicerContext, call: Call) -> Any:
        deadline = deadline_of(context)
        request = parse(serialized_input_pb2.SerializedMultiInferenceRequest, raw)
        names = {task.model_spec.name for task in request.tasks}
        if "" in names:
            raise InvalidInput("Found ModelSpec with an empty model name.")
        if len(names) > 1:
            raise InvalidInput(f"All ModelSpecs in a MultiInferenceRequest must access the same model name; they "
                               f"name {', '.join(sorted(repr(n[:100]) for n in names)[:5])}")
        if not request.tasks:
            raise InvalidInput("the request has no tasks; MultiInference runs at least one")
        spec = request.tasks[0].model_spec
        call.name = spec.name
        call.servable = servable = self._registry.resolve(spec.name, *version_choice(spec))
        results: list[Inference] = []

        async def run() -> Inference:
            results.extend(await self._examples.multi_inference(servable, request, deadline))
            return combined(results)

        await call.infer(run())
        response = tfs_examples.multi_inference_response(results, [t.method_name for t in request.tasks],
                                                         response_spec)
        context.set_trailing_metadata(request_timing.trailers(call.answered(), call.trace_id))
        self._log(servable, results[0].signature, "multi_inference_log", raw, response)
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
        "Classify": (servicer.classify, classification_pb2.ClassificationResponse),
        "Regress": (servicer.regress, regression_pb2.RegressionResponse),
        "MultiInference": (servicer.multi_inference, inference_pb2.MultiInferenceResponse),
        "GetModelMetadata": (servicer.get_model_metadata, get_model_metadata_pb2.GetModelMetadataResponse),
    }, servicer.recorder, limit)
