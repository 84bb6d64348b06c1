"""Domain errors raised below the servicer. No gRPC here: the servicer owns the one table
that maps each class to a status code, so every layer raises the same way."""

from __future__ import annotations

import re

_ROOT_ERROR = re.compile(r"^\s*\(\d+\) [A-Z_]+:\s*")
"""The head of one of several errors in TensorFlow's message: "  (0) INVALID_ARGUMENT:  "."""
_NOT_THE_ERROR = re.compile(r"Graph execution error|Detected at node|File |<stack traces|\[\[|\d+ root error|"
                            r"\d+ successful operations|\d+ derived errors")
"""Lines of TensorFlow's message around the error itself."""


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
    """Running the model failed for a reason of ours (its outputs cannot be split back, the model
    worker broke). The client sees only a generic message; details go to the log."""


class ModelError(ServingError):
    """The model refused a request: TensorFlow's own error, passed on to the client with its code
    and message as TF Serving passes a session's status on (an assertion or a gather out of range
    is INVALID_ARGUMENT, not a server error)."""

    MAX_CHARS = 1000
    """Of TensorFlow's message: its first line is what the client needs; no graph dump, no stack."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
        """A tensorflow.error.Code, which numbers the codes as gRPC does."""

    @classmethod
    def from_tensorflow(cls, message: str, code: int) -> ModelError:
        """From an OpError's message: "Graph execution error:", the "Detected at node ... defined
        at" block and its stack, the node annotations ("[[{{node X}}]]", "[Op:...]"), and with
        several replicas the "2 root error(s) found." header and each error's "(0) CODE:" dropped;
        the first line left is TensorFlow's own words ("indices[0] = 7 is not in [0, 3)")."""
        for line in message.splitlines():
            text = _ROOT_ERROR.sub("", line.split("\t [[")[0].split(" [Op:")[0]).strip()
            if text and not _NOT_THE_ERROR.match(text):
                break
        else:
            text = message.strip() or "the model failed"
        if len(text) > cls.MAX_CHARS:
            text = text[: cls.MAX_CHARS] + " ..."
        return cls(text, code)


class QueueFull(Overloaded):
    """A model's batching queue is full (UNAVAILABLE, REST 503 with Retry-After, as TF Serving and
    Triton answer it: clients' standard retry policies retry it)."""


class OverTarget(Overloaded):
    """Shed at arrival: at the present rate the model cannot meet its latency target, and this
    request's predicted time exceeds it (RESOURCE_EXHAUSTED, REST 503 with Retry-After)."""


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
