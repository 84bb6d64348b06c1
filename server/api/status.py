"""The one table from domain errors to gRPC status codes, shared by every gRPC front-end.
Unexpected errors are logged with their stack and reach the client as INTERNAL "internal error",
never as str(exc)."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from server.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelFailure,
    NotFound,
    Overloaded,
    ServingError,
    Unavailable,
)

log = logging.getLogger("server.api.tfs")

STATUS_FOR: dict[type[ServingError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    ModelFailure: grpc.StatusCode.INTERNAL,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and client-visible message for an exception raised below a servicer."""
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
