"""Batching set per model, end to end: the flags, TF Serving's --batching_parameters_file over them,
and a model's own `batching_parameters` block over both, on a real server (one of whose models
asks for two batches in flight, so the model worker adds a thread when it loads). The batch_rows model
answers every row with the rows of the batch it ran in, so padding and splits are visible."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf

from client.api import build_predict_request
from protos.tensorflow_serving import prediction_service_pb2_grpc
from tests.integration.conftest import ROOT, ServerProcess, start_server

BATCHING_FILE = "max_batch_size { value: 16 }\nbatch_timeout_micros { value: 0 }\n"
CONFIG = """model_config_list {
  config { name: "plain" base_path: "%(base)s" }
  config {
    name: "padded"
    base_path: "%(base)s"
    batching_parameters {
      max_batch_size { value: 8 }
      allowed_batch_sizes: 4
      allowed_batch_sizes: 8
      batch_timeout_micros { value: 300000 }
      num_batch_threads { value: 2 }
    }
  }
}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> ServerProcess:
    work = tmp_path_factory.mktemp("batching")
    (work / "batching.config").write_text(BATCHING_FILE)
    (work / "models.config").write_text(CONFIG % {"base": model_dirs["batch_rows"]})
    started = start_server(["--model-config-file", str(work / "models.config"), "--max-batch-size", "32",
                            "--batch-timeout-ms", "50", "--batching_parameters_file", str(work / "batching.config")],
                           work / "server.log")
    yield started
    started.stop()


async def predict_all(target: str, model: str, requests: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Send every request at once; each answer's (x, batch_rows)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)

        async def one(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            response = await stub.Predict(build_predict_request(model, {"x": x}), timeout=30)
            return tf.make_ndarray(response.outputs["x"]), tf.make_ndarray(response.outputs["batch_rows"])

        return await asyncio.gather(*(one(x) for x in requests))


def rows(first: int, count: int) -> np.ndarray:
    return np.arange(first, first + count, dtype=np.int64).reshape(count, 1)


def test_each_model_logs_its_own_policy(server: ServerProcess) -> None:
    log = server.log()
    assert ("batching: max_batch_size=16 batch_timeout=0ms inflight=1 max_queued_rows=4096 allowed_batch_sizes=any"
            in next(line for line in log.splitlines() if "loading model=plain" in line))
    assert ("batching: max_batch_size=8 batch_timeout=300ms inflight=2 max_queued_rows=4096 allowed_batch_sizes=4,8"
            in next(line for line in log.splitlines() if "loading model=padded" in line))


@pytest.mark.parametrize(("count", "padded"), [(1, 4), (3, 4), (5, 8)])
def test_a_batch_is_padded_to_an_allowed_size_and_only_real_rows_return(
    server: ServerProcess, count: int, padded: int
) -> None:
    """Concurrent 1-row requests gather within the model's 300 ms timeout into one batch, which the
    model sees at the next allowed size; each client gets its own row back."""
    requests = [rows(10 * i, 1) for i in range(count)]
    before = server.metric("mirrorserve_batch_rows_count", model="padded")
    answers = asyncio.run(predict_all(server.target, "padded", requests))
    assert server.metric("mirrorserve_batch_rows_count", model="padded") - before == 1
    for x, (got, batch_rows) in zip(requests, answers, strict=True):
        np.testing.assert_array_equal(got, x)
        assert batch_rows.tolist() == [padded]


def test_large_requests_split_at_each_models_own_size(server: ServerProcess) -> None:
    """20 rows: the plain model (16 from the batching file, over the flags' 32) runs 16 + 4; the
    padded model (its own 8) runs 8 + 8 + 4, the last already an allowed size."""
    ((plain_x, plain_rows),) = asyncio.run(predict_all(server.target, "plain", [rows(0, 20)]))
    np.testing.assert_array_equal(plain_x, rows(0, 20))
    assert plain_rows.tolist() == [16] * 16 + [4] * 4
    ((padded_x, padded_rows),) = asyncio.run(predict_all(server.target, "padded", [rows(0, 20)]))
    np.testing.assert_array_equal(padded_x, rows(0, 20))
    assert padded_rows.tolist() == [8] * 16 + [4] * 4


@pytest.mark.parametrize(("flag_file", "config_block", "message"), [
    ("num_batch_threads { value: 0 }", "", "batching.config: batches in flight must be >= 1, got 0"),
    ("max_batch_sise { value: 8 }", "", 'batching.config:1:1 : Message type "tensorflow.serving.BatchingParameters" '
     'has no field named "max_batch_sise".'),
    ("", "batching_parameters { pad_variable_length_inputs: true }",
     "models.config:2: model 'm' batching_parameters: pad_variable_length_inputs is not supported"),
])
def test_bad_batching_settings_stop_the_start_naming_them(
    tmp_path: Path, model_dirs: dict[str, Path], flag_file: str, config_block: str, message: str
) -> None:
    (tmp_path / "batching.config").write_text(flag_file)
    (tmp_path / "models.config").write_text(
        f'model_config_list {{\n config {{ name: "m" base_path: "{model_dirs["batch_rows"]}" {config_block} }}\n}}\n')
    done = subprocess.run(
        [sys.executable, "-m", "server", "--port", "0", "--rest-api-port", "-1",
         "--model-config-file", str(tmp_path / "models.config"),
         "--batching-parameters-file", str(tmp_path / "batching.config")],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr, done.stderr[-2000:]
