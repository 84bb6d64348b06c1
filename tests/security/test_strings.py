"""Long strings, many strings and string fills, against a string model: before issue 30 one 4 MiB
string over REST (or 64 rows of 8 KB over gRPC) filled the worker's socket, the server took the
full socket for a dead worker and exited; and one 1 MB value filling [4096] took 5 GB."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import grpc

from protos.tensorflow_serving import predict_pb2, prediction_service_pb2_grpc
from tests.security.conftest import RSS_SLACK_MB, Attack, Bystander, assert_unharmed, post, rss_mb, worker_pid

MIB = 1 << 20
DT_STRING = 7


def string_request(values: list[bytes], shape: int | None = None) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "str"
    tensor = request.inputs["s"]
    tensor.dtype = DT_STRING
    tensor.tensor_shape.dim.add(size=len(values) if shape is None else shape)
    tensor.string_val.extend(values)
    return request


def big_channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 256 * MIB),
                                                  ("grpc.max_receive_message_length", 256 * MIB)])


def grpc_strings(target: str, values: list[bytes]) -> tuple[str, object]:
    with big_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        try:
            response = stub.Predict(string_request(values), timeout=60)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()
    lengths = list(response.outputs["n"].int_val)  # as TF Serving's clients read
    upper = list(response.outputs["upper"].string_val)
    return "OK", (lengths, upper)


def rest_strings(rest_url: str, values: list[str]) -> tuple[int, object]:
    body = json.dumps({"instances": values}).encode()
    request = urllib.request.Request(f"{rest_url}/v1/models/str:predict", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (ConnectionResetError, BrokenPipeError, urllib.error.URLError) as exc:
        return 0, str(exc)  # the server refused and closed before the whole body was sent


def test_long_strings_are_answered_whole(attack_server) -> None:
    """What killed the server before: strings far bigger than the worker's socket buffer, each way."""
    server = attack_server
    code, answer = grpc_strings(server.target, [b"a" * (24 * MIB), b"b" * (24 * MIB)])
    assert code == "OK", answer
    assert answer == ([24 * MIB] * 2, [b"A" * (24 * MIB), b"B" * (24 * MIB)])  # type: ignore[comparison-overlap]
    code, answer = grpc_strings(server.target, [b"x" * 8192] * 64)
    assert code == "OK" and answer == ([8192] * 64, [b"X" * 8192] * 64), code  # type: ignore[comparison-overlap]
    status, body = rest_strings(server.rest_url, ["a" * (4 * MIB)])
    assert status == 200 and body["predictions"] == [{"n": 4 * MIB, "upper": "A" * (4 * MIB)}], status
    assert server.process.poll() is None


SIXTY_FOUR_MIB_P99_FACTOR = 6.0
"""The bystander's p99 against its baseline while 64 MiB strings are refused, instead of 3x: the
refusal itself is cheap, but the kernel and grpc's transport threads still take in what the
client sends before the stream is refused (gRPC) or the connection closed (REST), 128 MB a round
on the two cores the attacker and the bystander share. Measured: 2.5-5.1x (6-11 ms against 2)."""


def test_64_mib_strings_over_grpc_and_rest_are_refused_as_too_large(attack_server, bystander: Bystander) -> None:
    server = attack_server
    worker = worker_pid(server)
    worker_before = rss_mb(worker)
    # Built once, before the attack, so that the attacker's own work is sending, not building.
    message = string_request([b"a" * (64 * MIB)]).SerializeToString()
    body = json.dumps({"instances": ["a" * (64 * MIB)]}).encode()
    codes: list[object] = []
    with Attack(server, bystander) as attack, big_channel(server.target) as channel:
        predict = channel.unary_unary("/tensorflow.serving.PredictionService/Predict")
        while time.monotonic() - attack.started < 1.5:
            time.sleep(0.1)  # one attack request at a time, not a flood of them (test_refusals has floods)
            try:
                predict(message, timeout=30)
                code: object = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            assert code == "RESOURCE_EXHAUSTED", code
            status, answer = post(server.rest_port, "/v1/models/str:predict", body, {})
            assert status in (413, 0), (status, answer)  # 0: refused and closed before the body was all sent
            if status == 413:
                assert b"the limit is 67108864 (--max-message-bytes)" in answer
            codes += [code, status]
    print(f"{len(codes) // 2} rounds of a 64 MiB string over gRPC and REST: {set(codes)}")
    assert_unharmed(attack, p99_factor=SIXTY_FOUR_MIB_P99_FACTOR)
    assert attack.memory_returned() <= RSS_SLACK_MB
    grown = rss_mb(worker) - worker_before
    print(f"model worker RSS {grown:+.0f} MB")
    assert grown <= RSS_SLACK_MB


HUNDRED_RSS_BOUND_MB = 200.0
"""What the server's RSS may keep after serving 100 MiB of strings, instead of 50 MB: measured over
8 rounds of this attack, it kept 20-130 MB after each (not growing from round to round), with
malloc_trim run every 5 s and no Python garbage to collect: buffers grpc's transport keeps."""
HUNDRED_P99_BOUND_MS = 500.0
"""The bystander's p99 while 100 MiB of strings are served (not refused: they are within every
limit), instead of 3x its baseline: moving 100 MiB through the client, the server, the model and
back takes both of this machine's cores for about a second, one of them the attacking client's
own. Measured after the worker began running different models' batches side by side (before,
the bystander's batch waited behind the strings' batches: 400-490 ms): 180-240 ms."""


def test_a_hundred_concurrent_one_mib_strings(attack_server, bystander: Bystander) -> None:
    server = attack_server
    with Attack(server, bystander) as attack, concurrent.futures.ThreadPoolExecutor(100) as pool:
        results = list(pool.map(lambda i: grpc_strings(server.target, [bytes([65 + i % 26]) * MIB]), range(100)))
    for i, (code, answer) in enumerate(results):
        if code == "OK":
            letter = bytes([65 + i % 26])
            assert answer == ([MIB], [letter * MIB]), i  # type: ignore[comparison-overlap]
        else:
            assert code == "RESOURCE_EXHAUSTED", (code, answer)
    print(f"{sum(code == 'OK' for code, _ in results)} of 100 answered")
    verdict = assert_unharmed(attack, p99_factor=float("inf"))
    assert verdict.p99_ms <= HUNDRED_P99_BOUND_MS, verdict
    kept = attack.memory_returned()
    print(f"server RSS {kept:+.0f} MB after the attack")
    assert kept <= HUNDRED_RSS_BOUND_MB


def test_a_string_fill_past_the_limit_is_refused_before_it_is_built(attack_server, bystander: Bystander) -> None:
    server = attack_server
    worker = worker_pid(server)
    worker_before = rss_mb(worker)
    refused_before = server.metric("mirrorserve_requests_total", model="str", code="INVALID_ARGUMENT")
    rounds = 0
    with Attack(server, bystander) as attack:
        while time.monotonic() - attack.started < 1.5:
            time.sleep(0.02)  # one attack request at a time, not a flood of them (test_refusals has floods)
            started = time.monotonic()
            code, details = grpc_strings_fill(server.target, b"a" * MIB, 4096)
            assert time.monotonic() - started < 2.0
            assert code == "INVALID_ARGUMENT", (code, details)
            assert f"({4096 * (MIB + 41)} bytes decoded); the limit is {64 * MIB}" in str(details), details
            rounds += 1
    print(f"{rounds} fills of 1 MiB into [4096] refused")
    assert_unharmed(attack)
    assert attack.memory_returned() <= RSS_SLACK_MB
    assert rss_mb(worker) - worker_before <= RSS_SLACK_MB
    after = server.metric("mirrorserve_requests_total", model="str", code="INVALID_ARGUMENT")
    assert after == refused_before + rounds
    assert "refused tfserving Predict (INVALID_ARGUMENT, TooLargeInput) from ipv4:127.0.0.1:" in attack.log()


def grpc_strings_fill(target: str, value: bytes, count: int) -> tuple[str, object]:
    with big_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        try:
            stub.Predict(string_request([value], shape=count), timeout=30)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()
    return "OK", None
