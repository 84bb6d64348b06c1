"""Open Inference Protocol tensors <-> numpy, checked before anything is allocated. Pure: no
protos, no gRPC (the v2 front-end hands in the fields as plain values).

A v2 tensor is a datatype name, a shape and either raw bytes (row-major little-endian; BYTES
elements each prefixed by their length as a 4-byte little-endian integer) or the typed `contents`
field of its datatype (INT8..INT32 in int_contents, UINT8..UINT32 in uint_contents; FP16 and BF16
have no typed field and travel raw only). Unlike TF Serving's TensorProto, one value never fills a
shape: the element count must match.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from server.errors import InvalidInput
from server.limits import STRING_ELEMENT_BYTES, check_bytes, check_shape, out_of_range, string_bytes

LENGTH_PREFIX = np.dtype("<u4")
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class DataType:
    name: str
    numpy: np.dtype
    contents: str | None
    """The InferTensorContents field that carries it typed, or None (raw only)."""


DATATYPES = (
    DataType("BOOL", np.dtype("?"), "bool_contents"),
    DataType("INT8", np.dtype("i1"), "int_contents"),
    DataType("INT16", np.dtype("<i2"), "int_contents"),
    DataType("INT32", np.dtype("<i4"), "int_contents"),
    DataType("INT64", np.dtype("<i8"), "int64_contents"),
    DataType("UINT8", np.dtype("u1"), "uint_contents"),
    DataType("UINT16", np.dtype("<u2"), "uint_contents"),
    DataType("UINT32", np.dtype("<u4"), "uint_contents"),
    DataType("UINT64", np.dtype("<u8"), "uint64_contents"),
    DataType("FP16", np.dtype("<f2"), None),
    DataType("FP32", np.dtype("<f4"), "fp32_contents"),
    DataType("FP64", np.dtype("<f8"), "fp64_contents"),
    DataType("BF16", np.dtype(ml_dtypes.bfloat16), None),
    DataType("BYTES", np.dtype(object), "bytes_contents"),
)
BY_NAME = {d.name: d for d in DATATYPES}
_BY_NUMPY = {d.numpy.newbyteorder("=") if d.numpy.byteorder not in "|=" else d.numpy: d for d in DATATYPES}


def datatype_of(dtype: np.dtype) -> str:
    """The v2 datatype name of a numpy dtype (what a signature's tensor is described as)."""
    entry = _BY_NUMPY.get(dtype.newbyteorder("=") if dtype.byteorder not in "|=" else dtype)
    if entry is None:
        raise InvalidInput(f"dtype {dtype} has no Open Inference Protocol datatype")
    return entry.name


def _datatype(name: str, where: str) -> DataType:
    entry = BY_NAME.get(name)
    if entry is None:
        raise InvalidInput(f"{where}: unknown datatype '{name}'; supported: {', '.join(BY_NAME)}")
    return entry


def checked_shape(shape: Sequence[int], datatype: DataType, where: str, max_bytes: int) -> tuple[int, ...]:
    """The shape as a tuple, refused when it could not be a real tensor of at most max_bytes."""
    return check_shape(shape, where, max_bytes,
                       STRING_ELEMENT_BYTES if datatype.name == "BYTES" else datatype.numpy.itemsize)


def decode_raw(name: str, datatype: str, shape: Sequence[int], raw: bytes, max_bytes: int) -> np.ndarray:
    """One input from its raw_input_contents entry."""
    where = f"input '{name}'"
    entry = _datatype(datatype, where)
    dims = checked_shape(shape, entry, where, max_bytes)
    count = math.prod(dims)
    if entry.name == "BYTES":
        # The elements' bytes are what remains once their 4-byte length prefixes are taken off.
        check_bytes(where, dims, string_bytes([len(raw) - LENGTH_PREFIX.itemsize * count], count), max_bytes)
        return _split_bytes(raw, count, where).reshape(dims)
    expected = count * entry.numpy.itemsize
    if len(raw) != expected:
        raise InvalidInput(f"{where}: raw contents have {len(raw)} bytes; shape {list(dims)} of {entry.name} "
                           f"needs {expected}")
    return np.frombuffer(raw, dtype=entry.numpy).reshape(dims)


def _split_bytes(raw: bytes, count: int, where: str) -> np.ndarray:
    """BYTES elements from their length-prefixed serialization, each length checked first."""
    out = np.empty(count, dtype=object)
    size = len(raw)
    read_length = _LENGTH.unpack_from
    offset = 0
    for i in range(count):
        if offset + 4 > size:
            raise InvalidInput(f"{where}: raw BYTES contents end after {i} of {count} elements")
        (length,) = read_length(raw, offset)
        offset += 4
        end = offset + length
        if end > size:
            raise InvalidInput(f"{where}: BYTES element {i} declares {length} bytes; only "
                               f"{size - offset} remain")
        out[i] = raw[offset:end]
        offset = end
    if offset != size:
        raise InvalidInput(f"{where}: raw BYTES contents have {size - offset} bytes after the {count} "
                           f"elements the shape needs")
    return out


def decode_contents(name: str, datatype: str, shape: Sequence[int], fields: dict[str, Sequence[object]],
                    max_bytes: int) -> np.ndarray:
    """One input from its typed contents; `fields` holds the non-empty InferTensorContents fields."""
    where = f"input '{name}'"
    entry = _datatype(datatype, where)
    dims = checked_shape(shape, entry, where, max_bytes)
    if entry.contents is None:
        raise InvalidInput(f"{where}: datatype {entry.name} has no typed contents; send it in raw_input_contents")
    stray = sorted(set(fields) - {entry.contents})
    if stray:
        raise InvalidInput(f"{where}: datatype {entry.name} carries values in {', '.join(stray)}; "
                           f"use {entry.contents}")
    values = fields.get(entry.contents, ())
    count = math.prod(dims)
    if len(values) != count:
        raise InvalidInput(f"{where}: shape {list(dims)} needs {count} values, got {len(values)} in "
                           f"{entry.contents}")
    if entry.name == "BYTES":
        items = list(values)
        check_bytes(where, dims, string_bytes(map(len, items), count), max_bytes)  # type: ignore[arg-type]
        flat = np.empty(count, dtype=object)
        flat[:] = items
        return flat.reshape(dims)
    wide = np.asarray(values)
    if entry.numpy.kind in "iu" and wide.dtype != entry.numpy and (problem := out_of_range(wide, entry.numpy)):
        raise InvalidInput(f"{where}: a value in {entry.contents} does not fit {entry.name}: {problem}")
    return wide.astype(entry.numpy).reshape(dims)


def encode_raw(array: np.ndarray) -> tuple[str, bytes]:
    """(datatype, raw bytes) of an output: little-endian row-major, BYTES length-prefixed."""
    datatype = datatype_of(array.dtype)
    if datatype != "BYTES":
        return datatype, np.ascontiguousarray(array, dtype=BY_NAME[datatype].numpy).tobytes()
    parts = []
    for value in array.ravel():
        data = value if isinstance(value, bytes) else str(value).encode()
        parts.append(len(data).to_bytes(4, "little"))
        parts.append(data)
    return datatype, b"".join(parts)
