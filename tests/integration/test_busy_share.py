"""The busy share the autoscaler scales on (deploy/k8s/prometheus-adapter/rules.yaml): the larger
of the model's (rate of mirrorserve_model_busy_seconds_total) and the front-ends' (rate of
mirrorserve_frontend_busy_seconds_total). Near 0 at low load and near 1 at saturation, for a model
of 1 ms batches (the front-end saturates: perf_analyzer's 64 callers) and one of 50 ms (the model
does: 40 callers). The "slow" model costs what each request asks (x[:, 0] iterations of a
matmul), so one SavedModel is both."""

from __future__ import annotations

import concurrent.futures
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.perf import binary
from protos.tensorflow_serving import predict_pb2, prediction_service_pb2_grpc
from server.api.tensor_codec import fill_tensor_proto
from tests.integration.conftest import ServerProcess, start_server

WINDOW_S = 4.0
MAX_BATCH = 16
CALLERS = 40
"""More than twice the callers a batch takes, so a full batch is waiting whenever one ends: the
model is then never idle. (A closed loop of fewer callers than the batch size moves in lockstep,
every caller in the batch and none waiting; with a part batch waiting, the batcher may hold it a
little to fill it, time the model is idle too.)"""


def request(work: float) -> predict_pb2.PredictRequest:
    message = predict_pb2.PredictRequest()
    message.model_spec.name = "slow"
    fill_tensor_proto(message.inputs["x"], np.array([[work, 1.0]], np.float32))
    return message


def busy_shares(server: ServerProcess, load: Callable[[], None]) -> tuple[float, float]:
    """(the model's, the front-end's) busy share while `load` runs."""
    names = ("mirrorserve_model_busy_seconds_total", "mirrorserve_frontend_busy_seconds_total")
    before, started = [server.metric(n) for n in names], time.monotonic()
    load()
    seconds = time.monotonic() - started
    model, front = ((server.metric(n) - b) / seconds for n, b in zip(names, before, strict=True))
    return model, front


@pytest.fixture(scope="module")
def slow_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(["--model-base-path", str(model_dirs["slow"]), "--model-name", "slow",
                           "--max-batch-size", str(MAX_BATCH), "--drain-delay-s", "0"],
                          tmp_path_factory.mktemp("busy") / "server.log")
    yield server
    server.stop()


def batch_seconds(stub: prediction_service_pb2_grpc.PredictionServiceStub, work: float) -> float:
    times = []
    for _ in range(5):
        started = time.perf_counter()
        stub.Predict(request(work), timeout=30)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


@pytest.mark.parametrize("target_ms", [1, 50])
def test_busy_share_is_near_0_at_low_load_and_near_1_at_saturation(slow_server: ServerProcess,
                                                                   target_ms: int) -> None:
    with grpc.insecure_channel(slow_server.target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        work = 0.0
        if target_ms > 1:  # the work that makes a batch take about target_ms
            per_step = (batch_seconds(stub, 200) - batch_seconds(stub, 0)) / 200
            work = round(target_ms / 1000 / max(per_step, 1e-6))
        took = batch_seconds(stub, work)
        assert took * 1000 <= 3 * target_ms + 2, (work, took)

        def low() -> None:  # one request at a time, with a pause ten times its length (at least 50 ms)
            deadline = time.monotonic() + WINDOW_S
            while time.monotonic() < deadline:
                stub.Predict(request(work), timeout=30)
                time.sleep(max(10 * took, 0.05))

        def callers() -> None:  # CALLERS callers, each sending again as soon as answered
            deadline = time.monotonic() + WINDOW_S

            def caller() -> None:
                while time.monotonic() < deadline:
                    stub.Predict(request(work), timeout=30)

            with concurrent.futures.ThreadPoolExecutor(CALLERS) as pool:
                for done in [pool.submit(caller) for _ in range(CALLERS)]:
                    done.result()

        def perf_analyzer() -> None:  # 64 C++ callers: more than one front-end answers on 2 cores
            path = binary()
            assert path is not None, "perf_analyzer is not installed (make test installs it)"
            done = subprocess.run([path, "-m", "slow", "-u", slow_server.target, "--service-kind", "tfserving",
                                   "-i", "grpc", "--shape", "x:1,2", "--input-data", "zero", "--concurrency-range",
                                   "64", "--measurement-interval", str(int(WINDOW_S * 1000 / 3)),
                                   "--stability-percentage", "100", "--max-trials", "3"],
                                  capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0 and "Throughput" in done.stdout, done.stdout + done.stderr

        idle = busy_shares(slow_server, low)
        full = busy_shares(slow_server, perf_analyzer if target_ms == 1 else callers)
    print(f"{target_ms} ms batches ({took * 1000:.1f} ms measured): busy share (model, front-end) at low load "
          f"{idle[0]:.2f}, {idle[1]:.2f}; saturated {full[0]:.2f}, {full[1]:.2f}")
    assert max(idle) < 0.25, (target_ms, idle, full)
    assert max(full) > 0.8, (target_ms, idle, full)
    saturated = full[1] if target_ms == 1 else full[0]  # which half saturates
    assert saturated == max(full), (target_ms, idle, full)
