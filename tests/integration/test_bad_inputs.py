"""Every bad input gets a clear status naming the problem, and never fails the well-formed
requests it would have been batched with."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from client import AsyncPredictClient, PredictClient
from client.api import build_metadata_request, build_predict_request
from server.api.tensor_codec import to_tensor_proto

A = np.arange(6, dtype=np.float32).reshape(2, 3)
B = np.array([1, 2], dtype=np.int32)


def good(**overrides: Any) -> Any:
    return build_predict_request("multi", {"a": A, "b": B, **overrides})


def truncated_content() -> Any:
    request = good()
    request.inputs["a"].tensor_content = request.inputs["a"].tensor_content[:-4]
    return request


def with_spec(**fields: Any) -> Any:
    request = good()
    for name, value in fields.items():
        if name == "version":
            request.model_spec.version.value = value
        else:
            setattr(request.model_spec, name, value)
    return request


def without(name: str) -> Any:
    request = good()
    del request.inputs[name]
    return request


def with_filter(*names: str) -> Any:
    request = good()
    request.output_filter.extend(names)
    return request


BAD: dict[str, tuple[Callable[[], Any], grpc.StatusCode, list[str]]] = {
    "unknown model": (lambda: with_spec(name="nope"), grpc.StatusCode.NOT_FOUND, ["model 'nope' not found"]),
    "unknown version": (lambda: with_spec(version=42), grpc.StatusCode.NOT_FOUND, ["version 42 not found"]),
    "unknown version label": (lambda: with_spec(version_label="canary"), grpc.StatusCode.NOT_FOUND,
                              ["version label 'canary'"]),
    "unknown signature": (lambda: with_spec(signature_name="nope"), grpc.StatusCode.INVALID_ARGUMENT,
                          ["signature 'nope' not found", "serving_default", "strlen", "total"]),
    "missing input": (lambda: without("b"), grpc.StatusCode.INVALID_ARGUMENT, ["missing input 'b'"]),
    "unexpected input": (lambda: good(c=B), grpc.StatusCode.INVALID_ARGUMENT, ["unexpected input 'c'"]),
    "wrong dtype": (lambda: good(a=A.astype(np.float64)), grpc.StatusCode.INVALID_ARGUMENT,
                    ["input 'a' must be DT_FLOAT, got DT_DOUBLE"]),
    "wrong non-batch dims": (lambda: good(a=np.zeros((2, 4), np.float32)), grpc.StatusCode.INVALID_ARGUMENT,
                             ["input 'a' must have shape [-1, 3], got [2, 4]"]),
    "wrong rank": (lambda: good(b=B.reshape(2, 1)), grpc.StatusCode.INVALID_ARGUMENT,
                   ["input 'b' must have shape [-1], got [2, 1]"]),
    "row counts differ": (lambda: good(b=np.array([1, 2, 3], np.int32)), grpc.StatusCode.INVALID_ARGUMENT,
                          ["disagree on the number of rows", "'a' has 2", "'b' has 3"]),
    "tensor_content wrong length": (truncated_content, grpc.StatusCode.INVALID_ARGUMENT,
                                    ["input 'a'", "tensor_content has 20 bytes", "needs 24"]),
    "zero rows": (lambda: good(a=np.zeros((0, 3), np.float32), b=np.zeros(0, np.int32)),
                  grpc.StatusCode.INVALID_ARGUMENT, ["zero rows"]),
    "unknown output in filter": (lambda: with_filter("c", "nope"), grpc.StatusCode.INVALID_ARGUMENT,
                                 ["output_filter", "'nope'", "b_twice, c"]),
    "empty model name": (lambda: with_spec(name=""), grpc.StatusCode.INVALID_ARGUMENT, ["model_spec.name is empty"]),
}


@pytest.fixture(scope="module")
def multi(server_for):  # type: ignore[no-untyped-def]
    return server_for("multi", "--replicas", "2", "--max-batch-size", "16", "--batch-timeout-ms", "20")


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_named_error(multi, case: str) -> None:
    make, code, fragments = BAD[case]
    with PredictClient(multi.target) as client, pytest.raises(grpc.RpcError) as info:
        client.stub.Predict(make(), timeout=30)
    assert info.value.code() == code, info.value.details()
    for fragment in fragments:
        assert fragment in info.value.details(), (fragment, info.value.details())


def test_unsupported_dtype_named(multi) -> None:
    request = good()
    request.inputs["a"].dtype = 11  # DT_QINT8
    with PredictClient(multi.target) as client, pytest.raises(grpc.RpcError) as info:
        client.stub.Predict(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'a': unsupported dtype DT_QINT8" in info.value.details()


def test_metadata_errors(multi) -> None:
    with PredictClient(multi.target) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.stub.GetModelMetadata(build_metadata_request("nope"), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "model 'nope' not found" in info.value.details()
        empty = build_metadata_request("multi")
        del empty.metadata_field[:]
        with pytest.raises(grpc.RpcError) as info:
            client.stub.GetModelMetadata(empty, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "metadata_field" in info.value.details()


def test_good_requests_unharmed_by_bad_neighbours(multi) -> None:
    """Bad and good requests interleaved inside one batching window: every good one succeeds."""
    async def run() -> tuple[list[Any], list[Any]]:
        async with AsyncPredictClient(multi.target) as client:
            goods = []
            bads = []
            for i in range(40):
                a = np.full((1 + i % 3, 3), i, np.float32)
                b = np.full(1 + i % 3, i % 5, np.int32)
                goods.append(client.stub.Predict(build_predict_request("multi", {"a": a, "b": b}), timeout=30))
                make, _, _ = BAD[sorted(BAD)[i % len(BAD)]]
                bads.append(client.stub.Predict(make(), timeout=30))
            good_results = await asyncio.gather(*goods, return_exceptions=True)
            bad_results = await asyncio.gather(*bads, return_exceptions=True)
            return good_results, bad_results

    good_results, bad_results = asyncio.run(run())
    for i, response in enumerate(good_results):
        assert not isinstance(response, Exception), response
        c = np.array(response.outputs["c"].float_val, np.float32).reshape(-1, 3)  # as TF Serving's clients read
        expected = np.full((1 + i % 3, 3), i, np.float32) * [1.0, 2.0, 3.0] * (i % 5)
        np.testing.assert_allclose(c, expected)
    for response in bad_results:
        assert isinstance(response, grpc.aio.AioRpcError)
        assert response.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


def test_signatures_strings_and_output_filter(multi) -> None:
    with PredictClient(multi.target) as client:
        only_c = client.predict("multi", {"a": A, "b": B}, output_filter=["c"])
        assert set(only_c) == {"c"}
        np.testing.assert_allclose(only_c["c"], A * [1.0, 2.0, 3.0] * B[:, None])
        total = client.predict("multi", {"a": A}, signature="total")
        np.testing.assert_allclose(total["total"], A.sum(axis=1))
        words = np.array([b"ab", "héllo".encode(), b""], dtype=object)
        out = client.predict("multi", {"s": words}, signature="strlen")
        assert out["n"].tolist() == [2, 6, 0]
        assert out["upper"].tolist() == [b"AB", "HéLLO".encode(), b""]
        defs = client.signature_defs("multi")
        assert sorted(defs) == ["serving_default", "strlen", "total"]
        assert to_tensor_proto(A).dtype == defs["serving_default"].inputs["a"].dtype
