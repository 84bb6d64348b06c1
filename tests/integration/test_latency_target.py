"""A latency target on a real server: a model's own `target_latency_ms` (batching_parameters) and
its metrics; a target below a one-row run is said at load, and then every request, predicted to
miss it, is shed (RESOURCE_EXHAUSTED over gRPC, 503 with Retry-After over REST)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from protos.tensorflow_serving import predict_pb2, prediction_service_pb2_grpc
from server.api.tensor_codec import fill_tensor_proto
from tests.integration.conftest import start_server


def test_targets_per_model_their_metrics_and_an_infeasible_one(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    config = tmp_path / "models.config"
    config.write_text(
        "model_config_list {\n"
        f'  config {{ name: "demo" base_path: "{model_dirs["demo"]}" model_platform: "tensorflow"\n'
        "    batching_parameters { target_latency_ms { value: 200 } } }\n"
        f'  config {{ name: "echo" base_path: "{model_dirs["echo"]}" model_platform: "tensorflow"\n'
        "    batching_parameters { target_latency_ms { value: 0.001 } } }\n"
        "}\n")
    server = start_server(["--model-config-file", str(config), "--drain-delay-s", "0"], tmp_path / "server.log")
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            demo = predict_pb2.PredictRequest()
            demo.model_spec.name = "demo"
            fill_tensor_proto(demo.inputs["x"], np.ones((3, 8), np.float32))
            for _ in range(20):
                stub.Predict(demo, timeout=10)
            echo = predict_pb2.PredictRequest()
            echo.model_spec.name = "echo"
            fill_tensor_proto(echo.inputs["x"], np.ones((1, 2), np.int64))
            try:
                stub.Predict(echo, timeout=10)
                raise AssertionError("a request that must miss its target was served")
            except grpc.RpcError as shed:
                assert shed.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "cannot meet its latency target" in (shed.details() or "")
        body = json.dumps({"instances": [[1, 2]]}).encode()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{server.rest_url}/v1/models/echo:predict", data=body),
                                   timeout=10)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"]
        assert server.metric("mirrorserve_latency_target_seconds", model="demo") == 0.2
        assert server.metric("mirrorserve_latency_target_feasible", model="demo") == 1
        assert server.metric("mirrorserve_latency_target_feasible", model="echo") == 0
        assert 1 <= server.metric("mirrorserve_latency_target_batch_size", model="demo") <= 64
        assert server.metric("mirrorserve_latency_target_fit_seconds", model="demo", part="a") > 0
        assert server.metric("mirrorserve_arrival_rows_per_second", model="demo") > 0
        assert server.metric("mirrorserve_shed_total", model="echo", reason="over_target") == 2
        assert server.metric("mirrorserve_over_target_total", model="demo") <= 1
        assert "its latency target of 0.001 ms is below a one-row run" in server.log()
    finally:
        server.stop()
