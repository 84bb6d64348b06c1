"""How big a decoded tensor may be, counted in the bytes it will really take. Pure: no protos.

Every codec (TF Serving's TensorProto, the Open Inference Protocol's tensors, both REST bodies)
checks a tensor here against --max-message-bytes before allocating it where it can, so a small
message cannot decode to gigabytes: a shape is checked against its smallest possible size first,
then strings by their lengths, and a single value that fills a shape by the whole result.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence

import numpy as np

from server.errors import InvalidInput, TooLargeInput

MAX_RANK = 32
STRING_ELEMENT_BYTES = 8 + sys.getsizeof(b"")
"""What an element of a string tensor costs the server besides its own bytes: the pointer an array
of strings holds for it and the header of the Python bytes object it points at (41 bytes on 64-bit
CPython). Counted so that millions of empty strings, 2 bytes each on the wire, are not free: at
the default 64 MiB limit a string tensor has at most about 1.6 million elements."""


def check_shape(shape: Sequence[int], where: str, max_bytes: int, element_bytes: int) -> tuple[int, ...]:
    """The shape as a tuple, refused when it could not be a real tensor of at most max_bytes whose
    elements take at least `element_bytes` each."""
    dims = tuple(int(d) for d in shape)
    if len(dims) > MAX_RANK:
        raise InvalidInput(f"{where}: shape has {len(dims)} dimensions; at most {MAX_RANK} are supported")
    if any(d < 0 for d in dims):
        raise InvalidInput(f"{where}: shape {list(dims)} has a negative dimension")
    count = math.prod(dims)
    if any(d > max_bytes for d in dims):
        raise_too_large(where, dims, count * element_bytes, max_bytes)
    check_bytes(where, dims, count * element_bytes, max_bytes)
    return dims


def string_bytes(lengths: Iterable[int], count: int) -> int:
    """Decoded size of `count` strings whose lengths are `lengths`."""
    return sum(lengths) + STRING_ELEMENT_BYTES * count


def array_bytes(array: np.ndarray) -> int:
    """Decoded size of an array: its buffer, and for strings their lengths too."""
    if array.dtype != object:
        return int(array.nbytes)
    return string_bytes((len(v) for v in array.flat if isinstance(v, bytes | str)), array.size)


def out_of_range(values: np.ndarray, dtype: np.dtype) -> str | None:
    """Why `values` (integers, or whole floats) do not fit the integer dtype, naming the first bound
    crossed, e.g. '300 is outside [-128, 127]'; None when they all fit. Every codec checks integers
    that travel wider than their dtype (protobuf's int_val, JSON numbers) with it before casting."""
    if values.size == 0:
        return None
    info = np.iinfo(dtype)
    low, high = (v.item() if isinstance(v, np.generic) else v for v in (values.min(), values.max()))
    if low >= info.min and high <= info.max:
        return None
    bad = low if low < info.min else high
    return f"{bad:g} is outside [{info.min}, {info.max}]" if isinstance(bad, float) else \
        f"{bad} is outside [{info.min}, {info.max}]"


def check_bytes(where: str, shape: Sequence[int], decoded: int, max_bytes: int) -> None:
    if decoded > max_bytes:
        raise_too_large(where, shape, decoded, max_bytes)


def check_array(where: str, array: np.ndarray, max_bytes: int) -> np.ndarray:
    """The array, unless it takes more than max_bytes (for arrays only built after parsing, as
    from JSON, where the body's own limit bounded the parse)."""
    check_bytes(where, array.shape, array_bytes(array), max_bytes)
    return array


def raise_too_large(where: str, shape: Sequence[int], decoded: int, max_bytes: int) -> None:
    raise TooLargeInput(f"{where}: shape {list(shape)} has {math.prod(shape)} elements ({decoded} bytes decoded); "
                       f"the limit is {max_bytes} bytes per tensor (--max-message-bytes)")


MAX_VERSION = 2**63 - 1
"""Versions are int64s, as in TF Serving's ModelSpec."""


def ascii_int64(text: str) -> int | None:
    """The number a version (folder name, URL segment) or a length header writes: ASCII digits only
    (str.isdigit also takes other scripts' digits, which int() reads), at most an int64; else None."""
    if not (0 < len(text) <= 19 and text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= MAX_VERSION else None
