"""The one table from domain errors to gRPC status codes, shared by every front-end, and from
those codes to HTTP statuses for the REST ones (TensorFlow Serving's own mapping, so a REST client
sees what TF Serving would send). The model's own errors (ModelError) carry TensorFlow's code and
message through. Unexpected errors, and failures of ours around the model (ModelFailure), are
logged with their stack and reach the client as INTERNAL "internal error", never as str(exc)."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from server.errors import (
    ClientGone,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidInput,
    ModelError,
    ModelFailure,
    NotFound,
    Overloaded,
    OverTarget,
    PermissionDenied,
    QueueFull,
    ReloadIncomplete,
    ServingError,
    TooLarge,
    TooLargeInput,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    UnsupportedEncoding,
)

log = logging.getLogger("server.api.tfserving.grpc_service")

STATUS_FOR: dict[type[ServingError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    QueueFull: grpc.StatusCode.UNAVAILABLE,
    OverTarget: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    ModelFailure: grpc.StatusCode.INTERNAL,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    UnsupportedEncoding: grpc.StatusCode.INVALID_ARGUMENT,
    TooLargeInput: grpc.StatusCode.INVALID_ARGUMENT,
    ClientGone: grpc.StatusCode.CANCELLED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    ReloadIncomplete: grpc.StatusCode.UNKNOWN,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
}

_CODE = grpc.StatusCode
HTTP_STATUS_FOR: dict[grpc.StatusCode, int] = {
    _CODE.OK: 200, _CODE.CANCELLED: 499, _CODE.UNKNOWN: 500, _CODE.INVALID_ARGUMENT: 400,
    _CODE.DEADLINE_EXCEEDED: 504, _CODE.NOT_FOUND: 404, _CODE.ALREADY_EXISTS: 409, _CODE.PERMISSION_DENIED: 403,
    _CODE.RESOURCE_EXHAUSTED: 429, _CODE.FAILED_PRECONDITION: 400, _CODE.ABORTED: 409, _CODE.OUT_OF_RANGE: 400,
    _CODE.UNIMPLEMENTED: 501, _CODE.INTERNAL: 500, _CODE.UNAVAILABLE: 503, _CODE.DATA_LOSS: 500,
    _CODE.UNAUTHENTICATED: 401,
}
"""TensorFlow Serving's ToHTTPStatusCode (model_servers/http_rest_api_util)."""


def http_status_for(exc: BaseException, code: grpc.StatusCode) -> int:
    """The HTTP status of a failed REST request: the code's, except 413 for a body too large and
    415 for a body in an encoding the server does not decode."""
    if isinstance(exc, TooLarge):
        return 413
    if isinstance(exc, UnsupportedEncoding):
        return 415
    if isinstance(exc, OverTarget):
        return 503
    return HTTP_STATUS_FOR[code]


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and client-visible message for an exception raised below a servicer: the model's
    own errors with TensorFlow's code and message, as TF Serving answers them."""
    if isinstance(exc, ModelError):
        code = _BY_NUMBER.get(exc.code, grpc.StatusCode.INTERNAL)
        return (grpc.StatusCode.INTERNAL if code is grpc.StatusCode.OK else code), str(exc)
    if isinstance(exc, ModelFailure):
        log.error("model failure: %s", exc, exc_info=exc)
        return grpc.StatusCode.INTERNAL, "internal error"
    if isinstance(exc, ServingError):
        return STATUS_FOR[type(exc)], str(exc)
    log.error("unexpected error while serving a request", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error"


def parse(message_type: Any, raw: bytes) -> Any:
    """A request message from its raw bytes: handlers take bytes and parse them here, so a
    malformed message is INVALID_ARGUMENT naming the problem (grpc's deserializer says INTERNAL)."""
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        raise InvalidInput(f"the request is not a valid {message_type.DESCRIPTOR.full_name}: {exc}") from None
