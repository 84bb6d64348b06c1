"""--grpc-max-connection-age-ms: the server closes a long-lived client connection (GOAWAY) and
the client re-establishes one, with no failed request; without the flag the connection stays."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import numpy as np

from client.api import build_predict_request
from protos.tensorflow_serving import predict_pb2, prediction_service_pb2_grpc
from tests.integration.conftest import start_server

SECONDS = 4.0
CALLERS = 4


def hammer(target: str) -> tuple[int, list[grpc.StatusCode], int]:
    """CALLERS threads calling Predict over one channel for SECONDS; (answers, failure codes,
    times the channel became READY)."""
    ready = 0
    failures: list[grpc.StatusCode] = []
    answers = 0
    lock = threading.Lock()

    def on_state(state: grpc.ChannelConnectivity) -> None:
        nonlocal ready
        if state == grpc.ChannelConnectivity.READY:
            with lock:
                ready += 1

    request = build_predict_request("demo", {"x": np.ones((1, 8), np.float32)})
    with grpc.insecure_channel(target) as channel:
        channel.subscribe(on_state, try_to_connect=True)
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        stop = time.monotonic() + SECONDS

        def caller() -> None:
            nonlocal answers
            while time.monotonic() < stop:
                try:
                    reply = stub.Predict(request, timeout=10)
                    assert isinstance(reply, predict_pb2.PredictResponse)
                    with lock:
                        answers += 1
                except grpc.RpcError as exc:
                    with lock:
                        failures.append(exc.code())

        threads = [threading.Thread(target=caller) for _ in range(CALLERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        channel.unsubscribe(on_state)
    return answers, failures, ready


def hammer_server(demo: Path, log_path: Path, *flags: str) -> tuple[int, list[grpc.StatusCode], int]:
    server = start_server(["--model-base-path", str(demo), "--model-name", "demo", *flags], log_path)
    try:
        return hammer(server.target)
    finally:
        server.stop()


def test_connections_are_recycled_without_failures(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    answers, failures, ready = hammer_server(
        model_dirs["demo"], tmp_path / "aged.log",
        "--grpc-max-connection-age-ms", "1000", "--grpc-max-connection-age-grace-ms", "2000")
    print(f"max connection age 1 s: {answers} answers, {len(failures)} failures, channel READY {ready} times")
    assert failures == []
    assert answers > 100
    assert ready >= 3, "the connection should have been closed and re-established about every second"

    answers, failures, ready = hammer_server(model_dirs["demo"], tmp_path / "plain.log")
    print(f"no max connection age: {answers} answers, channel READY {ready} times")
    assert failures == [] and answers > 100
    assert ready == 1, "without the flag one connection serves the whole run"
