"""JSON bodies and JSON tensors, shared by both REST APIs. Pure: no HTTP, no protos.

Bodies are parsed by orjson. One it refuses is parsed again by the standard library, which also
reads the NaN, Infinity and -Infinity that TensorFlow Serving reads and writes; a body neither
reads is an error naming line and column. Non-finite outputs are written the same way.

A JSON tensor is nested lists of one kind of leaf: numbers, true/false, or strings (UTF-8 text, or
{"b64": "..."} for arbitrary bytes). Conversion is checked: ragged nesting, a leaf of the wrong
kind, a fraction or an out-of-range value for an integer type, and a finite value that overflows a
narrower float are each refused by name, never silently cast.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

import ml_dtypes
import numpy as np
import orjson

from server.errors import InvalidInput
from server.limits import out_of_range

B64 = "b64"
_NARROW_FLOATS = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def loads(raw: bytes) -> Any:
    """The parsed body, or InvalidInput saying where it stops being JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)  # also NaN / Infinity, which orjson refuses
    except (ValueError, RecursionError) as exc:
        raise InvalidInput(f"the body is not valid JSON: {exc}") from None


def dumps(value: Any) -> bytes:
    """JSON bytes; numpy arrays and scalars are written by orjson directly."""
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def is_b64(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and B64 in value


def b64_bytes(value: dict[str, Any], where: str) -> bytes:
    """The bytes of a {"b64": "..."} object, or InvalidInput naming `where` it was."""
    text = value[B64]
    if not isinstance(text, str):
        raise InvalidInput(f'{where}: "b64" must hold a base64 string')
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f'{where}: "b64" is not valid base64: {exc}') from None


def array_from_json(value: Any, dtype: np.dtype, where: str, type_name: str) -> np.ndarray:
    """`value` as an array of `dtype`; `where` and `type_name` name the tensor and its type in errors."""
    if dtype.kind == "O":
        return _strings(value, where)
    if dtype.kind == "c":
        raise InvalidInput(f"{where} is {type_name}: JSON has no complex numbers (as in TF Serving); use gRPC")
    try:
        wide = np.array(value)
    except (ValueError, OverflowError, TypeError):
        raise InvalidInput(f"{where}: the values do not form a regular array (rows of different lengths, "
                           f"or lists mixed with single values)") from None
    kind = wide.dtype.kind
    if kind in "US":
        raise InvalidInput(f"{where} is {type_name}: a string is not allowed here")
    if kind == "O":
        raise InvalidInput(f"{where} is {type_name}: values must be "
                           f"{'true or false' if dtype.kind == 'b' else 'numbers'} (found null, an object, or an "
                           f"integer too large)")
    if dtype.kind == "b":
        if kind != "b":
            raise InvalidInput(f"{where} is {type_name}: values must be true or false")
        return wide
    if kind == "b":
        raise InvalidInput(f"{where} is {type_name}: values must be numbers, not true or false")
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype.kind in "iu":
            return _integers(wide, dtype, where, type_name)
        narrow = wide.astype(dtype)
        if dtype.itemsize < wide.dtype.itemsize or dtype in _NARROW_FLOATS:
            overflowed = ~np.isfinite(narrow.astype(np.float64)) & np.isfinite(wide.astype(np.float64))
            if overflowed.any():
                bad = wide.ravel()[int(np.argmax(overflowed.ravel()))]
                raise InvalidInput(f"{where} is {type_name}: {bad} is out of its range")
    return narrow


def _integers(wide: np.ndarray, dtype: np.dtype, where: str, type_name: str) -> np.ndarray:
    if wide.dtype.kind == "f" and wide.size:
        fractional = ~np.isfinite(wide) | (np.floor(wide) != wide)
        if fractional.any():
            bad = wide.ravel()[int(np.argmax(fractional.ravel()))]
            raise InvalidInput(f"{where} is {type_name}: {bad} is not an integer")
    problem = out_of_range(wide, dtype)
    if problem:
        raise InvalidInput(f"{where} is {type_name}: {problem}")
    return wide.astype(dtype)


def _strings(value: Any, where: str) -> np.ndarray:
    """Nested lists of text or {"b64": ...} leaves as an object array of bytes; the shape is taken
    from the first element at every depth, and every other element must agree with it."""
    shape: list[int] = []
    probe = value
    while isinstance(probe, list):
        shape.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    flat: list[bytes] = []

    def walk(node: Any, depth: int) -> None:
        if depth == len(shape):
            flat.append(_leaf_bytes(node, where))
            return
        if not isinstance(node, list) or len(node) != shape[depth]:
            raise InvalidInput(f"{where}: the values do not form a regular array (rows of different lengths, "
                               f"or lists mixed with single values)")
        for item in node:
            walk(item, depth + 1)

    walk(value, 0)
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(shape)


def text_bytes(text: str) -> bytes:
    """A JSON string's UTF-8 bytes; a lone surrogate ("\\ud800", which JSON allows and UTF-8 cannot
    hold) is kept as its three bytes, as a C++ JSON reader keeps it, not refused as an error."""
    return text.encode("utf-8", "surrogatepass")


def _leaf_bytes(leaf: Any, where: str) -> bytes:
    if isinstance(leaf, str):
        return text_bytes(leaf)
    if is_b64(leaf):
        return b64_bytes(leaf, where)
    raise InvalidInput(f'{where} is a string tensor: values must be strings or {{"b64": "..."}}')


def array_to_json(array: np.ndarray, b64: bool = False) -> Any:
    """An array (or a numpy scalar) as a JSON value: nested lists; bytes as text when they are
    UTF-8 and `b64` is false, else as {"b64": ...}."""
    array = np.asarray(array)
    if array.dtype == object:
        flat = [_bytes_json(v, b64) for v in array.ravel()]
        return _nest(flat, array.shape)
    if array.dtype.kind == "c":
        raise InvalidInput(f"a {array.dtype} output cannot be written as JSON, which has no complex numbers (as in "
                           f"TF Serving); use gRPC")
    if array.dtype in _NARROW_FLOATS:
        array = array.astype(np.float32)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        # orjson writes null for these; TF Serving (and Python's json) write NaN and Infinity.
        return orjson.Fragment(json.dumps(array.tolist()))
    return np.ascontiguousarray(array) if array.ndim else array[()]


def rows_to_json(array: np.ndarray, b64: bool = False) -> list[Any]:
    """One JSON value per row (dimension 0)."""
    if array.dtype == object or array.dtype.kind == "c":
        rows: list[Any] = array_to_json(array, b64)
        return rows
    if array.dtype not in _NARROW_FLOATS and (
            array.dtype.kind != "f" or np.isfinite(array).all()):
        return list(np.ascontiguousarray(array))
    return [array_to_json(row, b64) for row in array]


def _bytes_json(value: Any, b64: bool) -> Any:
    data = value if isinstance(value, bytes) else str(value).encode()
    if not b64:
        try:
            return data.decode()
        except UnicodeDecodeError:
            pass
    return {B64: base64.b64encode(data).decode()}


def _nest(flat: list[Any], shape: tuple[int, ...]) -> Any:
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = math.prod(shape[1:])
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
