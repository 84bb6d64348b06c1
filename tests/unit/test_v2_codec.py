"""server.api.v2.codec: Open Inference Protocol tensors decoded exactly, refusals named."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from server.api.v2.codec import BY_NAME, datatype_of, decode_contents, decode_raw, encode_raw
from server.errors import InvalidInput
from server.limits import STRING_ELEMENT_BYTES

MAX = 1 << 20


@pytest.mark.parametrize("name", [n for n in BY_NAME if n != "BYTES"])
def test_every_numeric_datatype_round_trips_raw(name: str) -> None:
    dtype = BY_NAME[name].numpy
    array = (np.arange(6) % 2 == 1) if name == "BOOL" else np.arange(6).astype(dtype)
    array = array.reshape(2, 3).astype(dtype)
    datatype, raw = encode_raw(array)
    assert datatype == name
    back = decode_raw("t", name, [2, 3], raw, MAX)
    assert back.dtype == dtype and back.tobytes() == array.tobytes()


def test_bytes_are_length_prefixed() -> None:
    array = np.array([[b"", b"ab"], [b"\x00\xff", "é".encode()]], dtype=object)
    datatype, raw = encode_raw(array)
    assert datatype == "BYTES"
    assert raw == b"\0\0\0\0" + b"\2\0\0\0ab" + b"\2\0\0\0\x00\xff" + b"\2\0\0\0" + "é".encode()
    assert decode_raw("s", "BYTES", [2, 2], raw, MAX).tolist() == array.tolist()


def test_typed_contents() -> None:
    assert decode_contents("a", "INT8", [3], {"int_contents": [-128, 0, 127]}, MAX).tolist() == [-128, 0, 127]
    assert decode_contents("a", "UINT16", [1, 2], {"uint_contents": [0, 65535]}, MAX).dtype == np.uint16
    assert decode_contents("a", "FP64", [2], {"fp64_contents": [0.5, -1]}, MAX).tolist() == [0.5, -1.0]
    assert decode_contents("a", "BOOL", [2], {"bool_contents": [True, False]}, MAX).tolist() == [True, False]
    assert decode_contents("a", "BYTES", [1], {"bytes_contents": [b"x"]}, MAX).tolist() == [b"x"]
    assert decode_contents("a", "INT32", [0, 4], {}, MAX).shape == (0, 4)


def test_datatype_names() -> None:
    assert datatype_of(np.dtype(np.float32)) == "FP32"
    assert datatype_of(np.dtype(ml_dtypes.bfloat16)) == "BF16"
    assert datatype_of(np.dtype(object)) == "BYTES"
    with pytest.raises(InvalidInput, match="complex64"):
        datatype_of(np.dtype(np.complex64))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: decode_raw("x", "FP32", [2, 2], b"\0" * 12, MAX),
     "input 'x': raw contents have 12 bytes; shape [2, 2] of FP32 needs 16"),
    (lambda: decode_raw("x", "FP8", [1], b"\0", MAX), "input 'x': unknown datatype 'FP8'; supported: BOOL, INT8"),
    (lambda: decode_raw("x", "FP32", [-1, 2], b"", MAX), "input 'x': shape [-1, 2] has a negative dimension"),
    (lambda: decode_raw("x", "FP32", [1] * 33, b"", MAX), "input 'x': shape has 33 dimensions; at most 32"),
    (lambda: decode_raw("x", "FP32", [2**31, 2**31], b"", MAX), "input 'x': shape [2147483648, 2147483648] has "
     "4611686018427387904 elements (18446744073709551616 bytes decoded); the limit is 1048576 bytes per tensor"),
    (lambda: decode_raw("s", "BYTES", [2], b"\1\0\0\0a\0\0", MAX), "input 's': raw BYTES contents end after 1 of 2"),
    (lambda: decode_raw("s", "BYTES", [1], b"\x09\0\0\0abc", MAX), "input 's': BYTES element 0 declares 9 bytes; "
     "only 3 remain"),
    (lambda: decode_raw("s", "BYTES", [1], b"\1\0\0\0ab", MAX), "input 's': raw BYTES contents have 1 bytes after"),
    (lambda: decode_contents("x", "FP16", [1], {}, MAX), "input 'x': datatype FP16 has no typed contents"),
    (lambda: decode_contents("x", "FP32", [2], {"fp32_contents": [1.0]}, MAX),
     "input 'x': shape [2] needs 2 values, got 1 in fp32_contents"),
    (lambda: decode_contents("x", "FP32", [1], {"fp64_contents": [1.0]}, MAX),
     "input 'x': datatype FP32 carries values in fp64_contents; use fp32_contents"),
    (lambda: decode_contents("x", "INT8", [1], {"int_contents": [300]}, MAX),
     "input 'x': a value in int_contents does not fit INT8: 300 is outside [-128, 127]"),
])
def test_refusals_name_the_tensor_and_the_problem(call: object, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        call()  # type: ignore[operator]
    assert str(caught.value).startswith(message), str(caught.value)


def test_bytes_are_counted_by_their_lengths_plus_what_each_element_costs() -> None:
    raw = b"".join(len(v).to_bytes(4, "little") + v for v in (b"x" * 100, b"", b"yz"))
    exact = 102 + 3 * STRING_ELEMENT_BYTES
    assert decode_raw("s", "BYTES", [3], raw, exact).tolist() == [b"x" * 100, b"", b"yz"]
    with pytest.raises(InvalidInput, match=f"\\({exact} bytes decoded\\); the limit is {exact - 1}"):
        decode_raw("s", "BYTES", [3], raw, exact - 1)
    typed = {"bytes_contents": [b"x" * 100, b"", b"yz"]}
    assert decode_contents("s", "BYTES", [3], typed, exact).tolist() == [b"x" * 100, b"", b"yz"]
    with pytest.raises(InvalidInput, match=f"\\({exact} bytes decoded\\)"):
        decode_contents("s", "BYTES", [3], typed, exact - 1)
