"""server.api.tensor_codec: ndarray <-> TensorProto, the typed-field decoding rules, and every refusal."""

from __future__ import annotations

import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

from server.api.tensor_codec import dtype_enum, dtype_name, numpy_dtype, to_ndarray, to_tensor_proto
from server.errors import InvalidInput
from server.limits import STRING_ELEMENT_BYTES

LIMIT = 1_000_000

TYPED_FIELDS = (
    "half_val", "float_val", "double_val", "int_val", "int64_val", "uint32_val", "uint64_val",
    "bool_val", "string_val", "scomplex_val", "dcomplex_val", "resource_handle_val", "variant_val",
)

NUMERIC = {
    np.float16: types_pb2.DT_HALF,
    np.float32: types_pb2.DT_FLOAT,
    np.float64: types_pb2.DT_DOUBLE,
    np.int8: types_pb2.DT_INT8,
    np.int16: types_pb2.DT_INT16,
    np.int32: types_pb2.DT_INT32,
    np.int64: types_pb2.DT_INT64,
    np.uint8: types_pb2.DT_UINT8,
    np.uint16: types_pb2.DT_UINT16,
    np.uint32: types_pb2.DT_UINT32,
    np.uint64: types_pb2.DT_UINT64,
    np.bool_: types_pb2.DT_BOOL,
}

SHAPES = [(), (1,), (5,), (2, 3), (2, 3, 4), (0, 3), (3, 0), (0,)]


def proto(dtype: int, shape: list[int] | None, **fields: object) -> tensor_pb2.TensorProto:
    """A hand-built TensorProto; shape None means unknown rank."""
    if shape is None:
        tshape = tensor_shape_pb2.TensorShapeProto(unknown_rank=True)
    else:
        tshape = tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=s) for s in shape]
        )
    return tensor_pb2.TensorProto(dtype=dtype, tensor_shape=tshape, **fields)


def decode(p: tensor_pb2.TensorProto, name: str = "x", max_bytes: int = LIMIT) -> np.ndarray:
    return to_ndarray(p, name=name, max_bytes=max_bytes)


def sample(np_type: type, shape: tuple[int, ...]) -> np.ndarray:
    """Distinctive values that exercise the whole range of the type (extremes included)."""
    size = int(np.prod(shape))
    pool: np.ndarray
    if np_type is np.bool_:
        pool = np.array([False, True, False])
    elif np.issubdtype(np_type, np.integer):
        ii = np.iinfo(np_type)
        pool = np.array([ii.min, ii.max, 0, 1, ii.max - 1, ii.min + 1, 7], dtype=np_type)
    else:
        fi = np.finfo(np_type)
        pool = np.array([0.5, -1.25, fi.max, fi.min, fi.tiny, -0.0, 3.0], dtype=np_type)
    flat = np.resize(pool, size)
    result: np.ndarray = flat.astype(np_type).reshape(shape)
    return result


def assert_no_typed_values(p: tensor_pb2.TensorProto) -> None:
    for field in TYPED_FIELDS:
        assert len(getattr(p, field)) == 0, field


def shape_of(p: tensor_pb2.TensorProto) -> tuple[int, ...]:
    assert not p.tensor_shape.unknown_rank
    return tuple(d.size for d in p.tensor_shape.dim)


# ---------------------------------------------------------------------------------------------
# Round trip ndarray -> TensorProto -> ndarray
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("np_type", list(NUMERIC), ids=lambda t: np.dtype(t).name)
def test_numeric_round_trip(np_type: type, shape: tuple[int, ...]) -> None:
    a = sample(np_type, shape)
    p = to_tensor_proto(a)

    assert p.dtype == NUMERIC[np_type]
    assert shape_of(p) == shape
    assert_no_typed_values(p)
    # Raw little-endian bytes, whatever the host order.
    assert p.tensor_content == a.astype(a.dtype.newbyteorder("<")).tobytes()
    if a.size:
        assert len(p.tensor_content) == a.size * a.itemsize

    back = decode(p)
    assert back.dtype == a.dtype
    assert back.shape == a.shape
    np.testing.assert_array_equal(back, a)


@pytest.mark.parametrize("np_type", list(NUMERIC), ids=lambda t: np.dtype(t).name)
def test_numeric_round_trip_keeps_exact_bits(np_type: type) -> None:
    a = sample(np_type, (7,))
    back = decode(to_tensor_proto(a))
    assert back.tobytes() == a.tobytes()


def test_encode_non_contiguous_and_big_endian_input() -> None:
    a = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]  # not C-contiguous
    p = to_tensor_proto(a)
    np.testing.assert_array_equal(decode(p), a)

    be = np.array([1, 256, -2], dtype=">i4")
    p = to_tensor_proto(be)
    assert p.dtype == types_pb2.DT_INT32
    assert p.tensor_content == np.array([1, 256, -2], dtype="<i4").tobytes()
    np.testing.assert_array_equal(decode(p), [1, 256, -2])

    bf = np.array([1.5, -2.0], dtype=">f8")
    assert to_tensor_proto(bf).dtype == types_pb2.DT_DOUBLE
    np.testing.assert_array_equal(decode(to_tensor_proto(bf)), [1.5, -2.0])


def test_encode_unsupported_numpy_dtype() -> None:
    with pytest.raises(InvalidInput, match=r"complex256.*no TensorFlow Serving encoding"):
        to_tensor_proto(np.array([1 + 2j], dtype=np.clongdouble))


STRING_CASES: dict[str, tuple[np.ndarray, list[bytes]]] = {
    "bytes-object": (np.array([b"a", b"", b"\xff\x00z"], dtype=object), [b"a", b"", b"\xff\x00z"]),
    "str-object": (np.array(["h\u00e9llo", "x"], dtype=object), ["h\u00e9llo".encode(), b"x"]),
    "unicode-U": (np.array(["h\u00e9llo", "", "\u2603"]), ["h\u00e9llo".encode(), b"", "\u2603".encode()]),
    "bytes-S": (np.array([b"ab", b"c"]), [b"ab", b"c"]),
    "0-d-str": (np.array("scalar"), [b"scalar"]),
    "0-d-bytes": (np.array(b"raw\x01"), [b"raw\x01"]),
    "2-d": (np.array([[b"a", b"b", b"c"], [b"d", b"e", b"f"]], dtype=object),
            [b"a", b"b", b"c", b"d", b"e", b"f"]),
    "empty-0x3": (np.empty((0, 3), dtype=object), []),
}


@pytest.mark.parametrize("case", list(STRING_CASES))
def test_string_round_trip(case: str) -> None:
    a, wire = STRING_CASES[case]
    p = to_tensor_proto(a)

    assert p.dtype == types_pb2.DT_STRING
    assert shape_of(p) == a.shape
    assert list(p.string_val) == wire
    assert p.tensor_content == b""

    back = decode(p)
    assert back.dtype == np.dtype(object)
    assert back.shape == a.shape
    assert all(type(v) is bytes for v in back.ravel())
    assert list(back.ravel()) == wire


def test_empty_numeric_array_has_no_values_at_all() -> None:
    p = to_tensor_proto(np.zeros((0, 3), dtype=np.float32))
    assert shape_of(p) == (0, 3)
    assert p.tensor_content == b""
    assert_no_typed_values(p)
    back = decode(p)
    assert back.shape == (0, 3)
    assert back.dtype == np.float32


@pytest.mark.parametrize("np_type", [np.float16, np.float32, np.float64])
def test_nan_and_inf_pass_through_tensor_content(np_type: type) -> None:
    a: np.ndarray = np.array([np.nan, np.inf, -np.inf, -0.0, 1.0], dtype=np_type)
    back = decode(to_tensor_proto(a))
    assert back.tobytes() == a.tobytes()  # bit for bit: NaN payload and the sign of zero too
    assert np.isnan(back[0])
    assert back[1] == np.inf
    assert back[2] == -np.inf
    assert np.signbit(back[3])


@pytest.mark.parametrize(
    ("dtype", "field", "np_type"),
    [(types_pb2.DT_FLOAT, "float_val", np.float32), (types_pb2.DT_DOUBLE, "double_val", np.float64)],
)
def test_nan_and_inf_pass_through_typed_fields(dtype: int, field: str, np_type: type) -> None:
    back = decode(proto(dtype, [3], **{field: [float("nan"), float("inf"), float("-inf")]}))
    assert back.dtype == np_type
    assert np.isnan(back[0])
    assert back[1] == np.inf
    assert back[2] == -np.inf


def test_half_val_nan_and_inf_bits() -> None:
    bits = np.array([np.nan, np.inf, -np.inf], dtype=np.float16).view(np.uint16)
    back = decode(proto(types_pb2.DT_HALF, [3], half_val=[int(b) for b in bits]))
    assert back.dtype == np.float16
    assert back.view(np.uint16).tolist() == bits.tolist()


# ---------------------------------------------------------------------------------------------
# Decoding hand-built typed fields
# ---------------------------------------------------------------------------------------------


def test_float_val_all_values() -> None:
    back = decode(proto(types_pb2.DT_FLOAT, [2, 3], float_val=[1, 2, 3, 4, 5, 6.5]))
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, np.array([[1, 2, 3], [4, 5, 6.5]], dtype=np.float32))


def test_float_val_one_value_fills_shape() -> None:
    back = decode(proto(types_pb2.DT_FLOAT, [2, 3], float_val=[2.5]))
    assert back.dtype == np.float32
    assert back.shape == (2, 3)
    np.testing.assert_array_equal(back, np.full((2, 3), 2.5, dtype=np.float32))


def test_single_value_for_scalar_and_single_element_shapes() -> None:
    scalar = decode(proto(types_pb2.DT_INT32, [], int_val=[-7]))
    assert scalar.shape == ()
    assert scalar.dtype == np.int32
    assert scalar == -7
    one = decode(proto(types_pb2.DT_DOUBLE, [1, 1], double_val=[0.25]))
    assert one.shape == (1, 1)
    assert one.dtype == np.float64
    assert one[0, 0] == 0.25


def test_half_val_carries_uint16_bits() -> None:
    bits = int(np.float16(1.5).view(np.uint16))
    back = decode(proto(types_pb2.DT_HALF, [2], half_val=[bits, int(np.float16(-0.25).view(np.uint16))]))
    assert back.dtype == np.float16
    np.testing.assert_array_equal(back, np.array([1.5, -0.25], dtype=np.float16))

    filled = decode(proto(types_pb2.DT_HALF, [2, 2], half_val=[bits]))
    assert filled.dtype == np.float16
    np.testing.assert_array_equal(filled, np.full((2, 2), 1.5, dtype=np.float16))


@pytest.mark.parametrize(
    ("dtype", "field", "values", "np_type"),
    [
        (types_pb2.DT_INT8, "int_val", [-128, 0, 127], np.int8),
        (types_pb2.DT_UINT8, "int_val", [0, 200, 255], np.uint8),
        (types_pb2.DT_INT16, "int_val", [-32768, 1, 32767], np.int16),
        (types_pb2.DT_UINT16, "int_val", [0, 40000, 65535], np.uint16),
        (types_pb2.DT_INT32, "int_val", [-(2**31), 5, 2**31 - 1], np.int32),
        (types_pb2.DT_INT64, "int64_val", [-(2**63), 5, 2**63 - 1], np.int64),
        (types_pb2.DT_UINT32, "uint32_val", [0, 5, 2**32 - 1], np.uint32),
        (types_pb2.DT_UINT64, "uint64_val", [0, 5, 2**64 - 1], np.uint64),
        (types_pb2.DT_BOOL, "bool_val", [True, False, True], np.bool_),
        (types_pb2.DT_DOUBLE, "double_val", [1e300, -2.5, 0.1], np.float64),
    ],
    ids=lambda v: dtype_name(v) if isinstance(v, int) else None,
)
def test_typed_field_per_dtype(dtype: int, field: str, values: list[object], np_type: type) -> None:
    back = decode(proto(dtype, [3], **{field: values}))
    assert back.dtype == np.dtype(np_type)
    assert back.tolist() == values

    filled = decode(proto(dtype, [2, 2], **{field: values[-1:]}))
    assert filled.dtype == np.dtype(np_type)
    assert filled.tolist() == [[values[-1]] * 2] * 2


def test_string_val_all_values_and_fill() -> None:
    back = decode(proto(types_pb2.DT_STRING, [2, 2], string_val=[b"a", b"b", b"", b"\x00"]))
    assert back.dtype == np.dtype(object)
    assert back.tolist() == [[b"a", b"b"], [b"", b"\x00"]]

    filled = decode(proto(types_pb2.DT_STRING, [2, 2], string_val=[b"same"]))
    assert filled.dtype == np.dtype(object)
    assert filled.shape == (2, 2)
    assert filled.tolist() == [[b"same", b"same"], [b"same", b"same"]]


def test_typed_empty_tensor() -> None:
    back = decode(proto(types_pb2.DT_INT64, [0, 3]))
    assert back.shape == (0, 3)
    assert back.dtype == np.int64


def test_tensor_content_built_by_hand() -> None:
    raw = np.array([[1, -2], [3, 4]], dtype="<i2").tobytes()
    back = decode(proto(types_pb2.DT_INT16, [2, 2], tensor_content=raw))
    assert back.dtype == np.int16
    np.testing.assert_array_equal(back, [[1, -2], [3, 4]])


def test_dtype_helpers() -> None:
    assert dtype_name(types_pb2.DT_FLOAT) == "DT_FLOAT"
    assert dtype_name(9999) == "dtype 9999"
    assert numpy_dtype(types_pb2.DT_UINT16) == np.uint16
    assert dtype_enum(np.dtype(np.float16)) == types_pb2.DT_HALF
    assert dtype_enum(np.dtype("U3")) == types_pb2.DT_STRING
    assert dtype_enum(np.dtype("S3")) == types_pb2.DT_STRING
    assert dtype_enum(np.dtype(object)) == types_pb2.DT_STRING
    assert numpy_dtype(types_pb2.DT_BFLOAT16) == np.dtype(ml_dtypes.bfloat16)
    assert dtype_enum(np.dtype(ml_dtypes.bfloat16)) == types_pb2.DT_BFLOAT16
    with pytest.raises(InvalidInput, match="unsupported dtype DT_QINT8"):
        numpy_dtype(types_pb2.DT_QINT8)
    assert numpy_dtype(types_pb2.DT_COMPLEX128) == np.complex128


def test_bfloat16_travels_raw_and_as_half_val_bits() -> None:
    values = np.array([[1.5, -2.0, 0.0078125]], dtype=ml_dtypes.bfloat16)
    back = to_ndarray(to_tensor_proto(values), name="b", max_bytes=1024)
    assert back.dtype == np.dtype(ml_dtypes.bfloat16) and back.tobytes() == values.tobytes()
    typed = proto(types_pb2.DT_BFLOAT16, [3])
    typed.half_val.extend(values.ravel().view(np.uint16).tolist())
    assert to_ndarray(typed, name="b", max_bytes=1024).tobytes() == values.tobytes()


# ---------------------------------------------------------------------------------------------
# Refusals: InvalidInput naming the input and the problem
# ---------------------------------------------------------------------------------------------


def refusal(p: tensor_pb2.TensorProto, name: str = "the_input", max_bytes: int = LIMIT) -> str:
    with pytest.raises(InvalidInput) as info:
        to_ndarray(p, name=name, max_bytes=max_bytes)
    message = str(info.value)
    assert f"input '{name}'" in message
    return message


@pytest.mark.parametrize(
    "dtype", [types_pb2.DT_RESOURCE, types_pb2.DT_QINT8, types_pb2.DT_VARIANT, types_pb2.DT_FLOAT8_E4M3FN]
)
def test_unsupported_dtype(dtype: int) -> None:
    message = refusal(proto(dtype, [1]))
    assert f"unsupported dtype {dtype_name(dtype)}" in message
    assert "DT_FLOAT" in message  # lists what is supported


def test_unknown_enum_value() -> None:
    message = refusal(proto(4242, [1]))
    assert "unsupported dtype" in message
    assert "4242" in message


def test_negative_dimension() -> None:
    message = refusal(proto(types_pb2.DT_FLOAT, [2, -1], float_val=[1.0]))
    assert "negative dimension" in message
    assert "[2, -1]" in message


def test_unknown_rank() -> None:
    message = refusal(proto(types_pb2.DT_FLOAT, None, float_val=[1.0]))
    assert "unknown_rank" in message


def test_tensor_content_wrong_length() -> None:
    message = refusal(proto(types_pb2.DT_FLOAT, [2, 3], tensor_content=b"\x00" * 20))
    assert "20 bytes" in message
    assert "needs 24" in message
    assert "DT_FLOAT" in message


def test_tensor_content_too_long() -> None:
    message = refusal(proto(types_pb2.DT_INT64, [1], tensor_content=b"\x00" * 16))
    assert "16 bytes" in message
    assert "needs 8" in message


@pytest.mark.parametrize("count", [0, 2, 5, 7])
def test_wrong_number_of_typed_values(count: int) -> None:
    message = refusal(proto(types_pb2.DT_FLOAT, [2, 3], float_val=[1.0] * count))
    assert "needs 6 values" in message
    assert f"got {count} in float_val" in message


def test_wrong_number_of_strings() -> None:
    message = refusal(proto(types_pb2.DT_STRING, [3], string_val=[b"a", b"b"]))
    assert "needs 3 values" in message
    assert "got 2 in string_val" in message


@pytest.mark.parametrize(
    ("dtype", "fields", "stray", "proper"),
    [
        (types_pb2.DT_FLOAT, {"int_val": [1, 2]}, "int_val", "float_val"),
        (types_pb2.DT_INT64, {"int_val": [1, 2]}, "int_val", "int64_val"),
        (types_pb2.DT_INT32, {"int64_val": [1, 2]}, "int64_val", "int_val"),
        (types_pb2.DT_DOUBLE, {"float_val": [1, 2]}, "float_val", "double_val"),
        (types_pb2.DT_HALF, {"float_val": [1, 2]}, "float_val", "half_val"),
        (types_pb2.DT_STRING, {"int_val": [1, 2]}, "int_val", "string_val"),
        (types_pb2.DT_FLOAT, {"float_val": [1, 2], "double_val": [1, 2]}, "double_val", "float_val"),
        (types_pb2.DT_FLOAT, {"scomplex_val": [1, 2]}, "scomplex_val", "float_val"),
    ],
)
def test_values_in_field_not_matching_dtype(dtype: int, fields: dict[str, object], stray: str, proper: str) -> None:
    message = refusal(proto(dtype, [2], **fields))
    assert dtype_name(dtype) in message
    assert f"carries values in {stray}" in message
    assert f"use {proper}" in message


def test_both_tensor_content_and_typed_values() -> None:
    content = np.ones(2, dtype="<f4").tobytes()
    message = refusal(proto(types_pb2.DT_FLOAT, [2], tensor_content=content, float_val=[1.0, 1.0]))
    assert "both tensor_content and float_val" in message


def test_tensor_content_and_typed_values_without_a_shape() -> None:
    # dtype, tensor_content and float_val are three fields, like the usual dtype, tensor_shape and
    # tensor_content: the fast path must not take one for the other and drop float_val.
    content = np.ones(1, dtype="<f4").tobytes()
    message = refusal(tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_content=content, float_val=[2.0]))
    assert "both tensor_content and float_val" in message


def test_version_number_is_ignored_beside_tensor_content() -> None:
    tensor = proto(types_pb2.DT_FLOAT, [2], tensor_content=np.array([1, 2], "<f4").tobytes())
    tensor.version_number = 7
    np.testing.assert_array_equal(to_ndarray(tensor, name="x", max_bytes=LIMIT), np.array([1, 2], np.float32))


def test_tensor_content_with_string_dtype() -> None:
    message = refusal(proto(types_pb2.DT_STRING, [1], tensor_content=b"abc"))
    assert "DT_STRING" in message
    assert "tensor_content" in message
    assert "use string_val" in message


def test_element_count_above_limit() -> None:
    message = refusal(proto(types_pb2.DT_FLOAT, [4, 4], float_val=[1.0] * 16), max_bytes=10)
    assert "16 elements" in message
    assert "limit is 10" in message
    # Exactly at the limit is fine.
    assert decode(proto(types_pb2.DT_FLOAT, [2, 5], float_val=[1.0]), max_bytes=40).shape == (2, 5)
    assert "40 bytes decoded" in refusal(proto(types_pb2.DT_FLOAT, [2, 5], float_val=[1.0]), max_bytes=39)


@pytest.mark.parametrize(
    "fields",
    [{"float_val": [1.0]}, {"tensor_content": b"\x00" * 4}, {}],
    ids=["one-value", "tensor_content", "no-values"],
)
def test_huge_declared_shape_refused_before_allocation(fields: dict[str, object]) -> None:
    p = proto(types_pb2.DT_FLOAT, [10**9, 10**9], **fields)
    tracemalloc.start()
    started = time.monotonic()
    try:
        message = refusal(p)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.monotonic() - started < 0.5
    assert peak < 1 << 20
    assert f"{10**18} elements" in message
    assert f"limit is {LIMIT}" in message


@pytest.mark.parametrize("shape", [[0, 2**62], [2**62, 2**62, 0]], ids=str)
@pytest.mark.parametrize("fields", [{}, {"tensor_content": b""}], ids=["typed", "tensor_content"])
def test_zero_element_shape_with_huge_dimension_is_invalid_input(
    shape: list[int], fields: dict[str, object]
) -> None:
    refusal(proto(types_pb2.DT_FLOAT, shape, **fields))


@pytest.mark.parametrize(
    ("dtype", "field", "value"),
    [
        pytest.param(dtype, field, value, id=f"{dtype_name(dtype)}-{value}")
        for dtype, field, value in [
            (types_pb2.DT_INT8, "int_val", 300),
            (types_pb2.DT_INT8, "int_val", -129),
            (types_pb2.DT_UINT8, "int_val", 256),
            (types_pb2.DT_UINT8, "int_val", -1),
            (types_pb2.DT_INT16, "int_val", 40000),
            (types_pb2.DT_UINT16, "int_val", 70000),
            (types_pb2.DT_UINT16, "int_val", -1),
            (types_pb2.DT_HALF, "half_val", 70000),
        ]
    ],
)
def test_typed_value_out_of_range(dtype: int, field: str, value: int) -> None:
    message = refusal(proto(dtype, [1], **{field: [value]}))
    assert f"a value in {field} does not fit {dtype_name(dtype)}" in message


@pytest.mark.parametrize("values", [[1, 3], [1.5]], ids=["int", "float"])
def test_encode_object_array_of_non_strings(values: list[object]) -> None:
    with pytest.raises(InvalidInput):
        to_tensor_proto(np.array(values, dtype=object))


# ---------------------------------------------------------------------------------------------
# Agreement with TensorFlow's own tensor_util
# ---------------------------------------------------------------------------------------------

REFERENCE_ARRAYS: dict[str, np.ndarray] = {
    "float32-2d": np.array([[1.5, -2.0, np.inf], [0.0, 3.25, -7.0]], dtype=np.float32),
    "float16": np.array([0.5, -65504.0, 1e-4], dtype=np.float16),
    "float64-0d": np.array(2.0**-30, dtype=np.float64),
    "int8": np.array([-128, 0, 127], dtype=np.int8),
    "uint16-3d": np.arange(24, dtype=np.uint16).reshape(2, 3, 4) * 2000,
    "int64": np.array([-(2**63), 2**63 - 1], dtype=np.int64),
    "uint64": np.array([0, 2**64 - 1], dtype=np.uint64),
    "bool": np.array([[True, False], [False, True]]),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "strings": np.array([b"a", b"", b"\xff\x00"], dtype=object),
    "strings-2d": np.array([[b"ab", b"c"], [b"d", b"ef"]], dtype=object),
}


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("case", list(REFERENCE_ARRAYS))
def test_tensorflow_decodes_our_encoding(case: str) -> None:
    import tensorflow as tf

    a = REFERENCE_ARRAYS[case]
    assert_same(tf.make_ndarray(to_tensor_proto(a)), a)


@pytest.mark.parametrize("case", list(REFERENCE_ARRAYS))
def test_we_decode_tensorflow_encoding(case: str) -> None:
    import tensorflow as tf

    a = REFERENCE_ARRAYS[case]
    assert_same(decode(tf.make_tensor_proto(a)), a)


def test_we_decode_tensorflow_single_value_fill() -> None:
    import tensorflow as tf

    p = tf.make_tensor_proto(1.5, dtype=tf.float32, shape=[2, 3])
    assert p.tensor_content == b""
    assert list(p.float_val) == [1.5]
    assert_same(decode(p), np.full((2, 3), 1.5, dtype=np.float32))


def test_we_decode_tensorflow_half_and_bool_typed_fields() -> None:
    import tensorflow as tf

    half = tf.make_tensor_proto(np.float16(1.5), shape=[2])
    assert_same(decode(half), np.array([1.5, 1.5], dtype=np.float16))
    # TensorFlow sends bool as bool_val, not tensor_content.
    flags = tf.make_tensor_proto(np.array([True, False, True]))
    assert len(flags.bool_val) == 3
    assert_same(decode(flags), np.array([True, False, True]))


def test_values_in_any_other_field_are_refused() -> None:
    """Every value-carrying TensorProto field, float8_val included, counts as a stray field."""
    p = proto(types_pb2.DT_FLOAT, [1, 3], float_val=[1.0, 2.0, 3.0])
    p.float8_val = b"\x01\x02"
    message = refusal(p)
    assert "float8_val" in message and "use float_val" in message


def test_a_string_fill_is_counted_by_what_it_decodes_to() -> None:
    """One 1 MB string filling [4096] is 4 GB once TensorFlow makes a tensor of it: refused before
    anything of that size exists, with a peak of about the one string."""
    p = proto(types_pb2.DT_STRING, [4096], string_val=[b"a" * (1 << 20)])
    tracemalloc.start()
    try:
        message = refusal(p, max_bytes=64 << 20)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert f"({4096 * ((1 << 20) + STRING_ELEMENT_BYTES)} bytes decoded); the limit is {64 << 20}" in message, message
    assert peak < 3 << 20
    # The same fill within the limit decodes, every element the one value.
    small = decode(proto(types_pb2.DT_STRING, [3], string_val=[b"ab"]), max_bytes=3 * (2 + STRING_ELEMENT_BYTES))
    assert small.tolist() == [b"ab"] * 3
    over = refusal(proto(types_pb2.DT_STRING, [3], string_val=[b"ab"]), max_bytes=3 * (2 + STRING_ELEMENT_BYTES) - 1)
    assert "bytes decoded" in over


def test_strings_are_counted_by_their_lengths_plus_what_each_element_costs() -> None:
    values = [b"x" * 100, b"", b"yz"]
    exact = 102 + 3 * STRING_ELEMENT_BYTES
    assert decode(proto(types_pb2.DT_STRING, [3], string_val=values), max_bytes=exact).tolist() == values
    message = refusal(proto(types_pb2.DT_STRING, [3], string_val=values), max_bytes=exact - 1)
    assert f"({exact} bytes decoded); the limit is {exact - 1}" in message


def test_the_tensorflow_free_dtype_table_agrees_with_tensorflows() -> None:
    """server.dtypes holds TensorFlow's enum numbers and names itself; they must be TensorFlow's."""
    import tensorflow as tf

    from server.dtypes import SUPPORTED, tf_name

    for entry in SUPPORTED:
        assert types_pb2.DataType.Name(entry.enum) == entry.name, entry
        assert tf_name(entry.numpy) == dtype_name(entry.enum), entry
        if entry.name != "DT_STRING":
            assert np.dtype(tf.as_dtype(entry.enum).as_numpy_dtype) == entry.numpy, entry
    assert tf_name(np.dtype(">f4")) == "DT_FLOAT"
    with pytest.raises(InvalidInput, match="complex256"):
        tf_name(np.dtype(np.clongdouble))
    assert tf_name(np.dtype(np.complex64)) == "DT_COMPLEX64"


TYPED_CASES = {**REFERENCE_ARRAYS,
               "bfloat16": np.array([1.5, -2.0, 3e38], dtype=ml_dtypes.bfloat16),
               "int16": np.array([-32768, 32767], dtype=np.int16), "int32": np.array([[-(2**31), 5]], dtype=np.int32),
               "uint8": np.array([0, 255], dtype=np.uint8), "uint32": np.array([0, 2**32 - 1], dtype=np.uint32),
               "float32-0d": np.array(3.5, dtype=np.float32),
               "complex64": np.array([[1 + 2j, -0.5j], [3, np.inf + 1j]], dtype=np.complex64),
               "complex128": np.array([1e300 - 1e-300j], dtype=np.complex128)}
TYPED_FIELD = {"float32": "float_val", "float16": "half_val", "bfloat16": "half_val", "float64": "double_val",
               "int8": "int_val", "int16": "int_val", "int32": "int_val", "uint8": "int_val", "uint16": "int_val",
               "int64": "int64_val", "uint32": "uint32_val", "uint64": "uint64_val", "bool": "bool_val",
               "object": "string_val", "complex64": "scomplex_val", "complex128": "dcomplex_val"}


@pytest.mark.parametrize("case", list(TYPED_CASES))
def test_typed_encoding_fills_the_field_tf_servings_clients_read(case: str) -> None:
    """What TF Serving's AsProtoField writes: no tensor_content, every value in the dtype's field,
    read back alike by `.float_val` (mnist_client.py's way), make_ndarray and our decoder."""
    import tensorflow as tf

    a = TYPED_CASES[case]
    proto = to_tensor_proto(a, typed=True)
    assert proto.tensor_content == b""
    field = getattr(proto, TYPED_FIELD[str(a.dtype)])
    if a.dtype == ml_dtypes.bfloat16 or a.dtype == np.float16:
        assert list(field) == a.ravel().view(np.uint16).tolist()
    elif a.dtype.kind == "c":  # real, imaginary, real, ...
        assert list(field) == a.ravel().view(np.float32 if a.dtype == np.complex64 else np.float64).tolist()
    else:
        assert list(field) == a.ravel().tolist()
    assert_same(tf.make_ndarray(proto), a)
    assert_same(decode(proto), a)


def test_typed_floats_keep_exact_bits() -> None:
    a = np.array([np.nan, -0.0, np.finfo(np.float32).tiny, 1 / 3], dtype=np.float32)
    proto = to_tensor_proto(a, typed=True)
    assert np.array(proto.float_val, dtype=np.float32).tobytes() == a.tobytes()
    big = np.random.default_rng(0).standard_normal((64, 1000))
    assert np.array(to_tensor_proto(big, typed=True).double_val).tobytes() == big.tobytes()  # a 2-byte length


def test_complex_values_come_in_pairs_and_one_pair_fills_the_shape() -> None:
    import tensorflow as tf

    filled = tf.make_tensor_proto(1 + 2j, dtype=tf.complex64, shape=[2, 2])
    assert list(filled.scomplex_val) == [1.0, 2.0]
    assert_same(decode(filled), np.full((2, 2), 1 + 2j, np.complex64))
    odd = proto(types_pb2.DT_COMPLEX128, [3])
    odd.dcomplex_val.extend([1.0, 2.0, 3.0])
    assert "dcomplex_val holds 3 values; a complex number takes two (real, imaginary)" in refusal(odd)
