"""A latency target on a real server: a model's own `target_latency_ms` (batching_parameters) and
its metrics; a burst far past what the target allows is partly refused (RESOURCE_EXHAUSTED over
gRPC, 503 with Retry-After over REST) and the rest served; a target below a one-row run is said
at load, and its model is served as without a target, every answer counted over it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from protos.tensorflow_serving import (
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)
from server.api.tensor_codec import fill_tensor_proto
from tests.integration.conftest import start_server

BURST = 48
"""Concurrent requests of 8 rows to a model whose batches take 8: some 48 runs back to back, far
past a 20 ms target, however fast the machine."""


def test_targets_per_model_their_metrics_and_an_infeasible_one(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    config = tmp_path / "models.config"
    config.write_text(
        "model_config_list {\n"
        f'  config {{ name: "demo" base_path: "{model_dirs["demo"]}" model_platform: "tensorflow"\n'
        "    batching_parameters { target_latency_ms { value: 200 } } }\n"
        f'  config {{ name: "burst" base_path: "{model_dirs["demo"]}" model_platform: "tensorflow"\n'
        "    batching_parameters { target_latency_ms { value: 20 } max_batch_size { value: 8 } } }\n"
        f'  config {{ name: "echo" base_path: "{model_dirs["echo"]}" model_platform: "tensorflow"\n'
        "    batching_parameters { target_latency_ms { value: 0.001 } } }\n"
        "}\n")
    server = start_server(["--model-config-file", str(config), "--drain-delay-s", "0"], tmp_path / "server.log")
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)

            def predict(model: str, x: np.ndarray) -> grpc.StatusCode:
                request = predict_pb2.PredictRequest()
                request.model_spec.name = model
                fill_tensor_proto(request.inputs["x"], x)
                try:
                    stub.Predict(request, timeout=30)
                except grpc.RpcError as refused:
                    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused
                    assert "cannot meet its latency target" in (refused.details() or "")
                    return refused.code()
                return grpc.StatusCode.OK

            for _ in range(20):
                assert predict("demo", np.ones((3, 8), np.float32)) is grpc.StatusCode.OK
            with ThreadPoolExecutor(BURST) as pool:
                codes = list(pool.map(lambda _: predict("burst", np.ones((8, 8), np.float32)), range(BURST)))
            refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert 0 < refused < BURST, codes
            for _ in range(3):  # a target no run can meet: served, each answer counted over it
                assert predict("echo", np.ones((1, 2), np.int64)) is grpc.StatusCode.OK
            # ...and its status says so (code OK: it serves)
            ask = get_model_status_pb2.GetModelStatusRequest()
            ask.model_spec.name = "echo"
            (echo_status,) = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(ask).model_version_status
            assert echo_status.status.error_code == 0
            assert "below a one-row run" in echo_status.status.error_message

        def rest(_: int) -> int:
            body = json.dumps({"instances": np.ones((8, 8)).tolist()}).encode()
            try:
                with urllib.request.urlopen(urllib.request.Request(f"{server.rest_url}/v1/models/burst:predict",
                                                                   data=body), timeout=30) as answer:
                    return int(answer.status)
            except urllib.error.HTTPError as refusal:
                assert refusal.headers["Retry-After"] and b"latency target" in refusal.read()
                return refusal.code

        with ThreadPoolExecutor(BURST) as pool:
            statuses = list(pool.map(rest, range(BURST)))
        assert set(statuses) == {200, 503}, statuses

        assert server.metric("mirrorserve_latency_target_seconds", model="demo") == 0.2
        assert server.metric("mirrorserve_latency_target_feasible", model="demo") == 1
        assert server.metric("mirrorserve_latency_target_feasible", model="echo") == 0
        planned = {"model": "demo", "signature": "serving_default"}  # each signature has its own plan
        assert 1 <= server.metric("mirrorserve_latency_target_batch_size", **planned) <= 64
        assert server.metric("mirrorserve_latency_target_fit_seconds", **planned, part="a") > 0
        assert server.metric("mirrorserve_latency_target_wait_seconds", **planned) > 0
        assert server.metric("mirrorserve_arrival_rows_per_second", **planned) > 0
        # every refusal is counted, at arrival or when its batch was taken
        shed = sum(server.metric("mirrorserve_shed_total", model="burst", reason=reason)
                   for reason in ("over_target", "late"))
        assert shed == refused + statuses.count(503)
        assert server.metric("mirrorserve_shed_total", model="echo", reason="over_target") == 0
        assert server.metric("mirrorserve_over_target_total", model="echo") == 3
        # the ratio histogram's 1.0 edge: exactly the answers within the target
        within = server.metric("mirrorserve_latency_target_ratio_bucket", model="demo", le="1.0")
        answered = server.metric("mirrorserve_latency_target_ratio_count", model="demo")
        assert answered == 20 and within == answered - server.metric("mirrorserve_over_target_total", model="demo")
        assert server.metric("mirrorserve_latency_target_ratio_bucket", model="echo", le="10.0") == 0
        assert "its latency target of 0.001 ms is below a one-row run" in server.log()
    finally:
        server.stop()
