"""The server started with a `tensorflow_model_server` command line as TF Serving's documentation
writes it (a model config file, batching parameters, a monitoring config, warmup on), serving
TF Serving's official client; the monitoring config decides where the metrics are, and TF
Serving's own series are there under its names."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client import AsyncPredictClient, PredictClient
from tests.integration.conftest import ServerProcess, start_server
from tests.integration.test_official_client import run_official
from tests.integration.test_warmup import write_warmup

MONITORING_PATH = "/tfs/metrics"
WARMUP_PATH = "demo/1/assets.extra/tf_serving_warmup_requests"


@pytest.fixture(scope="module")
def tf_serving_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("drop-in")
    base = root / "demo"
    shutil.copytree(model_dirs["demo"], base)
    write_warmup(base / "1", {"a": {"x": np.zeros((1, 8), np.float32)}, "b": {"x": np.ones((3, 8), np.float32)}})
    (root / "models.config").write_text(
        f'model_config_list {{\n  config {{\n    name: "demo"\n    base_path: "{base}"\n'
        '    model_platform: "tensorflow"\n  }\n}\n')
    (root / "batching.config").write_text("max_batch_size { value: 16 }\nbatch_timeout_micros { value: 2000 }\n"
                                          "num_batch_threads { value: 1 }\n")
    (root / "monitoring.config").write_text(f'prometheus_config {{\n  enable: true,\n  path: "{MONITORING_PATH}"\n}}\n')
    server = start_server([  # TF Serving's spelling throughout, but the ports: free ones for a test
        "--port=0", "--rest-api-port", "0", f"--model_config_file={root / 'models.config'}",
        "--model_config_file_poll_wait_seconds=60", "--enable_batching=true",
        f"--batching_parameters_file={root / 'batching.config'}",
        f"--monitoring_config_file={root / 'monitoring.config'}",
        "--tensorflow_intra_op_parallelism=2", "--enable_model_warmup=true", "--num_request_iterations_for_warmup=2",
        "--rest_api_timeout_in_ms=30000",
        "--drain-delay-s", "0"], root / "server.log")
    try:
        # Before any request: the version's own batcher ran the warmup, 2 records twice, one at a time.
        _, page = fetch(server, MONITORING_PATH)
        assert 'mirrorserve_batch_rows_count{model="demo",version="1"} 4.0' in page
        assert f'mirrorserve_batch_rows_sum{{model="demo",version="1"}} {2.0 * (1 + 3)}' in page
    except BaseException:
        server.stop()  # a failed check must not leave the server running
        raise
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def fetch(server: ServerProcess, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{server.rest_url}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_tf_serving_command_line_serves_the_official_client(tf_serving_server: ServerProcess,
                                                              tmp_path: Path) -> None:
    rows = {f"r{i}": np.full((1, 8), i, np.float32) for i in range(6)}
    report, outputs = run_official(tf_serving_server.target, "demo", rows, tmp_path)
    assert "serving_default" in json.dumps(report)
    assert all(outputs[f"r{i}/probabilities"].shape == (1, 3) for i in range(6))
    log = tf_serving_server.log()
    assert "max_batch_size=16" in log  # the batching parameters file applied
    assert "warmed up model=demo version=1 from " in log
    assert f"/{WARMUP_PATH}: 2 records, 4 requests in " in log  # --num_request_iterations_for_warmup=2


def test_the_monitoring_config_places_the_metrics_and_tf_servings_series_are_there(
        tf_serving_server: ServerProcess, tmp_path: Path) -> None:
    run_official(tf_serving_server.target, "demo", {"a": np.zeros((1, 8), np.float32)}, tmp_path)
    status, page = fetch(tf_serving_server, MONITORING_PATH)
    assert status == 200
    assert fetch(tf_serving_server, "/metrics")[0] == 404  # only where the config says
    assert ':tensorflow:serving:request_count{model_name="demo",status="OK"}' in page
    for series in (':tensorflow:serving:request_latency_bucket{API="Predict",entrypoint="GRPC"',
                   ':tensorflow:serving:runtime_latency_count{API="Predict"',
                   ':tensorflow:serving:batching_session:queuing_latency_count{thread_pool_name="batch_threads"}',
                   ":tensorflow:serving:batching_session:processed_batch_size_count",
                   ':tensorflow:serving:model_warmup_latency_count{model_path="'):
        assert series in page, series


def test_enable_batching_false_runs_each_request_alone_and_whole(server_for) -> None:  # type: ignore[no-untyped-def]
    """TF Serving's default written out: a 256-row request is one model run (split over the two
    replicas as one batch), not 256 one-row runs; concurrent requests are not merged."""
    server = server_for("demo", "--enable_batching=false", "--replicas", "2")
    before = {name: server.metric(f"mirrorserve_batch_rows_{name}", model="demo") for name in ("count", "sum")}
    replica_before = [server.metric("mirrorserve_replica_rows_total", model="demo", replica=str(r)) for r in (0, 1)]
    with PredictClient(server.target) as client:
        outputs = client.predict("demo", {"x": np.random.default_rng(1).standard_normal((256, 8)).astype(np.float32)})
    assert outputs["probabilities"].shape == (256, 3)
    after = {name: server.metric(f"mirrorserve_batch_rows_{name}", model="demo") for name in ("count", "sum")}
    assert (after["count"] - before["count"], after["sum"] - before["sum"]) == (1, 256)
    replica = [server.metric("mirrorserve_replica_rows_total", model="demo", replica=str(r)) - b
               for r, b in zip((0, 1), replica_before, strict=True)]
    assert replica == [128, 128]

    async def three_at_once() -> None:
        async with AsyncPredictClient(server.target) as client:
            await asyncio.gather(*(client.predict("demo", {"x": np.ones((rows, 8), np.float32)}) for rows in (1, 2, 3)))

    asyncio.run(three_at_once())
    count = server.metric("mirrorserve_batch_rows_count", model="demo")
    assert count - after["count"] == 3  # one run each: never merged
    assert "batching: off (each request runs alone)" in server.log()
