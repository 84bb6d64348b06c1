"""The dtypes the server carries: TensorFlow's enum number and name for each numpy dtype, without
importing TensorFlow or any generated proto. Pure and shared by both processes: the serving
process checks and describes tensors with it, the model worker reads SignatureDefs with it.

The enum numbers are `tensorflow.DataType`'s (types.proto), a wire fact; a unit test checks them
against TensorFlow's own."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from server.errors import InvalidInput


@dataclass(frozen=True)
class DType:
    enum: int
    name: str
    numpy: np.dtype


SUPPORTED = (
    DType(19, "DT_HALF", np.dtype("<f2")),
    DType(14, "DT_BFLOAT16", np.dtype(ml_dtypes.bfloat16)),
    DType(1, "DT_FLOAT", np.dtype("<f4")),
    DType(2, "DT_DOUBLE", np.dtype("<f8")),
    DType(6, "DT_INT8", np.dtype("i1")),
    DType(5, "DT_INT16", np.dtype("<i2")),
    DType(3, "DT_INT32", np.dtype("<i4")),
    DType(9, "DT_INT64", np.dtype("<i8")),
    DType(4, "DT_UINT8", np.dtype("u1")),
    DType(17, "DT_UINT16", np.dtype("<u2")),
    DType(22, "DT_UINT32", np.dtype("<u4")),
    DType(23, "DT_UINT64", np.dtype("<u8")),
    DType(10, "DT_BOOL", np.dtype("?")),
    DType(8, "DT_COMPLEX64", np.dtype("<c8")),
    DType(18, "DT_COMPLEX128", np.dtype("<c16")),
    DType(7, "DT_STRING", np.dtype(object)),
)
DT_STRING = 7
BY_ENUM = {d.enum: d for d in SUPPORTED}
_BY_NATIVE = {d.numpy.newbyteorder("=") if d.numpy.byteorder != "|" else d.numpy: d for d in SUPPORTED}


def _entry(dtype: np.dtype) -> DType:
    if dtype.kind in ("U", "S", "O"):
        return BY_ENUM[DT_STRING]
    entry = _BY_NATIVE.get(dtype.newbyteorder("=") if dtype.byteorder != "|" else dtype)
    if entry is None:
        raise InvalidInput(f"numpy dtype {dtype} has no TensorFlow Serving encoding")
    return entry


def tf_name(dtype: np.dtype) -> str:
    """'DT_FLOAT' for float32 (str, bytes and object arrays are DT_STRING); InvalidInput for a
    dtype TensorFlow Serving cannot carry."""
    return _entry(dtype).name


def dtype_enum(dtype: np.dtype) -> int:
    """The TensorFlow dtype enum for a numpy dtype (str and bytes map to DT_STRING)."""
    return _entry(dtype).enum


def numpy_dtype(enum: int, name: str = "") -> np.dtype:
    """The numpy dtype a TensorFlow dtype enum decodes to; InvalidInput naming `name` (the enum's
    name, where the caller knows it) if unsupported."""
    entry = BY_ENUM.get(enum)
    if entry is None:
        raise InvalidInput(unsupported(name or f"dtype {enum}"))
    return entry.numpy


def unsupported(name: str) -> str:
    return f"unsupported dtype {name}; supported: {', '.join(d.name for d in SUPPORTED)}"
