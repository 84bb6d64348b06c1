"""TensorProto <-> numpy, with TensorFlow's semantics and checks made before allocation.

Decoding follows `tensor_util.MakeNdarray`: raw little-endian `tensor_content` is the fast path;
otherwise the typed field that matches the dtype holds either every element or exactly one value
that fills the whole shape (half and bfloat16 travel as uint16 bits in `half_val`). We are stricter than
TensorFlow in two places, because each hides a client bug: a value count that is neither 1 nor the
element count is refused (TensorFlow pads with the last value), and values in a field that does not
match the dtype are refused (TensorFlow ignores them).

Encoding (fill_tensor_proto) writes answers as TF Serving does by default (its `AsProtoField`):
each dtype's typed field (`float_val`, `int64_val`, ...), which is what clients written after TF
Serving's examples read (`result.outputs["scores"].float_val`). `typed=False` (TF Serving's
--enable_serialization_as_tensor_content, and what requests are built with) packs numbers in
`tensor_content` instead. Strings are always `string_val`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import cast

import numpy as np

from protos.tf.tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2
from server import dtypes
from server.errors import InvalidInput
from server.limits import MAX_RANK, STRING_ELEMENT_BYTES, check_bytes, check_shape, out_of_range, string_bytes

_FIELDS = {
    "DT_HALF": "half_val", "DT_BFLOAT16": "half_val", "DT_FLOAT": "float_val", "DT_DOUBLE": "double_val",
    "DT_INT8": "int_val", "DT_INT16": "int_val", "DT_INT32": "int_val", "DT_INT64": "int64_val",
    "DT_UINT8": "int_val", "DT_UINT16": "int_val", "DT_UINT32": "uint32_val", "DT_UINT64": "uint64_val",
    "DT_BOOL": "bool_val", "DT_STRING": "string_val", "DT_COMPLEX64": "scomplex_val", "DT_COMPLEX128": "dcomplex_val",
}
"""The typed repeated field of TensorProto that carries each dtype's values."""


@dataclass(frozen=True)
class _DType:
    enum: types_pb2.DataType
    numpy: np.dtype
    field: str


_BY_ENUM = {d.enum: _DType(cast("types_pb2.DataType", d.enum), d.numpy, _FIELDS[d.name]) for d in dtypes.SUPPORTED}
# Dtypes whose bytes already are the wire format (little-endian numbers): encoded without conversion.
_WIRE = {d.numpy: d for d in _BY_ENUM.values() if d.enum != types_pb2.DT_STRING}
# Every field that can carry values: all of TensorProto's but the header, read from the descriptor so
# fields added by newer TensorFlow versions (float8_val, ...) are refused too, not silently ignored.
_VALUE_FIELDS = frozenset(f.name for f in tensor_pb2.TensorProto.DESCRIPTOR.fields) - {
    "dtype", "tensor_shape", "version_number"}
_FAST_FIELD_NUMBERS = tuple(tensor_pb2.TensorProto.DESCRIPTOR.fields_by_name[name].number
                            for name in ("dtype", "tensor_shape", "tensor_content"))
"""The fields of a tensor sent the usual way, in the order ListFields() returns them."""


def dtype_name(enum: int) -> str:
    """'DT_FLOAT' for 1; used in error messages so clients see TensorFlow's own names."""
    try:
        return str(types_pb2.DataType.Name(enum))
    except ValueError:
        return f"dtype {enum}"


def _unsupported(enum: int) -> str:
    return dtypes.unsupported(dtype_name(enum))


def numpy_dtype(enum: int) -> np.dtype:
    """The numpy dtype a TensorFlow dtype enum decodes to; InvalidInput if unsupported."""
    return dtypes.numpy_dtype(enum, dtype_name(enum))


dtype_enum = dtypes.dtype_enum


def to_ndarray(proto: tensor_pb2.TensorProto, *, name: str, max_bytes: int) -> np.ndarray:
    """Decode one TensorProto, validating shape and contents before allocating anything.

    `max_bytes` bounds the decoded size (server.limits), so one value that "fills" a huge declared
    shape, or a string repeated that way, cannot make the server allocate more than a message of
    that size could carry.
    """
    fast = _from_tensor_content(proto, max_bytes)
    if fast is not None:
        return fast
    where = f"input '{name}'"
    try:
        entry = _BY_ENUM[proto.dtype]
    except KeyError:
        raise InvalidInput(f"{where}: {_unsupported(proto.dtype)}") from None
    if proto.tensor_shape.unknown_rank:
        raise InvalidInput(f"{where}: tensor_shape has unknown_rank; a request needs a concrete shape")
    is_string = entry.enum == types_pb2.DT_STRING
    shape = check_shape([d.size for d in proto.tensor_shape.dim], where, max_bytes,
                        STRING_ELEMENT_BYTES if is_string else entry.numpy.itemsize)
    count = math.prod(shape)

    # Values by field name, from one ListFields() call: reading tensor_content again would copy it.
    present = {f.name: value for f, value in proto.ListFields() if f.name in _VALUE_FIELDS}
    stray = present.keys() - {entry.field, "tensor_content"}
    if entry.enum == types_pb2.DT_STRING and "tensor_content" in present:
        stray.add("tensor_content")
    if stray:
        raise InvalidInput(
            f"{where}: dtype {dtype_name(entry.enum)} carries values in {', '.join(sorted(stray))}; "
            f"use {entry.field}" + (" or tensor_content" if entry.enum != types_pb2.DT_STRING else "")
        )
    if "tensor_content" in present:
        if entry.field in present:
            raise InvalidInput(f"{where}: both tensor_content and {entry.field} are set; use one")
        expected = count * entry.numpy.itemsize
        content = present["tensor_content"]
        got = len(content)
        if got != expected:
            raise InvalidInput(
                f"{where}: tensor_content has {got} bytes; shape {list(shape)} of "
                f"{dtype_name(entry.enum)} needs {expected}"
            )
        return np.frombuffer(content, dtype=entry.numpy).reshape(shape)

    values = getattr(proto, entry.field)
    if entry.numpy.kind == "c":  # two values (real, imaginary) an element, as TensorFlow writes them
        if len(values) % 2:
            raise InvalidInput(f"{where}: {entry.field} holds {len(values)} values; a complex number takes two "
                               f"(real, imaginary)")
        values = np.asarray(values, dtype=np.float32 if entry.numpy.itemsize == 8 else np.float64)
        values = values.view(entry.numpy)
    n = len(values)
    if n != count and not (n == 1 and count > 1):
        raise InvalidInput(
            f"{where}: shape {list(shape)} needs {count} values (or 1 to fill it), "
            f"got {n} in {entry.field}"
        )
    if is_string:
        items = list(values)
        # A fill is as many copies as the shape holds once TensorFlow makes a tensor of it.
        lengths = itertools.repeat(len(items[0]), count) if n != count else map(len, items)
        check_bytes(where, shape, string_bytes(lengths, count), max_bytes)
        flat = np.empty(n, dtype=object)
        flat[:] = items
    else:
        # protobuf converts the whole field at once; narrow integer types travel widened
        # (int8..uint16 in int_val, half bits in half_val), so check their range before casting.
        wide = np.asarray(values)
        narrow = np.dtype(np.uint16) if entry.enum in (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16) else entry.numpy
        if narrow.kind in "iu" and wide.dtype != narrow and (problem := out_of_range(wide, narrow)):
            raise InvalidInput(f"{where}: a value in {entry.field} does not fit {dtype_name(entry.enum)}: {problem}")
        flat = wide.astype(narrow).view(entry.numpy)
    if n == count:
        return flat.reshape(shape)
    return np.full(shape, flat[0], dtype=entry.numpy)


def _from_tensor_content(proto: tensor_pb2.TensorProto, max_bytes: int) -> np.ndarray | None:
    """The common case, checked in a few operations: a numeric dtype, a known shape and exactly
    dtype, tensor_shape and a tensor_content of the right length set. None sends anything else,
    well-formed or not, through the full checks (which name what is wrong).

    The three fields come from one ListFields() call, in field-number order: every read of
    `tensor_content` copies its bytes, and this way they are copied once, not twice. (Reading it
    and then counting ListFields() copied 110 KB CNN tensors twice; at 64 clients that line drew
    44 of the event loop thread's 1,263 py-spy samples, the parse of the whole request 25.)"""
    fields = proto.ListFields()
    if len(fields) != 3:
        return None
    (dtype_field, dtype), (shape_field, shape_proto), (content_field, content) = fields
    if (dtype_field.number, shape_field.number, content_field.number) != _FAST_FIELD_NUMBERS:
        return None
    entry = _BY_ENUM.get(dtype)
    if not content or entry is None or entry.enum == types_pb2.DT_STRING:
        return None
    if shape_proto.unknown_rank:
        return None
    shape = tuple([d.size for d in shape_proto.dim])
    if len(content) > max_bytes or len(shape) > MAX_RANK or min(shape, default=0) < 0:
        return None
    if len(content) != math.prod(shape) * entry.numpy.itemsize:
        return None
    return np.frombuffer(content, dtype=entry.numpy).reshape(shape)


def _string_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise InvalidInput(f"a string tensor holds a {type(value).__name__}; only bytes and str can be sent")


def to_tensor_proto(array: np.ndarray, *, typed: bool = False) -> tensor_pb2.TensorProto:
    """Encode an ndarray: numbers as raw little-endian tensor_content (or, `typed`, in their typed
    field), strings in string_val."""
    proto = tensor_pb2.TensorProto()
    fill_tensor_proto(proto, array, typed=typed)
    return proto


def fill_tensor_proto(proto: tensor_pb2.TensorProto, array: np.ndarray, *, typed: bool = False) -> None:
    """Encode into an empty TensorProto in place (e.g. a response's map entry: no copy): numbers in
    tensor_content, or with `typed` in their typed field."""
    if typed:
        _fill_typed(proto, array)
        return
    wire = _WIRE.get(array.dtype)
    if wire is not None:  # the common case: a little-endian number, one C call per field
        proto.dtype = wire.enum
        proto.tensor_shape.dim.extend(_dims(array.shape))
        proto.tensor_content = array.tobytes()  # C order, whatever the layout
        return
    enum = _BY_ENUM[dtype_enum(array.dtype)].enum
    proto.dtype = enum
    proto.tensor_shape.dim.extend(_dims(array.shape))
    if enum == types_pb2.DT_STRING:
        proto.string_val.extend(_string_bytes(v) for v in array.ravel())
    else:
        proto.tensor_content = np.ascontiguousarray(array, dtype=_BY_ENUM[enum].numpy).tobytes()


def _fill_typed(proto: tensor_pb2.TensorProto, array: np.ndarray) -> None:
    """Each dtype in its typed field, as TF Serving's AsProtoField writes it. Floats and doubles go
    in as their packed wire bytes, merged into the message (the field is `[packed = true]`, so its
    encoding is the array's little-endian bytes behind a tag and a length): a 64 x 10 float output
    costs 4 µs that way, 141 µs through `float_val.extend`. Narrow integers travel widened in
    int_val, half and bfloat16 as their uint16 bits in half_val."""
    entry = _BY_ENUM[dtype_enum(array.dtype)]
    proto.dtype = entry.enum
    proto.tensor_shape.dim.extend(_dims(array.shape))
    flat = array.ravel()
    if entry.enum == types_pb2.DT_STRING:
        proto.string_val.extend(_string_bytes(v) for v in flat)
    elif entry.field in _PACKED_BYTES:
        data = np.ascontiguousarray(flat, dtype=entry.numpy).tobytes()
        proto.MergeFromString(_PACKED_BYTES[entry.field] + _varint(len(data)) + data)
    elif entry.field == "half_val":
        proto.half_val.extend(flat.view(np.uint16).tolist())
    else:
        getattr(proto, entry.field).extend(flat.tolist())


_PACKED_BYTES = {name: bytes([tensor_pb2.TensorProto.DESCRIPTOR.fields_by_name[name].number << 3 | 2])
                 for name in ("float_val", "double_val", "scomplex_val", "dcomplex_val")}
"""The tag (field number, wire type 2: length-delimited) of each fixed-width typed field."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _dims(shape: tuple[int, ...]) -> list[tensor_shape_pb2.TensorShapeProto.Dim]:
    return [tensor_shape_pb2.TensorShapeProto.Dim(size=size) for size in shape]
