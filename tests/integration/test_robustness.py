"""Deadlines, fault isolation and input limits, against a real server and a real SavedModel that
costs what a request asks and fails on a poisoned row (saved_models.Slow)."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from client import AsyncPredictClient, PredictClient, PredictError
from client.api import build_predict_request


def rows(work: float, *values: float) -> np.ndarray:
    return np.array([[work, v] for v in values], dtype=np.float32)


def executed_rows(server) -> float:  # type: ignore[no-untyped-def]
    return server.metric("mirrorserve_replica_rows_total", model="slow")


def test_queued_request_past_its_deadline_is_dropped_before_compute(server_for) -> None:
    # One batch at a time, so the second request queues behind the slow one.
    server = server_for("slow", "--max-batch-size", "1", "--batch-timeout-ms", "0", "--max-inflight-batches", "1")
    rows_before = executed_rows(server)
    dropped_before = server.metric("mirrorserve_dropped_requests_total", model="slow")

    async def scenario() -> tuple[object, object, float]:
        async with AsyncPredictClient(server.target) as client:
            slow = asyncio.create_task(client.predict("slow", {"x": rows(15000, 1.0)}, timeout=30))
            await asyncio.sleep(0.2)  # the slow batch is running now
            started = time.perf_counter()
            try:
                await client.predict("slow", {"x": rows(0, 2.0)}, timeout=0.05)
                late: object = "OK"
            except PredictError as exc:
                late = exc.code
            elapsed = time.perf_counter() - started
            return (await slow)["y"].tolist(), late, elapsed

    slow_result, late_code, elapsed = asyncio.run(scenario())
    time.sleep(0.2)  # let the batcher sweep the dead request once the slow batch is done
    ran = executed_rows(server) - rows_before
    dropped = server.metric("mirrorserve_dropped_requests_total", model="slow") - dropped_before
    print(f"slow request -> {slow_result}; 50 ms request -> {late_code} after {elapsed * 1e3:.0f} ms; "
          f"rows executed {ran:.0f}; dropped {dropped:.0f}")
    assert slow_result == [2.0]
    assert late_code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < 0.5
    assert ran == 1, "the model saw the expired request's row"
    assert dropped == 1
    assert server.metric("mirrorserve_dropped_requests_total", model="slow", reason="deadline") >= 1


def test_poisoned_request_fails_alone(server_for) -> None:
    """16 requests in one batch, one poisoned: exactly that one gets INTERNAL; the next batch is fine."""
    server = server_for("slow", "--max-batch-size", "16", "--batch-timeout-ms", "200", "--replicas", "2")
    batches_before = server.metric("mirrorserve_batch_rows_count", model="slow")

    async def batch_of_16(poisoned: int | None) -> list[object]:
        async with AsyncPredictClient(server.target) as client:
            calls = [client.predict("slow", {"x": rows(0, -1.0 if i == poisoned else float(i))}, timeout=30)
                     for i in range(16)]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    first = asyncio.run(batch_of_16(poisoned=5))
    second = asyncio.run(batch_of_16(poisoned=None))
    executions = server.metric("mirrorserve_batch_rows_count", model="slow") - batches_before
    failed = [i for i, r in enumerate(first) if isinstance(r, PredictError)]
    print(f"first batch: {16 - len(failed)} OK, failed {failed}; second batch: "
          f"{sum(1 for r in second if isinstance(r, dict))} OK; model executions {executions:.0f}")
    assert failed == [5]
    error = first[5]
    assert isinstance(error, PredictError)
    assert error.code == grpc.StatusCode.INTERNAL and error.details == "internal error"
    for i, result in enumerate(first):
        if i != 5:
            assert isinstance(result, dict) and result["y"].tolist() == [2.0 * i]
    assert all(isinstance(r, dict) and r["y"].tolist() == [2.0 * i] for i, r in enumerate(second))
    # The details stay in the log, with the stack.
    log = server.log()
    assert "poisoned row (value -1) in the batch" in log and "Traceback" in log
    assert server.metric("mirrorserve_model_failures_total", model="slow") == 1
    assert server.process.poll() is None


def test_nan_and_inf_pass_through(server_for) -> None:
    server = server_for("slow", "--max-batch-size", "16", "--batch-timeout-ms", "200", "--replicas", "2")
    with PredictClient(server.target) as client:
        y = client.predict("slow", {"x": rows(0, np.nan, np.inf, -np.inf, 1.5)})["y"]
    assert np.isnan(y[0]) and y[1] == np.inf and y[2] == -np.inf and y[3] == 3.0


def test_input_limits(server_for) -> None:
    server = server_for("slow", "--max-batch-size", "1", "--batch-timeout-ms", "0",
                        "--max-message-bytes", "65536")
    with PredictClient(server.target) as client:
        # A message over --max-message-bytes is refused by gRPC before it is read.
        with pytest.raises(grpc.RpcError) as too_big:
            client.stub.Predict(build_predict_request("slow", {"x": np.zeros((10000, 2), np.float32)}), timeout=10)
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # One value "filling" a huge declared shape is refused before anything is allocated.
        request = build_predict_request("slow", {"x": rows(0, 1.0)})
        tensor = request.inputs["x"]
        tensor.ClearField("tensor_content")
        tensor.float_val.append(1.0)
        tensor.tensor_shape.dim[0].size = 10**12
        with pytest.raises(grpc.RpcError) as huge:
            client.stub.Predict(request, timeout=10)
        assert huge.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the limit is 65536 bytes" in huge.value.details()
        tensor.tensor_shape.dim[0].size = -3
        with pytest.raises(grpc.RpcError) as negative:
            client.stub.Predict(request, timeout=10)
        assert negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "negative dimension" in negative.value.details()
        # And the server is still fine.
        assert client.predict("slow", {"x": rows(0, 4.0)})["y"].tolist() == [8.0]
