"""Property-based fuzzing of the Predict path: thousands of malformed PredictRequests, and raw
garbage bytes on the method paths. Whatever arrives, the server answers with a status that names
a client problem (never INTERNAL or UNKNOWN), keeps serving well-formed requests, and stays up.

Each test prints how many answers it got per status code, and requires both OK and
INVALID_ARGUMENT among them, so the fuzzer is seen to reach the model as well as the checks.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import text_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorflow.core.framework import tensor_pb2, types_pb2

from protos.tensorflow_serving import get_model_metadata_pb2, predict_pb2
from tests.integration.conftest import ServerProcess

PREDICT = "/tensorflow.serving.PredictionService/Predict"
METADATA = "/tensorflow.serving.PredictionService/GetModelMetadata"
TIMEOUT_S = 10.0
MAX_MESSAGE_BYTES = 1 << 20
MAX_QUEUED_ROWS = 4096  # the server's default --max-queued-rows
ALLOWED = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})
FUZZ_SETTINGS: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    "database": None,
}

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)

# The `multi` model: signature -> input -> (dtype, trailing dims), and signature -> outputs.
SIGNATURES: dict[str, dict[str, tuple[int, tuple[int, ...]]]] = {
    "serving_default": {"a": (types_pb2.DT_FLOAT, (3,)), "b": (types_pb2.DT_INT32, ())},
    "total": {"a": (types_pb2.DT_FLOAT, (3,))},
    "strlen": {"s": (types_pb2.DT_STRING, ())},
}
OUTPUTS = {"serving_default": ["b_twice", "c"], "total": ["total"], "strlen": ["n", "upper"]}
NAMES = ["a", "b", "s", "c", "total", "n", "x", ""]

# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

small_text = st.text(max_size=12)
dtypes = st.one_of(
    st.sampled_from(sorted(types_pb2.DataType.values())),  # every named dtype, *_REF ones included
    st.integers(*INT32),  # mostly values that name no dtype at all
    st.sampled_from([types_pb2.DT_FLOAT, types_pb2.DT_INT32, types_pb2.DT_STRING]),
)
dim_sizes = st.one_of(
    st.integers(0, 6),
    st.just(-1),
    st.integers(INT64[0], -1),
    st.integers(MAX_QUEUED_ROWS + 1, 300_000),  # decodable, but too many rows to queue
    st.integers(300_000, INT64[1]),  # more than a 1 MiB message could carry
)

# Each typed value field of TensorProto, with the numpy type its values are drawn as (None: bytes).
# Numbers are drawn as one block of raw bytes per field, which is much cheaper for hypothesis than
# one draw per element and still covers NaN, infinities, denormals and every extreme integer.
VALUE_FIELDS: dict[str, str | None] = {
    "half_val": "<i4",  # half bits travel widened to int32: most values do not fit uint16
    "float_val": "<f4",
    "double_val": "<f8",
    "int_val": "<i4",
    "int64_val": "<i8",
    "uint32_val": "<u4",
    "uint64_val": "<u8",
    "bool_val": "?",
    "string_val": None,
    "scomplex_val": "<f4",
    "dcomplex_val": "<f8",
}


def _one_in(draw: st.DrawFn, n: int) -> bool:
    """True about once in n draws; shrinks to False, so a failing example loses its rare twists."""
    return bool(draw(st.integers(1, n)) == n)


@st.composite
def field_values(draw: st.DrawFn, field: str, min_size: int = 0, max_size: int = 24) -> list[Any]:
    """Between min_size and max_size values of the Python type `field` holds."""
    wire = VALUE_FIELDS[field]
    if wire is None:
        return draw(st.lists(st.binary(max_size=16), min_size=min_size, max_size=max_size))
    n = draw(st.integers(min_size, max_size))
    raw = draw(st.binary(min_size=n * np.dtype(wire).itemsize, max_size=n * np.dtype(wire).itemsize))
    if wire == "?":
        return [bool(x) for x in raw]
    values: list[Any] = np.frombuffer(raw, wire).tolist()
    return values


@st.composite
def shapes(draw: st.DrawFn) -> list[int]:
    if _one_in(draw, 6):  # absurd ranks: all ones but one random dimension
        rank = draw(st.sampled_from([5, 31, 32, 33, 64, 1000]) | st.integers(5, 400))
        dims = [1] * rank
        dims[draw(st.integers(0, rank - 1))] = draw(dim_sizes)
        return dims
    return draw(st.lists(dim_sizes, max_size=4))


@st.composite
def random_tensors(draw: st.DrawFn) -> tensor_pb2.TensorProto:
    """Anything at all: any dtype value, any shape, any fields, of any length."""
    proto = tensor_pb2.TensorProto(dtype=draw(dtypes))
    for size in draw(shapes()):
        dim = proto.tensor_shape.dim.add(size=size)
        if _one_in(draw, 10):
            dim.name = draw(small_text)
    proto.tensor_shape.unknown_rank = _one_in(draw, 10)
    if draw(st.booleans()):
        proto.version_number = draw(st.integers(*INT32))
    if draw(st.booleans()):
        proto.tensor_content = draw(st.binary(max_size=80))
    for field in draw(st.lists(st.sampled_from(sorted(VALUE_FIELDS)), max_size=3, unique=True)):
        getattr(proto, field).extend(draw(field_values(field)))
    if _one_in(draw, 20):
        proto.float8_val = draw(st.binary(min_size=1, max_size=8))
    if _one_in(draw, 20):
        handle = proto.resource_handle_val.add()
        handle.name = draw(small_text)
    if _one_in(draw, 20):
        variant = proto.variant_val.add()
        variant.type_name = draw(small_text)
    return proto


@st.composite
def valid_tensors(draw: st.DrawFn, dtype: int, trailing: tuple[int, ...], rows: int) -> tensor_pb2.TensorProto:
    """A correct tensor for one input, in one of the encodings clients use."""
    shape = (rows, *trailing)
    count = int(np.prod(shape))
    proto = tensor_pb2.TensorProto(dtype=dtype)
    for size in shape:
        proto.tensor_shape.dim.add(size=size)
    encoding = "fill" if count > 64 else draw(st.sampled_from(["content", "values", "fill"]))
    field = {types_pb2.DT_FLOAT: "float_val", types_pb2.DT_INT32: "int_val"}.get(dtype, "string_val")
    n = 1 if encoding == "fill" else count  # "fill": one value fills the whole shape
    values = draw(field_values(field, n, n))
    if encoding == "content" and dtype != types_pb2.DT_STRING:
        proto.tensor_content = np.asarray(values, dtype=VALUE_FIELDS[field]).tobytes()
    else:
        getattr(proto, field).extend(values)
    return proto


@st.composite
def mutated(draw: st.DrawFn, proto: tensor_pb2.TensorProto) -> tensor_pb2.TensorProto:
    """A valid tensor with one thing wrong (or, sometimes, still right)."""
    proto = tensor_pb2.TensorProto.FromString(proto.SerializeToString())
    how = draw(st.sampled_from(["dtype", "dim", "add_dim", "drop_dim", "content", "values", "field", "shape"]))
    if how == "dtype":
        proto.dtype = draw(dtypes)
    elif how == "dim" and proto.tensor_shape.dim:
        index = draw(st.integers(0, len(proto.tensor_shape.dim) - 1))
        proto.tensor_shape.dim[index].size = draw(dim_sizes)
    elif how == "add_dim":
        proto.tensor_shape.dim.add(size=draw(dim_sizes))
    elif how == "drop_dim" and proto.tensor_shape.dim:
        del proto.tensor_shape.dim[-1]
    elif how == "content":
        if proto.tensor_content and draw(st.booleans()):
            cut = draw(st.integers(0, len(proto.tensor_content)))
            proto.tensor_content = proto.tensor_content[:cut] + draw(st.binary(max_size=6))
        else:
            proto.tensor_content = draw(st.binary(max_size=40))
    elif how == "values":
        field = {types_pb2.DT_FLOAT: "float_val", types_pb2.DT_INT32: "int_val"}.get(proto.dtype, "string_val")
        values = getattr(proto, field)
        if values and draw(st.booleans()):
            del values[draw(st.integers(0, len(values) - 1)):]
        else:
            values.extend(draw(field_values(field, 1, 5)))
    elif how == "field":  # values in a field that does not match the dtype
        field = draw(st.sampled_from(sorted(VALUE_FIELDS)))
        getattr(proto, field).extend(draw(field_values(field, 1, 5)))
    elif how == "shape":
        proto.tensor_shape.unknown_rank = True
    return proto


@st.composite
def model_specs(draw: st.DrawFn, request: predict_pb2.PredictRequest) -> str:
    """Fill request.model_spec, mostly right; return the signature the inputs should be built for."""
    signature = draw(st.sampled_from(sorted(SIGNATURES)))
    spec = request.model_spec
    how = draw(st.sampled_from(["ok"] * 6 + ["absent", "name", "version", "label", "signature"]))
    if how == "absent":
        request.ClearField("model_spec")
        return signature
    spec.name = "multi"
    if signature != "serving_default" or draw(st.booleans()):
        spec.signature_name = signature
    if how == "ok" and draw(st.booleans()):
        spec.version.value = 1
    elif how == "name":
        spec.name = draw(st.sampled_from(["", "echo", "MULTI", "multi "]) | small_text)
    elif how == "version":
        spec.version.value = draw(st.integers(*INT64).filter(lambda v: v != 1))
    elif how == "label":
        spec.version_label = draw(st.sampled_from(["", "stable", "canary"]) | small_text)
    elif how == "signature":
        spec.signature_name = draw(st.sampled_from(["Serving_default", "serving_default ", "nope"]) | small_text)
    return signature


@st.composite
def predict_requests(draw: st.DrawFn) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    signature = draw(model_specs(request))
    mode = draw(st.sampled_from(["valid", "valid", "one_broken", "one_broken", "random"]))
    if mode == "random":
        names = draw(st.lists(st.sampled_from(NAMES) | small_text, max_size=4, unique=True))
        for name in names:
            request.inputs[name].CopyFrom(draw(random_tensors()))
    else:
        big = _one_in(draw, 50)
        rows = draw(st.integers(MAX_QUEUED_ROWS + 1, 6000) if big else st.integers(1, 6))
        for name, (dtype, trailing) in SIGNATURES[signature].items():
            request.inputs[name].CopyFrom(draw(valid_tensors(dtype, trailing, rows)))
        if mode == "one_broken":
            victim = draw(st.sampled_from(sorted(request.inputs)))
            how = draw(st.sampled_from(["mutate", "mutate", "mutate", "random", "delete", "extra", "rename"]))
            if how == "mutate":
                request.inputs[victim].CopyFrom(draw(mutated(request.inputs[victim])))
            elif how == "random":
                request.inputs[victim].CopyFrom(draw(random_tensors()))
            elif how == "delete":
                del request.inputs[victim]
            elif how == "extra":
                name = draw(st.sampled_from(NAMES) | small_text)
                extra = tensor_pb2.TensorProto()
                extra.CopyFrom(draw(random_tensors()) if draw(st.booleans()) else request.inputs[victim])
                request.inputs[name].CopyFrom(extra)  # a random tensor, or a copy of a valid one
            else:
                moved = tensor_pb2.TensorProto()
                moved.CopyFrom(request.inputs[victim])
                del request.inputs[victim]
                request.inputs[draw(st.sampled_from(NAMES) | small_text)].CopyFrom(moved)
    if _one_in(draw, 4):
        known = sorted({o for outputs in OUTPUTS.values() for o in outputs})
        request.output_filter.extend(draw(st.lists(st.sampled_from(known) | small_text, max_size=4)))
    return request


def _valid_request(rows: int = 2) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "multi"
    a = np.arange(rows * 3, dtype="<f4").reshape(rows, 3)
    b = np.arange(rows, dtype="<i4") + 1
    for name, array, dtype in (("a", a, types_pb2.DT_FLOAT), ("b", b, types_pb2.DT_INT32)):
        tensor = request.inputs[name]
        tensor.dtype = dtype
        for size in array.shape:
            tensor.tensor_shape.dim.add(size=size)
        tensor.tensor_content = array.tobytes()
    return request


def _valid_metadata_request() -> get_model_metadata_pb2.GetModelMetadataRequest:
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = "multi"
    return request


@st.composite
def metadata_requests(draw: st.DrawFn) -> get_model_metadata_pb2.GetModelMetadataRequest:
    """GetModelMetadataRequests, mostly right: the bytes they serialize to are then damaged."""
    request = _valid_metadata_request()
    how = draw(st.sampled_from(["ok", "ok", "version", "label", "name", "fields", "signature"]))
    if how == "ok" and draw(st.booleans()):
        request.model_spec.version.value = 1
    elif how == "version":
        request.model_spec.version.value = draw(st.integers(*INT64))
    elif how == "label":
        request.model_spec.version_label = draw(small_text)
    elif how == "name":
        request.model_spec.name = draw(st.sampled_from(["", "echo"]) | small_text)
    elif how == "fields":
        del request.metadata_field[:]
        request.metadata_field.extend(draw(st.lists(st.sampled_from(["signature_def"]) | small_text, max_size=3)))
    elif how == "signature":  # GetModelMetadata ignores signature_name
        request.model_spec.signature_name = draw(small_text)
    return request


@st.composite
def garbage(draw: st.DrawFn) -> tuple[str, bytes]:
    """(method path, raw request bytes): random, truncated, corrupted, deeply nested or oversized."""
    if _one_in(draw, 60):
        # Over --max-message-bytes: the transport refuses it before any handler runs. Few and from a
        # small finite set, since grpc takes 0.1-0.9 s to refuse each one (flow control).
        path = draw(st.sampled_from([PREDICT, METADATA]))
        size = draw(st.sampled_from([MAX_MESSAGE_BYTES + 1, MAX_MESSAGE_BYTES + 4096, 2 * MAX_MESSAGE_BYTES]))
        if draw(st.booleans()):
            return path, random.Random(size).randbytes(size)
        head = VALID_PREDICT if path == PREDICT else VALID_METADATA
        return path, head + b"\x22" + _varint(size) + bytes(size)  # a valid request, then a huge field
    path = draw(st.sampled_from([PREDICT, PREDICT, PREDICT, METADATA]))
    if path == METADATA:
        valid = draw(metadata_requests()).SerializeToString()
    elif draw(st.booleans()):
        valid = draw(predict_requests()).SerializeToString()
    else:
        valid = _valid_request(draw(st.integers(1, 4))).SerializeToString()
    kind = draw(st.sampled_from(["intact", "random", "random", "truncated", "truncated", "corrupted", "spliced",
                                 "nested"]))
    if kind == "intact":  # a baseline that must still parse, sometimes with unknown fields after it
        return path, valid + draw(st.sampled_from([b"", b"\xf8\x07\x01", b"\xfa\x07\x00"]))
    if kind == "random":
        return path, draw(st.binary(max_size=200))
    if kind == "truncated":
        return path, valid[: draw(st.integers(0, max(len(valid) - 1, 0)))]
    if kind == "corrupted":
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 4))):
            if data:
                data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return path, bytes(data)
    if kind == "spliced":
        junk = draw(st.binary(min_size=1, max_size=40))
        cut = draw(st.integers(0, len(valid)))
        return path, valid[:cut] + junk + valid[cut:]
    # "nested": start-group tags, or length prefixes that claim more than is there, thousands deep.
    depth = draw(st.integers(1, 20_000))
    unit = draw(st.sampled_from([b"\x0b", b"\x13", b"\x12\xff\xff\xff\xff\x0f", b"\x0a\x80\x80\x80\x80\x10"]))
    return path, unit * depth + valid


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


VALID_PREDICT = _valid_request(2).SerializeToString()
VALID_METADATA = _valid_metadata_request().SerializeToString()


# ---------------------------------------------------------------------------------------------
# Fixtures and checks
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_server(server_for):  # type: ignore[no-untyped-def]
    return server_for("multi", "--replicas", "2", "--max-batch-size", "16", "--batch-timeout-ms", "1",
                      "--max-message-bytes", str(MAX_MESSAGE_BYTES))


@pytest.fixture(scope="module")
def channel(fuzz_server: ServerProcess) -> Iterator[grpc.Channel]:
    # The client may send more than the server accepts: the server must be the one to refuse.
    options = [("grpc.max_send_message_length", 8 * MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", 8 * MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(fuzz_server.target, options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield channel


def _call(method: Callable[..., Any], request: Any) -> tuple[grpc.StatusCode, str]:
    try:
        method(request, timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _check(server: ServerProcess, code: grpc.StatusCode, details: str, shown: str) -> None:
    if code in ALLOWED:
        return
    alive = server.process.poll() is None
    tail = "" if alive else "\nserver log tail:\n" + server.log()[-3000:]
    raise AssertionError(f"server answered {code.name} ({details!r}); server alive: {alive}\n"
                         f"request:\n{shown}{tail}")


def _assert_still_serving(server: ServerProcess, channel: grpc.Channel) -> None:
    predict = channel.unary_unary(PREDICT, request_serializer=predict_pb2.PredictRequest.SerializeToString,
                                  response_deserializer=predict_pb2.PredictResponse.FromString)
    response = predict(_valid_request(2), timeout=TIMEOUT_S)
    c = np.array(response.outputs["c"].float_val, np.float32).reshape(2, 3)  # as TF Serving's clients read
    np.testing.assert_allclose(c, np.arange(6, dtype=np.float32).reshape(2, 3) * [1.0, 2.0, 3.0] * [[1], [2]])
    assert server.process.poll() is None, "the server process exited"


def _report(title: str, counts: Counter[str]) -> None:
    print(f"\n{title}: {sum(counts.values())} calls; " + ", ".join(f"{k}={v}" for k, v in counts.most_common()))
    assert counts[grpc.StatusCode.OK.name] > 0, counts
    assert counts[grpc.StatusCode.INVALID_ARGUMENT.name] > 0, counts


def test_fuzz_malformed_predict_requests(fuzz_server: ServerProcess, channel: grpc.Channel) -> None:
    predict = channel.unary_unary(PREDICT, request_serializer=predict_pb2.PredictRequest.SerializeToString,
                                  response_deserializer=predict_pb2.PredictResponse.FromString)
    counts: Counter[str] = Counter()

    @settings(max_examples=3200, **FUZZ_SETTINGS)
    @given(request=predict_requests())
    def check(request: predict_pb2.PredictRequest) -> None:
        code, details = _call(predict, request)
        counts[code.name] += 1
        _check(fuzz_server, code, details, text_format.MessageToString(request, as_utf8=True)[:20_000])

    check()
    _assert_still_serving(fuzz_server, channel)
    _report("malformed PredictRequests", counts)


def test_fuzz_garbage_bytes(fuzz_server: ServerProcess, channel: grpc.Channel) -> None:
    methods = {path: channel.unary_unary(path, request_serializer=None, response_deserializer=None)
               for path in (PREDICT, METADATA)}
    counts: dict[str, Counter[str]] = {PREDICT: Counter(), METADATA: Counter()}

    @settings(max_examples=1200, **FUZZ_SETTINGS)
    @given(case=garbage())
    def check(case: tuple[str, bytes]) -> None:
        path, data = case
        code, details = _call(methods[path], data)
        counts[path][code.name] += 1
        _check(fuzz_server, code, details, f"{path} {len(data)} bytes: {data[:2000]!r}")

    check()
    _assert_still_serving(fuzz_server, channel)
    for path, by_code in counts.items():
        print(f"\ngarbage on {path}: " + ", ".join(f"{k}={v}" for k, v in by_code.most_common()))
    _report("garbage bytes (both methods)", counts[PREDICT] + counts[METADATA])
    assert counts[METADATA][grpc.StatusCode.INVALID_ARGUMENT.name] > 0, counts
