"""The REST codecs, exactly: JSON tensors (server.api.http.json_codec), TF Serving's row and columnar
formats (server.api.tfserving.rest_json), and the v2 REST body with the binary extension (server.api.v2.rest_json)."""

from __future__ import annotations

import numpy as np
import pytest

from server.api.http import json_codec
from server.api.tfserving import rest_json as tfs_json
from server.api.v2 import rest_json as v2_json
from server.core.signatures import TensorSpec
from server.errors import InvalidInput

F32, I8, I32, I64, BOOL, STR = (np.dtype(t) for t in ("float32", "int8", "int32", "int64", "bool", "object"))
ONE = {"x": TensorSpec(F32, (None, 2))}
TWO = {"a": TensorSpec(F32, (None, 3)), "b": TensorSpec(I32, (None,))}


def refused(call: object, *args: object) -> str:
    with pytest.raises(InvalidInput) as caught:
        call(*args)  # type: ignore[operator]
    return str(caught.value)


def test_json_numbers_are_converted_with_their_range_checked() -> None:
    array = json_codec.array_from_json([[1, 2.5]], F32, "input 'x'", "DT_FLOAT")
    assert array.dtype == F32 and array.tolist() == [[1.0, 2.5]]
    assert json_codec.array_from_json([-128, 127], I8, "x", "INT8").tolist() == [-128, 127]
    assert json_codec.array_from_json([2.0], I32, "x", "INT32").dtype == I32
    assert refused(json_codec.array_from_json, [128], I8, "input 'x'", "INT8") == \
        "input 'x' is INT8: 128 is outside [-128, 127]"
    assert refused(json_codec.array_from_json, [1.5], I64, "input 'x'", "DT_INT64") == \
        "input 'x' is DT_INT64: 1.5 is not an integer"
    assert refused(json_codec.array_from_json, [1e39], F32, "input 'x'", "DT_FLOAT") == \
        "input 'x' is DT_FLOAT: 1e+39 is out of its range"
    assert "regular array" in refused(json_codec.array_from_json, [[1], [2, 3]], F32, "x", "T")
    assert "a string is not allowed" in refused(json_codec.array_from_json, ["1"], F32, "x", "T")
    assert "not true or false" in refused(json_codec.array_from_json, [True], F32, "x", "T")
    assert "must be true or false" in refused(json_codec.array_from_json, [1], BOOL, "x", "T")
    assert "found null" in refused(json_codec.array_from_json, [None], F32, "x", "T")


def test_json_strings_are_text_or_b64() -> None:
    array = json_codec.array_from_json([["ü", {"b64": "AAE="}]], STR, "s", "DT_STRING")
    assert array.shape == (1, 2) and array.tolist() == [["ü".encode(), b"\0\1"]]
    assert "not valid base64" in refused(json_codec.array_from_json, [{"b64": "%"}], STR, "s", "T")
    assert "regular array" in refused(json_codec.array_from_json, [["a"], "b"], STR, "s", "T")
    assert "must be strings" in refused(json_codec.array_from_json, [1], STR, "s", "T")


def test_json_output_values() -> None:
    assert json_codec.dumps(json_codec.array_to_json(np.array([0.5, np.nan, -np.inf], np.float32))) == \
        b"[0.5, NaN, -Infinity]"
    assert json_codec.dumps(json_codec.array_to_json(np.array([b"ok", b"\xff"], object))) == \
        b'["ok",{"b64":"/w=="}]'
    assert json_codec.dumps(json_codec.array_to_json(np.array([b"ok"], object), b64=True)) == b'[{"b64":"b2s="}]'
    assert json_codec.loads(b"[NaN]")[0] != json_codec.loads(b"[NaN]")[0]
    assert refused(json_codec.loads, b'{"a": ') == \
        "the body is not valid JSON: Expecting value: line 1 column 7 (char 6)"


def test_tf_serving_row_and_columnar_formats() -> None:
    assert tfs_json.parse_predict({"instances": [[1, 2]], "signature_name": "s"}) == ("s", [[1, 2]], True)
    assert tfs_json.parse_predict({"inputs": {"x": [[1, 2]]}}) == ("", {"x": [[1, 2]]}, False)
    assert "exactly one of" in refused(tfs_json.parse_predict, {"instances": [], "inputs": []})
    assert "unknown field 'x'" in refused(tfs_json.parse_predict, {"x": 1})
    rows = tfs_json.decode_inputs([[1, 2], [3, 4]], True, ONE)
    assert rows["x"].tolist() == [[1, 2], [3, 4]] and rows["x"].dtype == F32
    named = tfs_json.decode_inputs([{"a": [1, 2, 3], "b": 5}, {"a": [4, 5, 6], "b": 6}], True, TWO)
    assert named["a"].shape == (2, 3) and named["b"].tolist() == [5, 6]
    assert tfs_json.decode_inputs({"a": [[1, 2, 3]], "b": [7]}, False, TWO)["b"].dtype == I32
    assert "each instance must be an object naming them" in refused(tfs_json.decode_inputs, [[1, 2, 3]], True, TWO)
    assert "instance 1 does not name the same inputs" in refused(
        tfs_json.decode_inputs, [{"a": [1, 2, 3], "b": 1}, {"a": [1, 2, 3]}], True, TWO)
    assert "unexpected input 'z'" in refused(tfs_json.decode_inputs, {"z": [1]}, False, TWO)


def test_tf_serving_responses() -> None:
    outputs = {"y": np.array([[1, 2], [3, 4]], np.int64), "name_bytes": np.array([b"a", b"b"], object)}
    assert json_codec.dumps(tfs_json.encode_outputs(outputs, True)) == \
        b'{"predictions":[{"y":[1,2],"name_bytes":{"b64":"YQ=="}},{"y":[3,4],"name_bytes":{"b64":"Yg=="}}]}'
    assert json_codec.dumps(tfs_json.encode_outputs({"y": outputs["y"]}, True)) == b'{"predictions":[[1,2],[3,4]]}'
    assert json_codec.dumps(tfs_json.encode_outputs({"y": outputs["y"]}, False)) == b'{"outputs":[[1,2],[3,4]]}'


def test_v2_json_and_binary_inputs() -> None:
    raw = np.array([1.5, 2.5], np.float32).tobytes()
    header = {"id": "7", "parameters": {"binary_data_output": True, "timeout": 5},
              "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
                         {"name": "s", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}],
              "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
    request = v2_json.parse_infer(header, memoryview(raw), 1 << 20)
    assert (request.id, request.timeout_us, request.all_binary, request.outputs) == ("7", 5, True, ["y"])
    assert request.inputs["x"].tolist() == [[1.5, 2.5]] and request.inputs["s"].tolist() == [b"a", b"b"]
    json_part, binary = v2_json.split_body(b'{"a":1}' + raw, "7")
    assert json_part == b'{"a":1}' and bytes(binary) == raw
    assert "at most the body's" in refused(v2_json.split_body, b"{}", "9")
    tensor = {"name": "x", "shape": [1, 2], "datatype": "FP32"}
    assert "bytes after the JSON header" in refused(
        v2_json.parse_infer, {"inputs": [{**tensor, "data": [1, 2]}]}, memoryview(b"xx"), 100)
    assert "exactly one of" in refused(v2_json.parse_infer, {"inputs": [tensor]}, memoryview(b""), 100)
    assert "needs 2 values, got 3" in refused(
        v2_json.parse_infer, {"inputs": [{**tensor, "data": [1, 2, 3]}]}, memoryview(b""), 100)
    assert "unknown field 'extra'" in refused(v2_json.parse_infer, {"inputs": [], "extra": 1}, memoryview(b""), 100)
    assert "'timeout' must be a non-negative integer" in refused(
        v2_json.parse_infer, {"parameters": {"timeout": -1}, "inputs": []}, memoryview(b""), 100)


def test_v2_responses_json_or_binary() -> None:
    y = np.array([[1, 2]], np.int32)
    plain = v2_json.InferRequest("", "serving_default", None, {})
    assert v2_json.encode_infer("m", "1", plain, {"y": y}) == (
        b'{"model_name":"m","model_version":"1","outputs":[{"name":"y","datatype":"INT32","shape":[1,2],'
        b'"data":[1,2]}]}', None)
    binary = v2_json.InferRequest("q", "serving_default", None, {}, binary_outputs={"y"})
    body, length = v2_json.encode_infer("m", "1", binary, {"y": y})
    assert length is not None and body[length:] == y.tobytes()
    assert b'"id":"q"' in body[:length] and b'"parameters":{"binary_data_size":8}' in body[:length]



def test_json_has_no_complex_numbers_either_way() -> None:
    from server.api.http.json_codec import array_from_json, array_to_json

    with pytest.raises(InvalidInput, match="a complex64 output cannot be written as JSON"):
        array_to_json(np.array([1 + 2j], np.complex64))
    with pytest.raises(InvalidInput, match="input 'z' is DT_COMPLEX64: JSON has no complex numbers"):
        array_from_json([1.0, 2.0], np.dtype(np.complex64), "input 'z'", "DT_COMPLEX64")
