"""The Open Inference Protocol (KServe v2) over gRPC, driven by Triton's own client, unchanged:
health and metadata, inference for float, int, string and bool models checked against the
SavedModels called in-process, raw and typed contents, output selection, shared batches with
TF Serving clients, and bad input (named, fuzzed) that leaves the server serving.

tritonclient registers the protocol's proto symbols, as our generated code does; the two cannot
live in one process, so nothing here imports protos.inference (the server does, in its own).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.api import build_predict_request, decode_outputs
from protos.tensorflow_serving import prediction_service_pb2_grpc
from tests.integration.conftest import ServerProcess, start_server, triton_client_path

sys.path.insert(0, triton_client_path())
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

BATCH_WAIT_MS = 300


@pytest.fixture(scope="module")
def v2_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("v2")
    blocks = "".join(f'  config {{ name: "{m}" base_path: "{model_dirs[m]}" }}\n'
                     for m in ("demo", "echo", "multi", "logic"))
    (root / "models.config").write_text("model_config_list {\n" + blocks + "}\n")
    server = start_server(["--model-config-file", str(root / "models.config"), "--drain-delay-s", "0",
                           "--batch-timeout-ms", str(BATCH_WAIT_MS), "--max-batch-size", "64"],
                          root / "server.log")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def client(v2_server: ServerProcess) -> Iterator[Any]:
    with triton.InferenceServerClient(v2_server.target) as c:
        yield c


@pytest.fixture(scope="module")
def direct(model_dirs: dict[str, Path]) -> dict[str, Any]:
    """Each model's signatures, called in-process: what the server must answer."""
    import tensorflow as tf

    loaded = {m: tf.saved_model.load(str(model_dirs[m] / "1")) for m in ("demo", "echo", "multi", "logic")}
    return {m: model.signatures for m, model in loaded.items()}


def infer(client: Any, model: str, arrays: dict[str, np.ndarray], outputs: list[str] | None = None,
          **kwargs: Any) -> Any:
    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == object else triton_dtype(array.dtype)
        tensor = triton.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    requested = None if outputs is None else [triton.InferRequestedOutput(o) for o in outputs]
    return client.infer(model, inputs, outputs=requested, **kwargs)


def triton_dtype(dtype: np.dtype) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return str(np_to_triton_dtype(dtype))


def test_health_and_metadata(client: Any) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("demo") and client.is_model_ready("demo", "1")
    assert not client.is_model_ready("demo", "2") and not client.is_model_ready("nope")
    server = client.get_server_metadata()
    assert server.name == "mirrorserve" and server.version
    meta = client.get_model_metadata("demo")
    assert (meta.name, list(meta.versions), meta.platform) == ("demo", ["1"], "tensorflow_savedmodel")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("x", "FP32", [-1, 8])]
    assert sorted((t.name, t.datatype, list(t.shape)) for t in meta.outputs) == [
        ("class_id", "INT64", [-1]), ("probabilities", "FP32", [-1, 3])]
    logic = client.get_model_metadata("logic")
    assert [(t.name, t.datatype) for t in logic.inputs] == [("flags", "BOOL")]
    x = np.zeros((1, 8), np.float32)
    assert infer(client, "demo", {"x": x}, model_version="1").get_response().model_version == "1"
    with pytest.raises(InferenceServerException) as caught:
        infer(client, "demo", {"x": x}, model_version="2")
    assert "NOT_FOUND" in str(caught.value.status()) and "version 2 not found" in caught.value.message()


def test_fp32_int64_bytes_and_bool_models_match_the_model_in_process(client: Any, direct: dict[str, Any]) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    result = infer(client, "demo", {"x": x})
    expected = {k: v.numpy() for k, v in direct["demo"]["serving_default"](x=x).items()}
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected["probabilities"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("class_id"), expected["class_id"])
    assert result.get_response().model_version == "1"

    rows = rng.integers(-2**40, 2**40, (4, 2)).astype(np.int64)
    result = infer(client, "echo", {"x": rows})
    np.testing.assert_array_equal(result.as_numpy("y"), rows)
    np.testing.assert_array_equal(result.as_numpy("first"), rows[:, 0])

    words = np.array([b"", b"abc", "ünï".encode(), b"x" * 300], dtype=object)
    result = infer(client, "multi", {"s": words}, parameters={"signature_name": "strlen"})
    expected = {k: v.numpy() for k, v in direct["multi"]["strlen"](s=words.astype(bytes)).items()}
    np.testing.assert_array_equal(result.as_numpy("n"), expected["n"])
    assert list(result.as_numpy("upper")) == list(expected["upper"])

    flags = rng.integers(0, 2, (6, 3)).astype(bool)
    result = infer(client, "logic", {"flags": flags})
    expected = {k: v.numpy() for k, v in direct["logic"]["serving_default"](flags=flags).items()}
    for name in ("any", "all", "count"):
        np.testing.assert_array_equal(result.as_numpy(name), expected[name])


def test_typed_contents_give_the_same_answer_as_raw(v2_server: ServerProcess, direct: dict[str, Any]) -> None:
    """binary (raw_input_contents) off: every input in its typed contents field."""
    x = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
    request = service_pb2.ModelInferRequest(model_name="demo", id="typed-1")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[3, 8])
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(v2_server.target) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert response.id == "typed-1"
    outputs = {o.name: (o, raw) for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)}
    probabilities = np.frombuffer(outputs["probabilities"][1], np.float32).reshape(3, 3)
    expected = direct["demo"]["serving_default"](x=x)["probabilities"].numpy()
    np.testing.assert_allclose(probabilities, expected, rtol=1e-5, atol=1e-6)
    assert list(outputs["probabilities"][0].shape) == [3, 3]


def test_bf16_travels_raw_both_ways(v2_server: ServerProcess) -> None:
    import ml_dtypes

    h = np.array([[1.5, -4.0], [0.25, 3.0]], dtype=ml_dtypes.bfloat16)
    request = raw_request("logic", "h", "BF16", [2, 2], h.tobytes())
    request.parameters["signature_name"].string_param = "halve"
    with grpc.insecure_channel(v2_server.target) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    (output,) = response.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("half", "BF16", [2, 2])
    half = np.frombuffer(response.raw_output_contents[0], dtype=ml_dtypes.bfloat16).reshape(2, 2)
    assert half.astype(np.float32).tolist() == [[0.75, -2.0], [0.125, 1.5]]


def test_a_request_naming_one_output_gets_only_it(client: Any) -> None:
    result = infer(client, "demo", {"x": np.zeros((2, 8), np.float32)}, outputs=["class_id"])
    assert [o.name for o in result.get_response().outputs] == ["class_id"]
    assert result.as_numpy("class_id").shape == (2,)


def test_v2_and_tf_serving_requests_share_a_batch_and_each_get_their_rows(v2_server: ServerProcess,
                                                                          client: Any) -> None:
    before = (v2_server.metric("mirrorserve_batch_rows_count", model="echo"),
              v2_server.metric("mirrorserve_batch_rows_sum", model="echo"))
    tfs_rows = np.arange(6, dtype=np.int64).reshape(3, 2)
    v2_rows = np.arange(100, 110, dtype=np.int64).reshape(5, 2)
    answers: dict[str, np.ndarray] = {}

    def tfs() -> None:
        with grpc.insecure_channel(v2_server.target) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            response = stub.Predict(build_predict_request("echo", {"x": tfs_rows}), timeout=30)
            answers["tfs"] = decode_outputs(response)["y"]

    thread = threading.Thread(target=tfs)
    thread.start()
    answers["v2"] = infer(client, "echo", {"x": v2_rows}).as_numpy("y")
    thread.join()
    np.testing.assert_array_equal(answers["tfs"], tfs_rows)
    np.testing.assert_array_equal(answers["v2"], v2_rows)
    after = (v2_server.metric("mirrorserve_batch_rows_count", model="echo"),
             v2_server.metric("mirrorserve_batch_rows_sum", model="echo"))
    # Both arrived within the batch wait: one execution of 3 + 5 rows.
    assert (after[0] - before[0], after[1] - before[1]) == (1, 8)
    assert v2_server.metric("mirrorserve_requests_total", protocol="v2", model="echo", method="ModelInfer",
                            code="OK") >= 1
    assert v2_server.metric("mirrorserve_requests_total", protocol="tfserving", model="echo", method="Predict",
                            code="OK") >= 1


def raw_request(model: str, name: str, datatype: str, shape: list[int], raw: bytes) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)
    return request


def both_contents() -> Any:
    request = raw_request("demo", "x", "FP32", [1, 8], np.zeros((1, 8), np.float32).tobytes())
    request.inputs[0].contents.fp32_contents.extend([0.0] * 8)
    return request


def unknown_input() -> Any:
    request = raw_request("demo", "x", "FP32", [1, 8], np.zeros((1, 8), np.float32).tobytes())
    request.inputs.add(name="z", datatype="FP32", shape=[1, 8])
    request.raw_input_contents.append(np.zeros((1, 8), np.float32).tobytes())
    return request


def unknown_output() -> Any:
    request = raw_request("demo", "x", "FP32", [1, 8], np.zeros((1, 8), np.float32).tobytes())
    request.outputs.add(name="nope")
    return request


BAD = {
    "shape against data length": (lambda: raw_request("demo", "x", "FP32", [2, 8], b"\0" * 40),
                                  grpc.StatusCode.INVALID_ARGUMENT, ["input 'x'", "40 bytes", "needs 64"]),
    "wrong datatype": (lambda: raw_request("demo", "x", "INT32", [1, 8], b"\0" * 32),
                       grpc.StatusCode.INVALID_ARGUMENT, ["'x'", "DT_FLOAT"]),
    "unknown datatype": (lambda: raw_request("demo", "x", "FP8", [1, 8], b"\0" * 8),
                         grpc.StatusCode.INVALID_ARGUMENT, ["input 'x'", "unknown datatype 'FP8'"]),
    "raw and typed at once": (both_contents, grpc.StatusCode.INVALID_ARGUMENT, ["input 'x'", "typed contents"]),
    "unknown input": (unknown_input, grpc.StatusCode.INVALID_ARGUMENT, ["'z'"]),
    "unknown output": (unknown_output, grpc.StatusCode.INVALID_ARGUMENT, ["'nope'"]),
    "unknown model": (lambda: raw_request("nope", "x", "FP32", [1, 8], b"\0" * 32),
                      grpc.StatusCode.NOT_FOUND, ["model 'nope' not found", "demo"]),
    "bad BYTES length prefix": (lambda: raw_request("multi", "s", "BYTES", [1], b"\xff\x00\x00\x00ab"),
                                grpc.StatusCode.INVALID_ARGUMENT, ["input 's'", "declares 255 bytes"]),
    "huge declared shape": (lambda: raw_request("demo", "x", "FP32", [2**40, 8], b""),
                            grpc.StatusCode.INVALID_ARGUMENT, ["input 'x'", "the limit is"]),
    "version not a number": (lambda: service_pb2.ModelInferRequest(model_name="demo", model_version="v1"),
                             grpc.StatusCode.INVALID_ARGUMENT, ["model_version 'v1' is not a version number"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_v2_input_gets_a_named_error_and_the_server_keeps_serving(v2_server: ServerProcess, client: Any,
                                                                     case: str) -> None:
    make, code, fragments = BAD[case]
    with grpc.insecure_channel(v2_server.target) as channel, pytest.raises(grpc.RpcError) as caught:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(make(), timeout=30)
    assert caught.value.code() == code, caught.value.details()
    for fragment in fragments:
        assert fragment in caught.value.details(), (fragment, caught.value.details())
    assert infer(client, "echo", {"x": np.ones((1, 2), np.int64)}).as_numpy("y").tolist() == [[1, 1]]


def test_tritonclient_sees_the_error_too(client: Any) -> None:
    with pytest.raises(InferenceServerException) as caught:
        infer(client, "demo", {"x": np.zeros((1, 7), np.float32)})
    assert "INVALID_ARGUMENT" in str(caught.value.status()) and "'x'" in caught.value.message()


DATATYPES = ["BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64", "FP16", "FP32",
             "FP64", "BF16", "BYTES", "", "fp32", "STRING"]
FIELDS = ["bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents", "fp32_contents",
          "fp64_contents", "bytes_contents"]


@st.composite
def fuzzed_requests(draw: st.DrawFn) -> Any:
    model, name = draw(st.sampled_from([("demo", "x"), ("echo", "x"), ("multi", "s"), ("logic", "flags"),
                                        ("nope", "x")]))
    request = service_pb2.ModelInferRequest(model_name=model, model_version=draw(st.sampled_from(["", "1", "2"])))
    for _ in range(draw(st.integers(0, 2))):
        tensor = request.inputs.add(name=draw(st.sampled_from([name, "x", "zz"])),
                                    datatype=draw(st.sampled_from(DATATYPES)),
                                    shape=draw(st.lists(st.integers(-2, 2**33), max_size=4)))
        if draw(st.booleans()):
            request.raw_input_contents.append(draw(st.binary(max_size=96)))
        else:
            field = draw(st.sampled_from(FIELDS))
            values: Any = {
                "bool_contents": st.booleans(), "int_contents": st.integers(-2**31, 2**31 - 1),
                "int64_contents": st.integers(-2**63, 2**63 - 1), "uint_contents": st.integers(0, 2**32 - 1),
                "uint64_contents": st.integers(0, 2**64 - 1), "fp32_contents": st.floats(width=32),
                "fp64_contents": st.floats(), "bytes_contents": st.binary(max_size=8),
            }[field]
            getattr(tensor.contents, field).extend(draw(st.lists(values, max_size=24)))
    if draw(st.booleans()):
        request.outputs.add(name=draw(st.sampled_from(["y", "probabilities", "n", "any", "nope"])))
    if draw(st.booleans()):
        request.parameters["signature_name"].string_param = draw(st.sampled_from(["", "strlen", "total", "x"]))
    return request


ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
FUZZ_EXAMPLES = int(os.environ.get("V2_FUZZ_EXAMPLES", "150"))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(request=fuzzed_requests())
def test_fuzzed_v2_requests_are_answered_or_refused_by_name(v2_server: ServerProcess, request: Any) -> None:
    with grpc.insecure_channel(v2_server.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(request, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() in ALLOWED, (exc.code(), exc.details(), request)
            assert exc.details() and exc.details() != "internal error"
        assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10).live
