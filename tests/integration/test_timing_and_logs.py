"""Per-request timing trailers agree with the server-side histograms; JSON logs are JSON."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import numpy as np

from client.api import build_predict_request
from protos.tensorflow_serving import prediction_service_pb2_grpc
from tests.integration.conftest import start_server

QUEUE = "mirrorserve-queue-seconds"
COMPUTE = "mirrorserve-compute-seconds"


async def timed_calls(target: str, sizes: list[int]) -> list[tuple[float, float, float]]:
    """(client latency, queue trailer, compute trailer) per request, all in flight together."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)

        async def one(i: int, rows: int) -> tuple[float, float, float]:
            x = np.stack([np.full(rows, i), np.arange(rows)], axis=1).astype(np.int64)
            started = time.perf_counter()
            call = stub.Predict(build_predict_request("echo", {"x": x}), timeout=30)
            await call
            latency = time.perf_counter() - started
            trailers = dict(await call.trailing_metadata())
            return latency, float(trailers[QUEUE]), float(trailers[COMPUTE])

        return await asyncio.gather(*(one(i, n) for i, n in enumerate(sizes)))


def test_timing_trailers_match_histograms(server_for) -> None:
    server = server_for("echo", "--replicas", "2", "--max-batch-size", "8", "--batch-timeout-ms", "10")
    before = {name: server.metric(name, model="echo") for name in (
        "mirrorserve_queue_duration_seconds_sum", "mirrorserve_queue_duration_seconds_count",
        "mirrorserve_batch_duration_seconds_sum", "mirrorserve_batch_duration_seconds_count")}
    sizes = [1, 2, 3, 20, 1, 1, 5, 2] * 8  # 20 rows: split over three batches
    timings = asyncio.run(timed_calls(server.target, sizes))
    after = {name: server.metric(name, model="echo") for name in before}
    delta = {name: after[name] - before[name] for name in before}

    queue_total = sum(q for _, q, _ in timings)
    histogram_total = delta["mirrorserve_queue_duration_seconds_sum"]
    batches = delta["mirrorserve_batch_duration_seconds_count"]
    print(f"{len(timings)} requests: trailer queue sum {queue_total:.6f}s vs histogram {histogram_total:.6f}s; "
          f"batches {batches:.0f}")
    assert delta["mirrorserve_queue_duration_seconds_count"] == len(sizes)
    # Trailers are rounded to the microsecond.
    assert abs(delta["mirrorserve_queue_duration_seconds_sum"] - queue_total) < 1e-6 * len(sizes) + 1e-9
    batch_seconds = delta["mirrorserve_batch_duration_seconds_sum"]
    for latency, queue, compute in timings:
        assert queue >= 0 and compute > 0
        assert queue + compute <= latency
        assert compute <= batch_seconds + 1e-6  # a request's compute is made of whole batches
    # The request split over three batches paid for all three.
    big = [compute for (_, _, compute), rows in zip(timings, sizes, strict=True) if rows == 20]
    small = [compute for (_, _, compute), rows in zip(timings, sizes, strict=True) if rows == 1]
    assert min(big) > min(small)


def test_json_logs(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    server = start_server(["--model-base-path", str(model_dirs["echo"]), "--model-name", "echo",
                           "--log-format", "json"], tmp_path / "server.log")
    assert server.stop() == 0
    records = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    serving = [r for r in records if r["message"].startswith("serving model=echo")]
    assert len(serving) == 1, records
    assert serving[0]["level"] == "INFO" and serving[0]["logger"] == "server" and "time" in serving[0]
    assert "log_format=json" in serving[0]["message"]  # the effective settings are in the start-up line
    assert any(r["message"].startswith("drained: accepted=0 answered=0") for r in records)
