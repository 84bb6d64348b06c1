"""Both REST APIs on a real server: TF Serving's /v1 and the Open Inference Protocol's /v2, called
with a plain HTTP client and with tritonclient's HTTP client, unchanged. Answers are checked against
the SavedModels called in-process (float, int, string and bool models); REST and gRPC requests share
batches; deadlines, load shedding and the body limit answer by name; fuzzed bodies leave it serving.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import sys
import threading
import time
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
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

MODELS = ("demo", "echo", "multi", "logic", "slow")
MAX_BODY = 1 << 20
MAX_QUEUED_ROWS = 256


@pytest.fixture(scope="module")
def rest_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("rest")
    blocks = "".join(f'  config {{ name: "{m}" base_path: "{model_dirs[m]}" }}\n' for m in MODELS)
    (root / "models.config").write_text("model_config_list {\n" + blocks + "}\n")
    # One batch at a time, so a slow batch holds the others back and they meet in the queue.
    server = start_server(["--model-config-file", str(root / "models.config"), "--drain-delay-s", "0",
                           "--max-inflight-batches", "1", "--max-message-bytes", str(MAX_BODY),
                           "--max-queued-rows", str(MAX_QUEUED_ROWS)], root / "server.log")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def direct(model_dirs: dict[str, Path]) -> dict[str, Any]:
    import tensorflow as tf

    return {m: tf.saved_model.load(str(model_dirs[m] / "1")).signatures for m in MODELS if m != "slow"}


class Http:
    """One keep-alive connection, as a plain HTTP client uses it."""

    def __init__(self, server: ServerProcess) -> None:
        self._connection = http.client.HTTPConnection("127.0.0.1", server.rest_port, timeout=30)

    def call(self, method: str, path: str, body: bytes | str | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        data = body.encode() if isinstance(body, str) else body
        try:
            self._connection.request(method, path, body=data, headers=headers or {})
            response = self._connection.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        except Exception:
            self._connection.close()  # the next call starts afresh instead of failing on this one's state
            raise

    def json(self, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
        status, _, data = self.call(method, path, None if body is None else json.dumps(body), headers)
        return status, json.loads(data)


@pytest.fixture(scope="module")
def web(rest_server: ServerProcess) -> Http:
    return Http(rest_server)


def expected(direct: dict[str, Any], model: str, signature: str = "serving_default", **inputs: Any) -> dict[str, Any]:
    return {k: v.numpy() for k, v in direct[model][signature](**inputs).items()}


def test_tf_serving_status_and_metadata(web: Http) -> None:
    assert web.json("GET", "/v1/models/demo") == (200, {"model_version_status": [
        {"version": "1", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}]})
    assert web.json("GET", "/v1/models/demo/versions/1")[0] == 200
    status, body = web.json("GET", "/v1/models/demo/versions/7")
    assert status == 404 and "version 7 not found" in body["error"]
    status, body = web.json("GET", "/v1/models/nope")
    assert status == 404 and "model 'nope' not found" in body["error"]
    status, body = web.json("GET", "/v1/models/multi/metadata")
    assert status == 200 and body["model_spec"] == {"name": "multi", "signature_name": "", "version": "1"}
    signatures = body["metadata"]["signature_def"]["signature_def"]
    assert set(signatures) >= {"serving_default", "total", "strlen"}
    assert signatures["strlen"]["inputs"]["s"]["dtype"] == "DT_STRING"


def test_tf_serving_predict_matches_the_model_in_process(web: Http, direct: dict[str, Any]) -> None:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    want = expected(direct, "demo", x=x)
    status, body = web.json("POST", "/v1/models/demo:predict", {"instances": x.tolist()})
    assert status == 200, body
    np.testing.assert_allclose([p["probabilities"] for p in body["predictions"]], want["probabilities"], rtol=1e-6)
    assert [p["class_id"] for p in body["predictions"]] == want["class_id"].tolist()
    status, body = web.json("POST", "/v1/models/demo/versions/1:predict", {"inputs": {"x": x.tolist()}})
    assert status == 200 and body["outputs"]["class_id"] == want["class_id"].tolist()

    rows = rng.integers(-2**53, 2**53, (4, 2)).astype(np.int64)
    status, body = web.json("POST", "/v1/models/echo:predict", {"inputs": rows.tolist()})
    assert status == 200 and body["outputs"]["y"] == rows.tolist() and body["outputs"]["first"] == rows[:, 0].tolist()

    a, b = rng.standard_normal((2, 3)).astype(np.float32), np.array([3, -4], np.int32)
    status, body = web.json("POST", "/v1/models/multi:predict", {"instances": [
        {"a": a[i].tolist(), "b": int(b[i])} for i in range(2)]})
    want = expected(direct, "multi", a=a, b=b)
    assert status == 200, body
    np.testing.assert_allclose([p["c"] for p in body["predictions"]], want["c"], rtol=1e-6)
    assert [p["b_twice"] for p in body["predictions"]] == want["b_twice"].tolist()

    words = [b"plain", "ünï".encode(), b"\xff\x00binary"]
    instances = ["plain", "ünï", {"b64": base64.b64encode(words[2]).decode()}]
    status, body = web.json("POST", "/v1/models/multi:predict", {"signature_name": "strlen", "instances": instances})
    want = expected(direct, "multi", "strlen", s=np.array(words))
    assert status == 200, body
    assert [p["n"] for p in body["predictions"]] == want["n"].tolist()
    upper = [p["upper"] for p in body["predictions"]]
    assert upper[:2] == [w.decode() for w in want["upper"][:2]]
    assert base64.b64decode(upper[2]["b64"]) == want["upper"][2], "bytes that are not UTF-8 come back as b64"

    flags = rng.integers(0, 2, (5, 3)).astype(bool)
    status, body = web.json("POST", "/v1/models/logic:predict", {"inputs": {"flags": flags.tolist()}})
    want = expected(direct, "logic", flags=flags)
    assert status == 200 and {k: body["outputs"][k] for k in want} == {k: v.tolist() for k, v in want.items()}


def test_v2_rest_with_a_plain_http_client(web: Http, direct: dict[str, Any]) -> None:
    assert web.json("GET", "/v2/health/live") == (200, {"live": True})
    assert web.json("GET", "/v2/health/ready") == (200, {"ready": True})
    assert web.json("GET", "/v2/models/demo/ready") == (200, {"name": "demo", "ready": True})
    assert web.json("GET", "/v2/models/demo/versions/3/ready") == (400, {"name": "demo", "ready": False})
    status, meta = web.json("GET", "/v2/models/echo")
    assert status == 200 and meta["inputs"] == [{"name": "x", "datatype": "INT64", "shape": [-1, 2]}]
    assert web.json("GET", "/v2")[1]["name"] == "mirrorserve"

    x = np.random.default_rng(5).standard_normal((2, 8)).astype(np.float32)
    status, body = web.json("POST", "/v2/models/demo/versions/1/infer", {
        "id": "q1", "inputs": [{"name": "x", "shape": [2, 8], "datatype": "FP32", "data": x.ravel().tolist()}]})
    want = expected(direct, "demo", x=x)
    assert status == 200 and (body["id"], body["model_version"]) == ("q1", "1")
    outputs = {o["name"]: o for o in body["outputs"]}
    np.testing.assert_allclose(np.reshape(outputs["probabilities"]["data"], (2, 3)), want["probabilities"], rtol=1e-6)
    assert (outputs["class_id"]["datatype"], outputs["class_id"]["data"]) == ("INT64", want["class_id"].tolist())

    status, body = web.json("POST", "/v2/models/multi/infer", {
        "parameters": {"signature_name": "strlen"}, "outputs": [{"name": "n"}],
        "inputs": [{"name": "s", "shape": [2], "datatype": "BYTES", "data": ["ab", "ünï"]}]})
    assert status == 200 and body["outputs"] == [{"name": "n", "datatype": "INT32", "shape": [2], "data": [2, 5]}]


def triton_inputs(arrays: dict[str, np.ndarray], binary: bool) -> list[Any]:
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        tensor = triton_http.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    return inputs


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_http_unchanged(rest_server: ServerProcess, direct: dict[str, Any], binary: bool) -> None:
    client = triton_http.InferenceServerClient(f"127.0.0.1:{rest_server.rest_port}")
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("logic")
        assert not client.is_model_ready("nope")
        assert client.get_model_metadata("multi")["platform"] == "tensorflow_savedmodel"
        rng = np.random.default_rng(int(binary))
        x = rng.standard_normal((4, 8)).astype(np.float32)
        outputs = [triton_http.InferRequestedOutput(n, binary_data=binary) for n in ("probabilities", "class_id")]
        result = client.infer("demo", triton_inputs({"x": x}, binary), outputs=outputs)
        want = expected(direct, "demo", x=x)
        np.testing.assert_allclose(result.as_numpy("probabilities"), want["probabilities"], rtol=1e-6)
        np.testing.assert_array_equal(result.as_numpy("class_id"), want["class_id"])

        rows = rng.integers(-2**60, 2**60, (3, 2)).astype(np.int64)
        result = client.infer("echo", triton_inputs({"x": rows}, binary),
                              outputs=[triton_http.InferRequestedOutput("y", binary_data=binary)])
        np.testing.assert_array_equal(result.as_numpy("y"), rows)

        words = np.array([b"a", "ünï".encode(), b"x" * 100], dtype=object)
        result = client.infer("multi", triton_inputs({"s": words}, binary), parameters={"signature_name": "strlen"},
                              outputs=[triton_http.InferRequestedOutput(n, binary_data=binary) for n in ("n", "upper")])
        want = expected(direct, "multi", "strlen", s=words.astype(bytes))
        np.testing.assert_array_equal(result.as_numpy("n"), want["n"])
        assert [bytes(v) if binary else v.encode() if isinstance(v, str) else bytes(v)
                for v in result.as_numpy("upper")] == list(want["upper"])

        flags = rng.integers(0, 2, (3, 3)).astype(bool)
        result = client.infer("logic", triton_inputs({"flags": flags}, binary),
                              outputs=[triton_http.InferRequestedOutput("count", binary_data=binary)])
        np.testing.assert_array_equal(result.as_numpy("count"), expected(direct, "logic", flags=flags)["count"])

        with pytest.raises(InferenceServerException) as caught:
            client.infer("demo", triton_inputs({"x": np.zeros((1, 7), np.float32)}, binary))
        assert "'x'" in caught.value.message() and "[-1, 8]" in caught.value.message()
    finally:
        client.close()


HOLD_WORK = 15_000
"""Matmul iterations of the slow model that keep it busy for about a second."""


def hold_the_slow_model(server: ServerProcess, call: Any) -> threading.Thread:
    """Start `call` (a request of HOLD_WORK) on a thread; return once its batch is executing."""
    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 10
    while server.metric("mirrorserve_batches_in_flight", model="slow") < 1:
        assert time.monotonic() < deadline, "the slow batch did not start"
        time.sleep(0.01)
    return thread


def test_rest_and_grpc_requests_share_a_batch_and_each_get_their_rows(rest_server: ServerProcess) -> None:
    """A slow batch holds the model (one batch at a time); a REST TF Serving request, a REST v2
    request and a gRPC one that arrive meanwhile leave together in the next batch."""
    before = (rest_server.metric("mirrorserve_batch_rows_count", model="slow"),
              rest_server.metric("mirrorserve_batch_rows_sum", model="slow"))
    answers: dict[str, Any] = {}

    def grpc_call(key: str, request: Any) -> None:
        with grpc.insecure_channel(rest_server.target) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            answers[key] = decode_outputs(stub.Predict(request, timeout=60))["y"].tolist()

    def rest_call(key: str, path: str, body: Any) -> None:
        answers[key] = Http(rest_server).json("POST", path, body)

    blocker = hold_the_slow_model(rest_server, lambda: grpc_call("blocker", build_predict_request(
        "slow", {"x": np.array([[HOLD_WORK, 1.0]], np.float32)})))
    calls = [
        threading.Thread(target=grpc_call, args=("grpc", build_predict_request(
            "slow", {"x": np.array([[0, 10], [0, 11]], np.float32)}))),
        threading.Thread(target=rest_call, args=("tfs", "/v1/models/slow:predict",
                                                 {"instances": [[0, 20], [0, 21], [0, 22]]})),
        threading.Thread(target=rest_call, args=("v2", "/v2/models/slow/infer", {"inputs": [
            {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [0, 30]}]})),
    ]
    for call in calls:
        call.start()
    for thread in [blocker, *calls]:
        thread.join()
    assert answers["blocker"] == [2.0]
    assert answers["grpc"] == [20.0, 22.0]
    assert answers["tfs"] == (200, {"predictions": [40.0, 42.0, 44.0]})
    assert answers["v2"][0] == 200 and answers["v2"][1]["outputs"][0]["data"] == [60.0]
    after = (rest_server.metric("mirrorserve_batch_rows_count", model="slow"),
             rest_server.metric("mirrorserve_batch_rows_sum", model="slow"))
    assert (after[0] - before[0], after[1] - before[1]) == (2, 1 + 6), "blocker alone, then 2 + 3 + 1 rows together"
    for protocol, method in (("tfserving-rest", "Predict"), ("v2-rest", "ModelInfer"), ("tfserving", "Predict")):
        assert rest_server.metric("mirrorserve_requests_total", protocol=protocol, model="slow", method=method,
                                  code="OK") >= 1, protocol


def test_deadline_overload_and_body_limit_answer_by_name(rest_server: ServerProcess, web: Http) -> None:
    blocker = hold_the_slow_model(rest_server, lambda: Http(rest_server).json(
        "POST", "/v1/models/slow:predict", {"instances": [[HOLD_WORK, 1]]}))
    status, body = web.json("POST", "/v1/models/slow:predict", {"instances": [[0, 1]]}, **{"Grpc-Timeout": "100m"})
    assert status == 504, body
    status, body = web.json("POST", "/v2/models/slow/infer", {"parameters": {"timeout": 100_000}, "inputs": [
        {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [0, 1]}]})
    assert status == 504, body
    blocker.join()
    status, body = web.json("POST", "/v1/models/slow:predict", {"instances": [[0, 1]] * (MAX_QUEUED_ROWS + 1)})
    assert status == 429 and f"at most {MAX_QUEUED_ROWS} rows" in body["error"]
    status, _, raw = web.call("POST", "/v1/models/demo:predict", b"[" + b"0," * MAX_BODY + b"0]")
    assert status == 413 and b"limit is 1048576" in raw
    # Far more than the sockets buffer: refused by its length, read and dropped while the client,
    # which reads nothing before it has sent everything, is still sending; then its 413.
    status, headers, raw = web.call("POST", "/v1/models/demo:predict", b"0" * (32 * MAX_BODY))
    assert status == 413 and b"limit is 1048576" in raw and headers["Connection"] == "close"
    status, body = web.json("POST", "/v1/models/demo:predict", {"instances": [[0] * 8]}, **{"Grpc-Timeout": "soon"})
    assert status == 400 and "Grpc-Timeout 'soon'" in body["error"]
    assert rest_server.metric("mirrorserve_requests_total", protocol="tfserving-rest", model="slow",
                              code="DEADLINE_EXCEEDED") >= 1


BAD = {
    "not JSON": ("/v1/models/demo:predict", b"{nope", 400, "not valid JSON"),
    "no instances": ("/v1/models/demo:predict", {"signature_name": ""}, 400, 'exactly one of "instances"'),
    "unknown field": ("/v1/models/demo:predict", {"instances": [[0] * 8], "extra": 1}, 400, "'extra'"),
    "ragged": ("/v1/models/demo:predict", {"instances": [[0] * 8, [0] * 7]}, 400, "regular array"),
    "string for float": ("/v1/models/demo:predict", {"instances": [["a"] * 8]}, 400, "input 'x' is DT_FLOAT"),
    "fraction for int": ("/v1/models/echo:predict", {"instances": [[1.5, 2]]}, 400, "1.5 is not an integer"),
    "int32 overflow": ("/v1/models/multi:predict", {"instances": [{"a": [1, 2, 3], "b": 2**40}]}, 400,
                       "outside [-2147483648, 2147483647]"),
    "bad b64": ("/v1/models/multi:predict", {"signature_name": "strlen", "instances": [{"b64": "%%"}]}, 400,
                "not valid base64"),
    "unknown signature": ("/v1/models/demo:predict", {"signature_name": "zz", "instances": [[0] * 8]}, 400,
                          "signature 'zz' not found"),
    "unknown model": ("/v1/models/nope:predict", {"instances": [[0] * 8]}, 404, "model 'nope' not found"),
    "classify on a predict signature": ("/v1/models/demo:classify", {"examples": [{"x": 1}]}, 400,
                                        "cannot classify: a classify signature has exactly one input, 'inputs'"),
    "v2 shape against data": ("/v2/models/demo/infer", {"inputs": [
        {"name": "x", "shape": [2, 8], "datatype": "FP32", "data": [0] * 8}]}, 400, "needs 16 values, got 8"),
    "v2 huge shape": ("/v2/models/demo/infer", {"inputs": [
        {"name": "x", "shape": [2**40, 8], "datatype": "FP32", "data": []}]}, 400, "the limit is"),
    "v2 unknown datatype": ("/v2/models/demo/infer", {"inputs": [
        {"name": "x", "shape": [1], "datatype": "FP8", "data": [0]}]}, 400, "unknown datatype 'FP8'"),
    "v2 binary size past the end": ("/v2/models/demo/infer", {"inputs": [
        {"name": "x", "shape": [1, 8], "datatype": "FP32", "parameters": {"binary_data_size": 32}}]}, 400,
        "only 0 remain"),
    "v2 version not a number": ("/v2/models/demo/versions/v1/infer", {"inputs": []}, 400, "not a version number"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_rest_input_gets_a_named_error(web: Http, case: str) -> None:
    path, body, code, fragment = BAD[case]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    if "binary size" in case:
        status, _, raw = web.call("POST", path, data, {"Inference-Header-Content-Length": str(len(data))})
    else:
        status, _, raw = web.call("POST", path, data)
    assert status == code, raw
    assert fragment in json.loads(raw)["error"], raw


JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                        st.text(max_size=6), st.just({"b64": "aGk="}))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
    st.sampled_from(["x", "a", "b", "s", "flags", "b64", "zz"]), inner, max_size=3), max_leaves=30)
PATHS = ["/v1/models/demo:predict", "/v1/models/multi:predict", "/v1/models/echo/versions/1:predict",
         "/v1/models/logic:predict", "/v2/models/demo/infer", "/v2/models/multi/infer", "/v2/models/logic/infer"]


@st.composite
def fuzzed_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(PATHS))
    if path.startswith("/v1"):
        body: Any = {draw(st.sampled_from(["instances", "inputs"])): draw(JSON_VALUES)}
        if draw(st.booleans()):
            body["signature_name"] = draw(st.sampled_from(["", "strlen", "total", 3]))
    else:
        tensor = {"name": draw(st.sampled_from(["x", "s", "flags", "a"])),
                  "shape": draw(st.lists(st.integers(-1, 2**33), max_size=3)),
                  "datatype": draw(st.sampled_from(["FP32", "INT64", "BYTES", "BOOL", "INT8", "FP16", "BF16", "x"])),
                  "data": draw(JSON_VALUES)}
        body = {"inputs": [tensor]}
        if draw(st.booleans()):
            body["outputs"] = [{"name": draw(st.sampled_from(["n", "probabilities", "nope"]))}]
    text = json.dumps(body).encode()
    if draw(st.booleans()):
        text = text[:draw(st.integers(0, len(text)))]
    return path, text


FUZZ_EXAMPLES = int(os.environ.get("REST_FUZZ_EXAMPLES", "300"))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(case=fuzzed_bodies())
def test_fuzzed_rest_bodies_are_answered_or_refused_by_name(web: Http, case: tuple[str, bytes]) -> None:
    path, body = case
    status, _, raw = web.call("POST", path, body)
    assert status in (200, 400, 404), (status, raw, path, body)
    if status != 200:
        message = json.loads(raw)["error"]
        assert message and message != "internal error", (raw, body)
    assert web.call("GET", "/v2/health/live")[0] == 200


def test_metrics_on_the_rest_port_under_both_paths(web: Http) -> None:
    status, headers, page = web.call("GET", "/monitoring/prometheus/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert b'protocol="tfserving-rest"' in page and b"mirrorserve_model_ready" in page
    assert web.call("GET", "/metrics")[0] == 200
    status, body = web.json("GET", "/v1/nothing/here")
    assert status == 404 and "/v1/models/NAME" in body["error"]
