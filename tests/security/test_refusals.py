"""Refusals say what they are and are counted: a burst over --max-concurrent-rpcs is
RESOURCE_EXHAUSTED (it came back CANCELLED: from grpc's maximum_concurrent_rpcs once, then from
grpc's queue of calls not yet picked up, which --grpc-max-pending-rpcs now sizes above the burst),
REST's 429 and gRPC's refusals appear in
mirrorserve_requests_total, and malformed versions and URLs are 400 / INVALID_ARGUMENT, logged as
refusals without a traceback."""

from __future__ import annotations

import asyncio
import collections
import http.client
import json
import socket
from urllib.parse import quote

import grpc
import numpy as np

from client.api import build_predict_request
from protos.tensorflow_serving import prediction_service_pb2_grpc
from tests.security.conftest import RSS_SLACK_MB, Attack

CHANNELS = 12
CALLS_PER_CHANNEL = 125  # 1,500 at once, over the test server's --max-concurrent-rpcs 256


async def burst(target: str) -> collections.Counter[str]:
    """1,500 calls at once from 12 clients, each on a connection of its own, already open (so
    each knows the server's stream limit: --grpc-max-concurrent-streams, 256)."""
    request = build_predict_request("str", {"s": np.array([b"x" * 20000] * 16, dtype=object)})
    channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CHANNELS)]
    try:
        stubs = [prediction_service_pb2_grpc.PredictionServiceStub(c) for c in channels]
        for stub in stubs:
            await stub.Predict(request, timeout=30)

        async def one(stub: prediction_service_pb2_grpc.PredictionServiceStub) -> str:
            try:
                await stub.Predict(request, timeout=30)
                return "OK"
            except grpc.aio.AioRpcError as exc:
                return str(exc.code().name)

        codes = await asyncio.gather(*(one(stub) for stub in stubs for _ in range(CALLS_PER_CHANNEL)))
    finally:
        for channel in channels:
            await channel.close()
    return collections.Counter(codes)


def refusals(server, protocol: str) -> float:  # type: ignore[no-untyped-def]
    return server.metric("mirrorserve_requests_total", protocol=protocol, code="RESOURCE_EXHAUSTED")


def test_a_burst_over_capacity_is_resource_exhausted_and_counted(attack_server, bystander) -> None:
    server = attack_server
    before = refusals(server, "tfserving")
    with Attack(server, bystander) as attack:
        codes = asyncio.run(burst(server.target))
    print(f"{CHANNELS * CALLS_PER_CHANNEL} calls at once: {dict(codes)}")
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes["RESOURCE_EXHAUSTED"] > 0, "the burst was not over capacity"
    assert refusals(server, "tfserving") - before >= codes["RESOURCE_EXHAUSTED"]  # the bystander's count too
    log = attack.log()
    assert "refused tfserving Predict (RESOURCE_EXHAUSTED, Overloaded) from ipv4:127.0.0.1:" in log
    assert "(--max-concurrent-rpcs); retry later" in log
    assert log.count("refused tfserving Predict (RESOURCE_EXHAUSTED, Overloaded)") <= 2, "one line, not a flood"
    assert attack.memory_returned() <= RSS_SLACK_MB
    assert server.process.poll() is None


def test_rest_over_capacity_is_429_and_counted(attack_server) -> None:
    """Hold 256 connections' requests open (their bodies never finish), then one more is 429."""
    server = attack_server
    before = refusals(server, "tfserving-rest")
    holders = []
    try:
        for _ in range(256):
            sock = socket.create_connection(("127.0.0.1", server.rest_port))
            sock.sendall(b"POST /v1/models/demo:predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            holders.append(sock)
        connection = http.client.HTTPConnection("127.0.0.1", server.rest_port, timeout=10)
        for _ in range(50):  # the holders' requests reach their handlers in a moment
            connection.request("POST", "/v1/models/demo:predict", body=b'{"instances": [[0,0,0,0,0,0,0,0]]}')
            answer = connection.getresponse()
            body = answer.read()
            if answer.status == 429:
                break
            connection.close()
        assert answer.status == 429, (answer.status, body)
        assert "(--max-concurrent-rpcs); retry later" in json.loads(body)["error"]
    finally:
        for sock in holders:
            sock.close()
    assert refusals(server, "tfserving-rest") - before >= 1
    assert server.metric("mirrorserve_requests_total", protocol="tfserving-rest", model="", method="Predict",
                         code="RESOURCE_EXHAUSTED") >= 1


def model_metadata_request(name: str, version: str) -> bytes:
    """inference.ModelMetadataRequest {name = 1; version = 2}, in protobuf's wire format."""
    def field(number: int, text: str) -> bytes:
        data = text.encode()
        length, varint = len(data), b""
        while True:
            varint += bytes([(length & 0x7F) | (0x80 if length > 0x7F else 0)])
            length >>= 7
            if not length:
                return bytes([number << 3 | 2]) + varint + data
    return field(1, name) + field(2, version)


def get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def test_versions_are_ascii_digits_up_to_int64(attack_server) -> None:
    server = attack_server
    for version in ("9" * 5000, "\u0661", "9223372036854775808", "-1", "1e3"):
        for path in (f"/v1/models/demo/versions/{quote(version)}", f"/v2/models/demo/versions/{quote(version)}"):
            status, body = get(server.rest_port, path)
            assert status == 400, (path[:60], status, body[:200])
            assert b"is not a version number" in body
    assert get(server.rest_port, "/v1/models/demo/versions/1")[0] == 200
    assert get(server.rest_port, "/v1/models/demo/versions/9223372036854775807")[0] == 404
    with grpc.insecure_channel(server.target) as channel:
        # By hand: the suite imports tritonclient's protos, which our generated ones would clash with.
        metadata = channel.unary_unary("/inference.GRPCInferenceService/ModelMetadata")
        for version in ("9" * 5000, "\u0661"):
            try:
                metadata(model_metadata_request("demo", version), timeout=10)
                raise AssertionError("accepted")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
    assert "Traceback" not in server.log()


def test_a_huge_url_is_refused_counted_and_logged_without_a_traceback(attack_server) -> None:
    server = attack_server
    offset = len(server.log())
    before = server.metric("mirrorserve_requests_total", protocol="http", code="INVALID_ARGUMENT")
    with socket.create_connection(("127.0.0.1", server.rest_port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models/" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = sock.recv(65536)
    assert answer.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), answer[:100]
    assert server.metric("mirrorserve_requests_total", protocol="http", code="INVALID_ARGUMENT") == before + 1
    log = server.log()[offset:]
    assert "refused http request (INVALID_ARGUMENT) from 127.0.0.1" in log
    assert "LineTooLong" in log or "BadStatusLine" in log or "BadHttpMessage" in log, log[-2000:]
    assert "Traceback" not in log and "ERROR" not in log
