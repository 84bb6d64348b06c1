"""The Open Inference Protocol's REST body (KServe v2) <-> named arrays, with Triton's binary tensor
extension. Pure: no HTTP.

A tensor is `{"name", "shape", "datatype", "data"}`, `data` in row-major order (flat or nested).
With the binary extension the body is the JSON header followed by raw tensors: the
`Inference-Header-Content-Length` header gives the JSON part's length, and an input with
`"parameters": {"binary_data_size": N}` takes the next N bytes, laid out as on gRPC
(raw_input_contents). An output is sent raw when the request asks for it (`binary_data` on the
output, or `binary_data_output` for all).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.api.http import json_codec
from server.api.v2 import codec as v2_codec
from server.errors import InvalidInput
from server.limits import ascii_int64, check_array

HEADER_LENGTH = "Inference-Header-Content-Length"
REQUEST_FIELDS = ("id", "parameters", "inputs", "outputs")
TENSOR_FIELDS = ("name", "shape", "datatype", "parameters", "data")


@dataclass(frozen=True)
class InferRequest:
    id: str
    signature_name: str
    timeout_us: int | None
    """Triton's `timeout` parameter (what tritonclient's `timeout=` sends), in microseconds."""
    inputs: dict[str, np.ndarray]
    outputs: list[str] = field(default_factory=list)
    """Outputs asked for by name, in order; empty: every output."""
    binary_outputs: set[str] = field(default_factory=set)
    all_binary: bool = False


def split_body(raw: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """(JSON part, binary part) of a body, from the Inference-Header-Content-Length header."""
    if header_length is None:
        return raw, memoryview(b"")
    length = ascii_int64(header_length.strip())
    if length is None or length > len(raw):
        raise InvalidInput(f"{HEADER_LENGTH} is '{header_length[:40]}'; it must be the JSON part's length in bytes, "
                           f"at most the body's {len(raw)}")
    return raw[:length], memoryview(raw)[length:]


def decode_infer_body(raw: bytes, header_length: str | None, max_bytes: int) -> InferRequest:
    """The request of a whole body (JSON, or JSON and binary tensors). Pure and picklable: large
    bodies are decoded in a helper process (server.api.http.body)."""
    header, binary = split_body(raw, header_length)
    return parse_infer(json_codec.loads(header), binary, max_bytes)


def json_bytes(raw: bytes, header_length: str | None) -> int:
    """How much of a body is JSON (what decoding it costs scales with)."""
    length = ascii_int64((header_length or "").strip())
    return len(raw) if length is None else min(length, len(raw))


def _object(value: Any, where: str, known: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidInput(f"{where} must be a JSON object")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise InvalidInput(f"{where} has unknown field {', '.join(repr(u) for u in unknown)}; known: "
                           f"{', '.join(known)}")
    return value


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f'{where} "parameters" must be a JSON object')
    return value


def _typed(parameters: Mapping[str, Any], key: str, kind: type, where: str, default: Any) -> Any:
    value: Any = parameters.get(key, default)
    if value is default:
        return default
    negative = isinstance(value, int) and value < 0
    if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or negative)):
        wanted = {int: "a non-negative integer", str: "a string", bool: "true or false"}[kind]
        raise InvalidInput(f"{where} parameter '{key}' must be {wanted}")
    return value


def parse_infer(body: Any, binary: memoryview, max_bytes: int) -> InferRequest:
    """The request from its JSON header and binary part; every size is checked before use."""
    request = _object(body, "the body", REQUEST_FIELDS)
    request_id = request.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput('"id" must be a string')
    parameters = _parameters(request.get("parameters"), "the request's")
    signature = _typed(parameters, "signature_name", str, "the request", "")
    timeout = _typed(parameters, "timeout", int, "the request", None)
    all_binary = _typed(parameters, "binary_data_output", bool, "the request", False)
    tensors = request.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise InvalidInput('"inputs" must be a non-empty list of tensors')
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for index, tensor in enumerate(tensors):
        name, array, used = _input(tensor, index, binary[offset:], max_bytes)
        if name in inputs:
            raise InvalidInput(f"input '{name}' is given twice")
        inputs[name] = array
        offset += used
    if offset != len(binary):
        raise InvalidInput(f"the body has {len(binary) - offset} bytes after the JSON header that no input's "
                           f"binary_data_size accounts for")
    wanted, binary_outputs = _outputs(request.get("outputs"))
    return InferRequest(request_id, signature, timeout, inputs, wanted, binary_outputs, all_binary)


def _input(tensor: Any, index: int, binary: memoryview, max_bytes: int) -> tuple[str, np.ndarray, int]:
    """(name, array, binary bytes used) of one input tensor."""
    tensor = _object(tensor, f"inputs[{index}]", TENSOR_FIELDS)
    name = tensor.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput(f'inputs[{index}] needs a "name" (a string)')
    where = f"input '{name}'"
    datatype, shape = tensor.get("datatype"), tensor.get("shape")
    if not isinstance(datatype, str):
        raise InvalidInput(f'{where} needs a "datatype" (a string such as "FP32")')
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InvalidInput(f'{where} needs a "shape" (a list of integers)')
    size = _typed(_parameters(tensor.get("parameters"), where), "binary_data_size", int, where, None)
    if (size is None) == ("data" not in tensor):
        raise InvalidInput(f'{where} must have exactly one of "data" and the binary_data_size parameter')
    if size is not None:
        if size > len(binary):
            raise InvalidInput(f"{where}: binary_data_size is {size} bytes; only {len(binary)} remain in the body")
        return name, v2_codec.decode_raw(name, datatype, shape, bytes(binary[:size]), max_bytes), size
    entry = v2_codec.BY_NAME.get(datatype)
    if entry is None:
        raise InvalidInput(f"{where}: unknown datatype '{datatype}'; supported: {', '.join(v2_codec.BY_NAME)}")
    dims = v2_codec.checked_shape(shape, entry, where, max_bytes)
    array = check_array(where, json_codec.array_from_json(tensor["data"], entry.numpy, where, datatype), max_bytes)
    count = math.prod(dims)
    if array.size != count:
        raise InvalidInput(f"{where}: shape {list(dims)} needs {count} values, got {array.size} in data")
    return name, array.reshape(dims), 0


def _outputs(value: Any) -> tuple[list[str], set[str]]:
    if value is None:
        return [], set()
    if not isinstance(value, list):
        raise InvalidInput('"outputs" must be a list of {"name": ...} objects')
    names, binary = [], set()
    for index, output in enumerate(value):
        output = _object(output, f"outputs[{index}]", ("name", "parameters"))
        name = output.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidInput(f'outputs[{index}] needs a "name" (a string)')
        names.append(name)
        if _typed(_parameters(output.get("parameters"), f"output '{name}'"), "binary_data", bool,
                  f"output '{name}'", False):
            binary.add(name)
    return names, binary


def encode_infer(model: str, version: str, request: InferRequest, outputs: Mapping[str, np.ndarray],
                 parameters: Mapping[str, Any] | None = None) -> tuple[bytes, int | None]:
    """(body, JSON header length or None when nothing is binary) of the response."""
    tensors, chunks = [], []
    for name, array in outputs.items():
        datatype = v2_codec.datatype_of(array.dtype)
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if request.all_binary or name in request.binary_outputs:
            _, data = v2_codec.encode_raw(array)
            tensor["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            tensor["data"] = json_codec.array_to_json(array.reshape(-1))
        tensors.append(tensor)
    response: dict[str, Any] = {"model_name": model, "model_version": version}
    if request.id:
        response["id"] = request.id
    if parameters:
        response["parameters"] = dict(parameters)
    response["outputs"] = tensors
    header = json_codec.dumps(response)
    if not chunks:
        return header, None
    return b"".join((header, *chunks)), len(header)
