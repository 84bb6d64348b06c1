"""Domain errors raised below the servicer. No gRPC here: the servicer owns the one table
that maps each class to a status code, so every layer raises the same way."""

from __future__ import annotations


class ServingError(Exception):
    """Base class; the message is safe to show to the client."""


class InvalidInput(ServingError):
    """The request is malformed or does not match the signature."""


class NotFound(ServingError):
    """Unknown model or version."""


class Overloaded(ServingError):
    """The queue bound would be exceeded; the client may retry later."""


class DeadlineExceeded(ServingError):
    """The client's deadline passed before the work could be done."""


class Unavailable(ServingError):
    """The server is not ready, or is draining."""


class ModelFailure(ServingError):
    """The model itself failed. The client sees only a generic message; details go to the log."""


class QueueFull(Overloaded):
    """A model's batching queue is full (UNAVAILABLE, REST 503 with Retry-After, as TF Serving and
    Triton answer it: clients' standard retry policies retry it)."""


class TooLarge(Overloaded):
    """The request is bigger than the server accepts (an HTTP body over --max-message-bytes)."""


class Unimplemented(ServingError):
    """A method of a protocol that this server does not serve."""


class ClientGone(ServingError):
    """The client went away while its request was being read (CANCELLED; nobody to answer)."""


class TooLargeInput(InvalidInput):
    """A tensor that would decode past --max-message-bytes (INVALID_ARGUMENT, as a shape that cannot
    be served; a refusal all the same, and logged as one)."""


class UnsupportedEncoding(InvalidInput):
    """An HTTP body in a Content-Encoding the server does not decode (HTTP 415)."""


class PermissionDenied(ServingError):
    """The call changes what the server runs, and that is switched off or not this caller's to do."""


class Unauthenticated(ServingError):
    """The call needs a credential (an admin token or a client certificate) and carries none that is valid."""


class ReloadIncomplete(ServingError):
    """A model config was applied but some of its models did not become available (UNKNOWN, as
    TF Serving answers HandleReloadConfigRequest then)."""


class FailedPrecondition(ServingError):
    """The server is not set up for the call (model control off), or what it names cannot be
    served as it is (a repository folder that holds no loadable version)."""
