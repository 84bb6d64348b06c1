"""TensorFlow's names for the dtypes the server carries, without importing TensorFlow or its
protos. Pure: the modules that only check and describe tensors (signatures, the JSON codecs)
use it, so a process that decodes request bodies need not load TensorFlow."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from server.errors import InvalidInput

_NAMES = {
    np.dtype("<f2"): "DT_HALF",
    np.dtype(ml_dtypes.bfloat16): "DT_BFLOAT16",
    np.dtype("<f4"): "DT_FLOAT",
    np.dtype("<f8"): "DT_DOUBLE",
    np.dtype("i1"): "DT_INT8",
    np.dtype("<i2"): "DT_INT16",
    np.dtype("<i4"): "DT_INT32",
    np.dtype("<i8"): "DT_INT64",
    np.dtype("u1"): "DT_UINT8",
    np.dtype("<u2"): "DT_UINT16",
    np.dtype("<u4"): "DT_UINT32",
    np.dtype("<u8"): "DT_UINT64",
    np.dtype("?"): "DT_BOOL",
}
_BY_NATIVE = {d.newbyteorder("=") if d.byteorder != "|" else d: name for d, name in _NAMES.items()}


def tf_name(dtype: np.dtype) -> str:
    """'DT_FLOAT' for float32 (str, bytes and object arrays are DT_STRING); InvalidInput for a
    dtype TensorFlow Serving cannot carry."""
    if dtype.kind in ("U", "S", "O"):
        return "DT_STRING"
    name = _BY_NATIVE.get(dtype.newbyteorder("=") if dtype.byteorder != "|" else dtype)
    if name is None:
        raise InvalidInput(f"numpy dtype {dtype} has no TensorFlow Serving encoding")
    return name
