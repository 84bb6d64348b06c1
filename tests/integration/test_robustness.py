"""Deadlines, fault isolation and input limits, against a real server and a real SavedModel that
costs what a request asks and fails on a poisoned row (saved_models.Slow)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

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
    """16 requests in one batch, one poisoned: exactly that one fails, with the model's own error
    (INVALID_ARGUMENT and TensorFlow's message, as TF Serving answers it); the next batch is fine."""
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
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details.startswith("assertion failed: [poisoned row (value -1) in the batch]"), error.details
    assert "Graph execution error" not in error.details and "node" not in error.details  # one line, no dump
    for i, result in enumerate(first):
        if i != 5:
            assert isinstance(result, dict) and result["y"].tolist() == [2.0 * i]
    assert all(isinstance(r, dict) and r["y"].tolist() == [2.0 * i] for i, r in enumerate(second))
    # A client's error, not the server's: counted, not logged with a stack.
    assert "Traceback" not in server.log()
    assert server.metric("mirrorserve_model_failures_total", model="slow") == 1
    assert server.process.poll() is None


def test_the_models_own_errors_keep_tensorflows_code_and_message_and_spare_the_batch(server_for) -> None:
    """An assertion, then a gather out of range, each in one batch with 7 good requests: the bad
    request gets INVALID_ARGUMENT with TensorFlow's words (gRPC, TF Serving REST and v2 REST
    alike), the good ones their answers, within the re-runs' budget (2 x the batch's rows)."""
    server = server_for("checked", "--max-batch-size", "16", "--batch-timeout-ms", "200", "--replicas", "2",
                        "--no-strict-warm-up")  # it refuses the warm-up's zeros, as it would any client's
    good = [({"x": np.full((1, 2), i + 1.0, np.float32), "index": np.array([i % 3])}, 2.0 * (i + 1) + 10 * (i % 3 + 1))
            for i in range(7)]

    async def one_batch(bad: dict[str, np.ndarray]) -> list[object]:
        async with AsyncPredictClient(server.target) as client:
            calls = [client.predict("checked", inputs, timeout=30) for inputs in
                     [*(g for g, _ in good[:3]), bad, *(g for g, _ in good[3:])]]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    for bad, text in (({"x": np.array([[1.0, -2.0]], np.float32), "index": np.array([0])},
                       "assertion failed: [inputs must be positive"),
                      ({"x": np.ones((1, 2), np.float32), "index": np.array([7])}, "indices[0] = 7 is not in [0, 3)")):
        before = server.metric("mirrorserve_batch_rows_count", model="checked")
        rows_before = server.metric("mirrorserve_batch_rows_sum", model="checked")
        results = asyncio.run(one_batch(bad))
        runs = server.metric("mirrorserve_batch_rows_count", model="checked") - before
        rows = server.metric("mirrorserve_batch_rows_sum", model="checked") - rows_before
        print(f"{text[:20]}: {runs:.0f} runs, {rows:.0f} rows")
        answers = [r for r in results if isinstance(r, dict)]
        assert [float(a["y"][0]) for a in answers] == [want for _, want in good], results
        error = results[3]
        assert isinstance(error, PredictError) and error.code == grpc.StatusCode.INVALID_ARGUMENT, error
        assert error.details.startswith(text), error.details
        assert rows <= 8 + 2 * 8, rows  # the batch, then its halves within twice its rows
    status, body = post_json(server.rest_port, "/v1/models/checked:predict",
                             {"inputs": {"x": [[1.0, 1.0]], "index": [9]}})
    assert (status, body) == (400, {"error": "indices[0] = 9 is not in [0, 3)"})
    status, body = post_json(server.rest_port, "/v2/models/checked/infer", {"inputs": [
        {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [-1.0, 1.0]},
        {"name": "index", "shape": [1], "datatype": "INT64", "data": [0]}]})
    assert status == 400 and body["error"].startswith("assertion failed: [inputs must be positive"), body
    assert "Traceback" not in server.log()


def post_json(port: int, path: str, body: object) -> tuple[int, object]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return int(answer.status), json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return int(error.code), json.loads(error.read())


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
