"""Classify requests built to cost the server: thousands of examples that must each be checked
(the last one bad), more examples than could ever be queued, and a large context that the merge
would copy into every example. Each is refused with the reason, and the bystander's calls go on
within the usual bound: large checks run in the helper process, not on the event loop."""

from __future__ import annotations

import json
import time

import grpc

from protos.tensorflow_serving import serialized_input_pb2
from tests.integration.example_models import example
from tests.security.conftest import Attack, Bystander, assert_unharmed, post
from tests.security.test_strings import big_channel

MIB = 1 << 20


def classify_request(examples: list[bytes], context: bytes | None = None) -> bytes:
    """A serialized ClassificationRequest (built before an attack's window: building it is the
    attacker's cost, not the server's)."""
    request = serialized_input_pb2.SerializedExamplesRequest()
    request.model_spec.name = "classifier"
    holder = request.input.example_list if context is None else request.input.example_list_with_context
    holder.examples.extend(examples)
    if context is not None:
        request.input.example_list_with_context.context = context
    data: bytes = request.SerializeToString()
    return data


def classify(target: str, request: bytes) -> tuple[str, str]:
    with big_channel(target) as channel:
        stub = channel.unary_unary("/tensorflow.serving.PredictionService/Classify", request_serializer=None,
                                   response_deserializer=None)
        try:
            stub(request, timeout=60)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or ""
    return "OK", ""


P99_FACTOR = 4.5
"""The bystander's p99 against its baseline, instead of 3x: the loop's share of each attack request
stays about a millisecond, but checking thousands of examples keeps the helper process busy on one
of the two cores the attacker, the bystander, the server and the model worker share. Measured
here over eight runs of the first test and five of the second: 1.1-3.2x (3-6 ms against 2-3)."""
GOOD = example([1.0, 2.0], 3, ["a", "b"]).SerializeToString()
BAD = example(age=3).SerializeToString()


def test_thousands_of_examples_are_checked_off_the_loop(attack_server, bystander: Bystander) -> None:
    server = attack_server
    rounds = 0
    request = classify_request([GOOD] * 4000 + [BAD])
    with Attack(server, bystander) as attack:
        while time.monotonic() - attack.started < 2.0:
            code, details = classify(server.target, request)
            assert (code, details) == ("INVALID_ARGUMENT", "example 4000: feature 'x' is missing; the model "
                                                           "requires it (a float_list of 2 values)")
            rounds += 1
    print(f"{rounds} requests of 4,001 examples checked and refused")
    assert_unharmed(attack, p99_factor=P99_FACTOR)


def test_more_examples_than_could_be_queued_and_a_copied_context_are_refused_at_once(
        attack_server, bystander: Bystander) -> None:
    server = attack_server
    many = classify_request([GOOD] * 60_000)
    large_context = classify_request([b""] * 100, context=b"\x0a\x00" * (MIB // 2))
    body = json.dumps({"examples": [{"x": [1.0, 2.0]}] * 100_000}).encode()
    with Attack(server, bystander) as attack:
        started = time.monotonic()
        code, details = classify(server.target, many)
        assert code == "RESOURCE_EXHAUSTED" and "request has 60000 rows; at most 4096" in details, details
        code, details = classify(server.target, large_context)
        assert code == "INVALID_ARGUMENT" and "the examples merged with their context" in details, details
        status, answer = post(server.rest_port, "/v1/models/classifier:classify", body, {})
        assert status == 429 and b"request has 100000 examples; at most 4096" in answer, answer
        print(f"refused in {time.monotonic() - started:.2f} s")
        time.sleep(1.0)
    assert_unharmed(attack, p99_factor=P99_FACTOR)
