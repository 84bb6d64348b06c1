"""The model's own errors (server.errors.ModelError): TensorFlow's message cut to its first line
of its own words, and its code carried through to gRPC and HTTP; failures of ours stay INTERNAL."""

from __future__ import annotations

import grpc
import pytest

from server.api.status import http_status_for, status_for
from server.errors import ModelError, ModelFailure

GATHER = ('Graph execution error:\n\nDetected at node Gather defined at (most recent call last):\n  File '
          '"/tmp/m.py", line 9, in <module>\n\n  File "/tmp/m.py", line 7, in serve\n\nindices[1] = 7 is not in '
          '[0, 3)\n\t [[{{node Gather}}]] [Op:__inference_run_some_45]')
ASSERTION = ("Graph execution error:\n\nDetected at node assert_positive/Assert defined at (most recent call last):\n"
             "<stack traces unavailable>\nassertion failed: [inputs must be positive.  ] [x (x:0) = ] [[-1 -1]]\n"
             "\t [[{{node assert_positive/Assert}}]] [Op:__inference_run_some_45]")


TWO_REPLICAS = "\n".join([
    "Graph execution error:", "", "Detected at node Gather defined at (most recent call last):",
    "<stack traces unavailable>", "Detected at node Gather defined at (most recent call last):",
    "<stack traces unavailable>", "2 root error(s) found.",
    "  (0) INVALID_ARGUMENT:  indices[0] = 7 is not in [0, 3)", "\t [[{{node Gather}}]]",
    "\t [[replica_1/StatefulPartitionedCall/Identity/_18]]",
    "  (1) INVALID_ARGUMENT:  indices[0] = 7 is not in [0, 3)", "\t [[{{node Gather}}]]",
    "0 successful operations.", "0 derived errors ignored. [Op:__inference_run_some_242]"])


@pytest.mark.parametrize(("message", "text"), [
    (GATHER, "indices[1] = 7 is not in [0, 3)"),
    (TWO_REPLICAS, "indices[0] = 7 is not in [0, 3)"),
    (ASSERTION, "assertion failed: [inputs must be positive.  ] [x (x:0) = ] [[-1 -1]]"),
    ("a message of one line", "a message of one line"),
    ("", "the model failed"),
])
def test_tensorflows_own_words_are_kept_and_the_rest_dropped(message: str, text: str) -> None:
    assert str(ModelError.from_tensorflow(message, 3)) == text


def test_a_long_message_is_bounded() -> None:
    text = str(ModelError.from_tensorflow("x" * 5000, 3))
    assert len(text) == ModelError.MAX_CHARS + 4 and text.endswith(" ...")


@pytest.mark.parametrize(("code", "status", "http"), [
    (3, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (11, grpc.StatusCode.OUT_OF_RANGE, 400),
    (8, grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (9, grpc.StatusCode.FAILED_PRECONDITION, 400),
    (13, grpc.StatusCode.INTERNAL, 500),
    (0, grpc.StatusCode.INTERNAL, 500),  # never OK for a failure
    (99, grpc.StatusCode.INTERNAL, 500),
])
def test_the_code_is_tensorflows(code: int, status: grpc.StatusCode, http: int) -> None:
    error = ModelError("why", code)
    assert status_for(error) == (status, "why")
    assert http_status_for(error, status) == http


def test_a_failure_of_ours_stays_internal_and_unexplained() -> None:
    assert status_for(ModelFailure("output 'y' has 3 rows, expected 4")) == (grpc.StatusCode.INTERNAL, "internal error")
