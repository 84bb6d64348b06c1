"""Concurrent requests whose rows encode (request id, row index), through a model that returns
its rows: each request gets back exactly its own rows, in order, whatever the replica count and
however unevenly batches and replicas divide the rows."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client import AsyncPredictClient, PredictClient
from client.api import build_predict_request


def tagged_rows(request_id: int, rows: int) -> np.ndarray:
    return np.stack([np.full(rows, request_id), np.arange(rows)], axis=1).astype(np.int64)


async def send_all(target: str, sizes: list[int]) -> list[dict[str, np.ndarray]]:
    async with AsyncPredictClient(target) as client:
        return await asyncio.gather(*(
            client.predict("echo", {"x": tagged_rows(i, n)}, timeout=60) for i, n in enumerate(sizes)
        ))


@pytest.mark.parametrize("max_batch", [5])  # 5 rows: uneven over 2 and 3 replicas (the zoo tests cover 7)
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_each_request_gets_its_own_rows_in_order(server_for, replicas: int, max_batch: int) -> None:
    server = server_for("echo", "--replicas", str(replicas), "--max-batch-size", str(max_batch),
                        "--batch-timeout-ms", "3")
    rng = np.random.default_rng(replicas * 10 + max_batch)
    # Mostly small requests, some larger than the batch budget (split over several batches).
    sizes = [int(n) for n in rng.integers(1, 5, 80)] + [max_batch + 1, 2 * max_batch + 3, 1, 3 * max_batch]
    rng.shuffle(sizes)
    results = asyncio.run(send_all(server.target, sizes))
    for request_id, (n, outputs) in enumerate(zip(sizes, results, strict=True)):
        expected = tagged_rows(request_id, n)
        np.testing.assert_array_equal(outputs["y"], expected)
        np.testing.assert_array_equal(outputs["first"], expected[:, 0])


def test_batching_happened_and_every_replica_got_rows(server_for) -> None:
    server = server_for("echo", "--replicas", "3", "--max-batch-size", "32", "--batch-timeout-ms", "5")
    batches_before = server.metric("mirrorserve_batch_rows_count", model="echo")
    rows_before = [server.metric("mirrorserve_replica_rows_total", model="echo", replica=str(r)) for r in range(3)]
    requests = 256
    results = asyncio.run(send_all(server.target, [1] * requests))
    assert len(results) == requests
    batches = server.metric("mirrorserve_batch_rows_count", model="echo") - batches_before
    replica_rows = [
        server.metric("mirrorserve_replica_rows_total", model="echo", replica=str(r)) - rows_before[r]
        for r in range(3)
    ]
    print(f"{requests} requests -> {batches:.0f} model executions; rows per replica {replica_rows}")
    assert 0 < batches <= requests / 4, f"batching did not merge requests: {batches} executions"
    assert all(rows > 0 for rows in replica_rows), replica_rows
    assert sum(replica_rows) == requests
    # At start-up one trace per count of replicas in use (1, 2, 3), whatever the batch sizes and
    # their splits over replicas since.
    assert server.metric("mirrorserve_tf_function_traces_total", model="echo", signature="serving_default") == 3


def test_highest_version_is_served(server_for) -> None:
    server = server_for("versioned")
    with PredictClient(server.target) as client:
        response = client.stub.Predict(build_predict_request("versioned", {"x": tagged_rows(0, 2)}), timeout=30)
        assert response.model_spec.version.value == 3
        assert response.model_spec.signature_name == "serving_default"
        assert client.predict("versioned", {"x": tagged_rows(1, 1)}, version=3)["y"].tolist() == [[1, 0]]


def test_batches_running_at_once_in_the_worker_keep_every_request_whole(server_for) -> None:
    """--max-inflight-batches 3: batches run concurrently on the worker's threads (each warmed up
    before SERVING), with the default auto wait instead of a fixed timeout."""
    server = server_for("echo", "--replicas", "2", "--max-batch-size", "5", "--max-inflight-batches", "3")
    rng = np.random.default_rng(3)
    sizes = [int(n) for n in rng.integers(1, 5, 120)] + [6, 13, 1, 15]
    rng.shuffle(sizes)
    results = asyncio.run(send_all(server.target, sizes))
    for request_id, (n, outputs) in enumerate(zip(sizes, results, strict=True)):
        np.testing.assert_array_equal(outputs["y"], tagged_rows(request_id, n))
    assert server.metric("mirrorserve_batch_rows_count", model="echo") > 1
    # Warming up three threads traced nothing beyond the start-up traces (one per count of
    # replicas in use: 1 and 2), nor did the load.
    assert server.metric("mirrorserve_tf_function_traces_total", model="echo", signature="serving_default") == 2
