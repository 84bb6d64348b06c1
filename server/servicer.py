"""tensorflow.serving.PredictionService over grpc.aio. It only translates: protos to plain
types, one call into the Predictor, plain types back to protos, and domain errors to status codes
through the one table below. Unexpected errors are logged with their stack and reach the client
as INTERNAL "internal error", never as str(exc)."""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc

from protos.tensorflow_serving import get_model_metadata_pb2, predict_pb2, prediction_service_pb2_grpc
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


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, predictor: Predictor, max_tensor_bytes: int, signature_defs: dict[str, Any]) -> None:
        self._predictor = predictor
        self._max_tensor_bytes = max_tensor_bytes
        self._signature_defs = signature_defs

    async def Predict(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        model = self._predictor.model
        try:
            spec = request.model_spec
            self._predictor.check_model(spec.name, *_version_choice(spec))
            signature = self._predictor.signature(spec.signature_name)
            inputs = {
                name: codec.to_ndarray(tensor, name=name, max_bytes=self._max_tensor_bytes)
                for name, tensor in request.inputs.items()
            }
            outputs = await self._predictor.predict(signature, inputs, request.output_filter)
            response = predict_pb2.PredictResponse()
            response.model_spec.name = model.name
            response.model_spec.version.value = model.version
            response.model_spec.signature_name = signature.name
            for name, array in outputs.items():
                response.outputs[name].CopyFrom(codec.to_tensor_proto(array))
        except Exception as exc:  # every failure leaves through the status table
            code, message = status_for(exc)
            self._record("Predict", code, started)
            await context.abort(code, message)
        self._record("Predict", grpc.StatusCode.OK, started)
        return response

    async def GetModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        model = self._predictor.model
        try:
            spec = request.model_spec
            self._predictor.check_model(spec.name, *_version_choice(spec))
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

    def _record(self, method: str, code: grpc.StatusCode, started: float) -> None:
        name = self._predictor.model.name
        metrics.REQUESTS.labels(name, method, code.name).inc()
        metrics.REQUEST_SECONDS.labels(name, method).observe(time.perf_counter() - started)
