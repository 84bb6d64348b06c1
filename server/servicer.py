"""tensorflow.serving.PredictionService over grpc.aio. It only translates: protos to plain
types, one call into the Predictor, plain types back to protos, and domain errors to status codes
through the one table below. Unexpected errors are logged with their stack and reach the client
as INTERNAL "internal error", never as str(exc)."""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from protos.tensorflow_serving import get_model_metadata_pb2, model_pb2, predict_pb2, prediction_service_pb2
from server import codec, metrics
from server.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelFailure,
    NotFound,
    Overloaded,
    ServingError,
    Unavailable,
)
from server.prediction import Predictor

log = logging.getLogger(__name__)

STATUS_FOR: dict[type[ServingError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    ModelFailure: grpc.StatusCode.INTERNAL,
}
SIGNATURE_DEF = "signature_def"
QUEUE_TRAILER = "mirrorserve-queue-seconds"
COMPUTE_TRAILER = "mirrorserve-compute-seconds"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and client-visible message for an exception raised below the servicer."""
    if isinstance(exc, ModelFailure):
        log.error("model failure: %s", exc, exc_info=exc)
        return grpc.StatusCode.INTERNAL, "internal error"
    if isinstance(exc, ServingError):
        return STATUS_FOR[type(exc)], str(exc)
    log.error("unexpected error while serving a request", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error"


def _version_choice(spec: Any) -> tuple[int | None, str | None]:
    choice = spec.WhichOneof("version_choice")
    if choice == "version":
        return int(spec.version.value), None
    if choice == "version_label":
        return None, str(spec.version_label)
    return None, None


class PredictionServicer:
    """Answers UNAVAILABLE until `ready()` hands it the loaded model's Predictor.

    Handlers take the raw request bytes and parse them here, so a malformed message is an
    INVALID_ARGUMENT naming the problem (grpc's own deserializer would answer INTERNAL).

    `accepted` and `answered` count Predict calls that reached the handler and that left it, so a
    drain can tell that nothing accepted was lost. After `refuse_new()` every new call is answered
    UNAVAILABLE at once and is not counted as accepted.
    """

    def __init__(self, model_name: str, max_tensor_bytes: int) -> None:
        self._model_name = model_name
        self._max_tensor_bytes = max_tensor_bytes
        self._predictor: Predictor | None = None
        self._signature_defs: dict[str, Any] = {}
        self._specs: dict[str, Any] = {}
        self._model_failures = metrics.MODEL_FAILURES.labels(model_name)
        self._seconds = {m: metrics.REQUEST_SECONDS.labels(model_name, m) for m in ("Predict", "GetModelMetadata")}
        methods = ("Predict", "GetModelMetadata")
        self._requests: dict[tuple[str, grpc.StatusCode], Any] = {
            (m, grpc.StatusCode.OK): metrics.REQUESTS.labels(model_name, m, "OK") for m in methods
        }
        self.accepted = 0
        self.answered = 0
        self._refusing = False

    @property
    def in_flight(self) -> int:
        return self.accepted - self.answered

    def refuse_new(self) -> None:
        self._refusing = True

    def ready(self, predictor: Predictor, signature_defs: dict[str, Any]) -> None:
        self._signature_defs = signature_defs
        self._specs = {}
        self._predictor = predictor

    def _model_spec(self, predictor: Predictor, signature: str) -> Any:
        """The response's ModelSpec for a signature, built once."""
        spec = self._specs.get(signature)
        if spec is None:
            spec = self._specs[signature] = model_pb2.ModelSpec(
                name=predictor.model.name, signature_name=signature)
            spec.version.value = predictor.model.version
        return spec

    def _loaded(self) -> Predictor:
        if self._predictor is None:
            raise Unavailable(f"model '{self._model_name}' is loading; retry shortly")
        return self._predictor

    async def predict(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        if self._refusing:
            await self._refuse("Predict", context, started)
        self.accepted += 1
        try:
            try:
                remaining = context.time_remaining()
                deadline = None if remaining is None else time.monotonic() + remaining
                request = _parse(predict_pb2.PredictRequest, raw)
                predictor = self._loaded()
                spec = request.model_spec
                predictor.check_model(spec.name, *_version_choice(spec))
                signature = predictor.signature(spec.signature_name)
                inputs = {
                    name: codec.to_ndarray(tensor, name=name, max_bytes=self._max_tensor_bytes)
                    for name, tensor in request.inputs.items()
                }
                answer = await predictor.predict(signature, inputs, request.output_filter, deadline)
                response = predict_pb2.PredictResponse(model_spec=self._model_spec(predictor, signature.name))
                for name, array in answer.outputs.items():
                    codec.fill_tensor_proto(response.outputs[name], array)
            except Exception as exc:  # every failure leaves through the status table
                if isinstance(exc, ModelFailure):
                    self._model_failures.inc()
                code, message = status_for(exc)
                self._record("Predict", code, started)
                await context.abort(code, message)
            context.set_trailing_metadata((
                (QUEUE_TRAILER, f"{answer.queue_seconds:.6f}"),
                (COMPUTE_TRAILER, f"{answer.compute_seconds:.6f}"),
            ))
            self._record("Predict", grpc.StatusCode.OK, started)
            return response
        finally:
            self.answered += 1

    async def get_model_metadata(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        if self._refusing:
            await self._refuse("GetModelMetadata", context, started)
        try:
            request = _parse(get_model_metadata_pb2.GetModelMetadataRequest, raw)
            predictor = self._loaded()
            model = predictor.model
            spec = request.model_spec
            predictor.check_model(spec.name, *_version_choice(spec))
            fields = list(request.metadata_field)
            if not fields:
                raise InvalidInput(f"metadata_field is empty; supported: {SIGNATURE_DEF}")
            unknown = sorted(set(fields) - {SIGNATURE_DEF})
            if unknown:
                raise InvalidInput(
                    f"metadata_field {', '.join(unknown)} is not supported; supported: {SIGNATURE_DEF}"
                )
            signature_map = get_model_metadata_pb2.SignatureDefMap()
            for name, sdef in self._signature_defs.items():
                signature_map.signature_def[name].CopyFrom(sdef)
            response = get_model_metadata_pb2.GetModelMetadataResponse()
            response.model_spec.name = model.name
            response.model_spec.version.value = model.version
            response.metadata[SIGNATURE_DEF].Pack(signature_map)
        except Exception as exc:
            code, message = status_for(exc)
            self._record("GetModelMetadata", code, started)
            await context.abort(code, message)
        self._record("GetModelMetadata", grpc.StatusCode.OK, started)
        return response

    async def _refuse(self, method: str, context: grpc.aio.ServicerContext, started: float) -> None:
        self._record(method, grpc.StatusCode.UNAVAILABLE, started)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")

    def _record(self, method: str, code: grpc.StatusCode, started: float) -> None:
        counter = self._requests.get((method, code))
        if counter is None:
            counter = self._requests[method, code] = metrics.REQUESTS.labels(self._model_name, method, code.name)
        counter.inc()
        self._seconds[method].observe(time.perf_counter() - started)


def _parse(message_type: Any, raw: bytes) -> Any:
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        raise InvalidInput(f"the request is not a valid {message_type.DESCRIPTOR.full_name}: {exc}") from None


def add_to_server(servicer: PredictionServicer, server: grpc.aio.Server) -> None:
    """Register the PredictionService methods, names taken from the service descriptor."""
    service = prediction_service_pb2.DESCRIPTOR.services_by_name["PredictionService"]
    handlers = {
        "Predict": grpc.unary_unary_rpc_method_handler(
            servicer.predict, response_serializer=predict_pb2.PredictResponse.SerializeToString),
        "GetModelMetadata": grpc.unary_unary_rpc_method_handler(
            servicer.get_model_metadata,
            response_serializer=get_model_metadata_pb2.GetModelMetadataResponse.SerializeToString),
    }
    assert set(handlers) == {m.name for m in service.methods}, "handlers and protos disagree"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
