"""Health tells the truth over a start and over a drain; reflection lists our services."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from client import PredictClient, PredictError
from tests.integration.conftest import start_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PREDICTION = "tensorflow.serving.PredictionService"


def check(stub: health_pb2_grpc.HealthStub, service: str = "") -> int:
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


def test_health_over_start_and_drain(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    server = start_server(
        ["--model-base-path", str(model_dirs["demo"]), "--model-name", "demo",
         "--drain-delay-s", "2", "--grace-period-s", "15"],
        tmp_path / "server.log", ready=False,
    )
    try:
        channel = grpc.insecure_channel(server.target)
        stub = health_pb2_grpc.HealthStub(channel)
        seen: list[tuple[int, int]] = []
        refused_while_loading = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = (check(stub), check(stub, PREDICTION))
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == (SERVING, SERVING):
                break
            if status == (NOT_SERVING, NOT_SERVING) and not refused_while_loading:
                # Right after the port opens (TensorFlow takes seconds to load), Predict is
                # refused as UNAVAILABLE, not left hanging.
                with PredictClient(server.target) as client, pytest.raises(PredictError) as info:
                    client.predict("demo", {"x": np.zeros((1, 8), np.float32)}, timeout=5)
                assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
                assert "model 'demo' is loading" in info.value.details
                refused_while_loading = True
            time.sleep(0.05)
        print("health over start:", seen)
        # The overall and the Predict status flip one after the other, and a check reads them with
        # two RPCs, so one pair read during the flip may be mixed. What must hold: NOT_SERVING
        # while loading, SERVING at the end, and neither status ever going back.
        assert seen[0] == (NOT_SERVING, NOT_SERVING) and seen[-1] == (SERVING, SERVING), seen
        assert len(seen) <= 3, seen
        for i in (0, 1):
            statuses = [pair[i] for pair in seen]
            assert statuses == sorted(statuses, key=lambda s: s == SERVING), seen
        assert refused_while_loading
        assert "serving model=demo" in server.log()
        with pytest.raises(grpc.RpcError) as unknown:
            check(stub, "no.such.Service")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        server.process.send_signal(15)  # SIGTERM
        flipped_at = None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if check(stub) == NOT_SERVING and check(stub, PREDICTION) == NOT_SERVING:
                flipped_at = time.monotonic()
                break
            time.sleep(0.02)
        assert flipped_at is not None, "health did not turn NOT_SERVING after SIGTERM"
        # Inside the drain delay the server still answers predictions.
        with PredictClient(server.target) as client:
            out = client.predict("demo", {"x": np.zeros((1, 8), np.float32)}, timeout=5)
        assert out["probabilities"].shape == (1, 3)
        assert server.process.wait(timeout=20) == 0
        channel.close()
    finally:
        server.stop()


def test_reflection_lists_services(server_for) -> None:
    server = server_for("echo")
    with grpc.insecure_channel(server.target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {PREDICTION, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        # The file behind the service resolves, TensorFlow's tensor.proto dependency included.
        from google.protobuf.descriptor_pool import DescriptorPool

        pool = DescriptorPool(database)
        service = pool.FindServiceByName(PREDICTION)
        assert sorted(m.name for m in service.methods) == ["Classify", "GetModelMetadata", "MultiInference", "Predict",
                                                           "Regress"]
        predict = service.methods_by_name["Predict"]
        assert predict.input_type.fields_by_name["inputs"].message_type.fields_by_name["value"].message_type.full_name \
            == "tensorflow.TensorProto"
