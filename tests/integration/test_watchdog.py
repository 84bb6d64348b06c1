"""A hung model worker is noticed (server.core.watchdog): a batch that never returns gets its
requests UNAVAILABLE after its time limit, liveness turns NOT_SERVING, other models are answered
until the server exits 1 (the orchestrator restarts it); with several front-ends too."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tensorflow_serving import predict_pb2, prediction_service_pb2_grpc
from server.api.tensor_codec import fill_tensor_proto
from tests.integration.conftest import start_server

FLOOR_S = 1.0
"""--hang-timeout-s here: a new version's first batches get 3x it (server.core.watchdog)."""


def request(model: str, rows: np.ndarray) -> predict_pb2.PredictRequest:
    message = predict_pb2.PredictRequest()
    message.model_spec.name = model
    fill_tensor_proto(message.inputs["x"], rows)
    return message


def liveness(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5).status)


@pytest.mark.parametrize("frontends", [1, 2])
def test_a_batch_that_never_returns_fails_its_requests_others_are_served_and_the_server_exits_1(
        model_dirs: dict[str, Path], tmp_path: Path, frontends: int) -> None:
    from tests.integration.saved_models import build_hang

    build_hang(tmp_path / "hang" / "1")
    config = tmp_path / "models.config"
    config.write_text("model_config_list {\n"
                      f'  config {{ name: "hang" base_path: "{tmp_path / "hang"}" model_platform: "tensorflow" }}\n'
                      f'  config {{ name: "demo" base_path: "{model_dirs["demo"]}" model_platform: "tensorflow" }}\n'
                      "}\n")
    server = start_server(["--model-config-file", str(config), "--hang-timeout-s", str(FLOOR_S),
                           "--frontends", str(frontends), "--drain-delay-s", "3", "--grace-period-s", "10"],
                          tmp_path / "server.log")
    channel = grpc.insecure_channel(server.target)
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    demo = request("demo", np.ones((2, 8), np.float32))
    try:
        assert liveness(channel) == health_pb2.HealthCheckResponse.SERVING
        answer = stub.Predict(request("hang", np.zeros((1, 1), np.float32)), timeout=10)
        assert list(answer.outputs["y"].float_val) == [0.0]  # a non-positive input returns

        started = time.monotonic()
        hung = stub.Predict.future(request("hang", np.ones((1, 1), np.float32)), timeout=60)
        while not hung.done():  # the other model is answered while the hang goes unnoticed
            stub.Predict(demo, timeout=10)
            time.sleep(0.1)
        noticed_s = time.monotonic() - started
        with pytest.raises(grpc.RpcError) as failed:
            hung.result()
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "hung" in (failed.value.details() or "") and "limit of 3s" in (failed.value.details() or "")
        # 3 x the floor for a version's first batches, noticed on the next 1 s tick
        assert 3 * FLOOR_S <= noticed_s < 3 * FLOOR_S + 3, noticed_s
        assert liveness(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        stub.Predict(demo, timeout=10)  # still answered while the server drains
    finally:
        channel.close()
    code = server.process.wait(timeout=30)
    log = server.log()
    assert code == 1, log[-3000:]
    assert "the model worker is hung (model hang version 1: a batch has run" in log, log[-3000:]
