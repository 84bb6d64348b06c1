"""What the server process and its model worker process say to each other. Pure: no TensorFlow.

Messages are pickled over one Unix socket pair. The worker holds any number of servables (model
versions), each known by an id the server gives it in Load; a Run names its servable. Batch
inputs do not travel in the messages: the server writes them into a shared-memory slot (an
anonymous memfd, mapped on both sides, so no /dev/shm size limit applies) and sends only where
each array lies. Strings too: their lengths as an int64 array and their bytes one after another
(pickling an array of long strings cost the event loop 3 ms a megabyte). A slot is handed to the
worker once (NewSlot, its file descriptor following on a socket of its own) and reused until a
bigger batch needs a bigger one. Outputs come back pickled; they are usually far smaller than the
inputs.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from server.core.signatures import ModelInfo, SignatureDefinition

ALIGN = 64
"""Byte alignment of every array placed in a slot."""


@dataclass(frozen=True)
class Started:
    """The worker chose its devices and built the strategy; it loads models as told."""

    devices: list[str]
    demo_base_path: str | None
    """Where the built-in demo model lies, when no model was configured."""


@dataclass(frozen=True)
class StartFailed:
    kind: str
    """The exception's class name: FileNotFoundError, ValueError or OSError map to a clean exit."""
    message: str


@dataclass(frozen=True)
class Load:
    """Load version_dir as servable `servable_id` (an id the server picked), warm it up, say Loaded."""

    servable_id: int
    name: str
    version: int
    path: str
    warm_up_sizes: tuple[int, ...]
    """Batch sizes to run once before serving (the model's batching policy says which)."""
    max_inflight: int
    """Batches of this servable the server may send at once: the worker keeps that many threads."""
    warm_up_failure_allowed_by: str | None = None
    """None: a signature that fails on the generated warm-up rows fails the load. Otherwise what
    lets it serve anyway (logged with the failure): --no-strict-warm-up, or its warmup file."""
    max_batch_rows: int = 0
    """Most rows of one model run when batches of several front-ends are merged (0: never merge)."""
    allowed_batch_sizes: tuple[int, ...] = ()
    """When set, merged runs only ever have one of these sizes (the model is fed nothing else)."""
    measure_cost: bool = False
    """Time the warm-up's smallest and largest size once more, for Loaded.run_cost (a latency
    target starts from it); off, the load costs no extra run."""


@dataclass(frozen=True)
class Loaded:
    servable_id: int
    info: ModelInfo
    signature_defs: dict[str, SignatureDefinition]
    """The SavedModel's SignatureDefs, as GetModelMetadata returns them."""
    seconds: float
    """Load and warm-up time."""
    run_cost: tuple[float, float] = (0.0, 0.0)
    """(a, b): its default signature's run time as a + b·rows seconds, as the warm-up measured
    it (a latency target starts from it)."""


@dataclass(frozen=True)
class LoadFailed:
    servable_id: int
    code: int
    """tensorflow.error.Code of the failure (NOT_FOUND, INVALID_ARGUMENT, DATA_LOSS, ...)."""
    message: str


@dataclass(frozen=True)
class Unload:
    """Drop the servable's functions and variables; the server sends no more batches for it."""

    servable_id: int


@dataclass(frozen=True)
class Unloaded:
    servable_id: int


@dataclass(frozen=True)
class AttachFrontEnd:
    """Another front-end process sends batches from now on: its channel's two sockets (messages,
    then slots' descriptors) follow this message on the slot socket."""


@dataclass(frozen=True)
class NewSlot:
    """Slot `index` is now the memfd sent right after this message, `size` bytes long."""

    index: int
    size: int


@dataclass(frozen=True)
class SlotArray:
    """An array in a slot: its dtype, shape and byte offset. The dtype is numpy's `dtype.str` for
    numpy's own types; an extension type such as ml_dtypes' bfloat16 has no string that names it
    (its `str` is a bare `<V2`), so it travels as the dtype object itself."""

    dtype: str | np.dtype
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class SlotStrings:
    """A string tensor in a slot: `shape`, the elements' lengths (int64) at `lengths`, and their
    bytes, one after another, at `data`."""

    shape: tuple[int, ...]
    lengths: int
    data: int


@dataclass(frozen=True)
class Run:
    seq: int
    servable_id: int
    signature: str
    slot: int
    inputs: dict[str, SlotArray | SlotStrings]
    rows: int = 1
    """The batch's rows, padding included (one for an unbatched signature's request)."""
    counted_rows: int = 1
    """Its requests' rows, padding not included: what mirrorserve_batch_rows counts."""


@dataclass(frozen=True)
class Done:
    seq: int
    outputs: dict[str, np.ndarray]
    seconds: float
    """Time spent in the model for this batch."""
    traces: dict[str, int]
    """tf.function traces per signature of this servable so far (the server makes a counter of it)."""
    replica_rows: tuple[int, ...]
    """Rows of the batch each replica ran, as the worker split it."""
    started_at: float | None = None
    """When the worker began on the batch, on time.monotonic (CLOCK_MONOTONIC, one clock for
    every process of the machine): what the server measures the hand-over against."""
    run_rows: int = 0
    """Rows of the model run the batch was part of (other front-ends' batches merged with it)."""
    counted_rows: int = 0
    """The run's requests' rows, on the answer of its first batch only (0 on the others): each
    model run is counted once in mirrorserve_batch_rows, whichever front-ends' batches it ran."""


@dataclass(frozen=True)
class Failed:
    seq: int
    message: str
    code: int | None = None
    """The model's own error code (a tensorflow.error.Code: server.errors.ModelError, passed on to
    the client); None for a failure of ours (the client is told "internal error")."""


def slot_bytes(parts: Sequence[Mapping[str, np.ndarray]]) -> int:
    """Bytes a slot needs for the batch the parts make, each array aligned."""
    total = 0
    for name, first in parts[0].items():
        if first.dtype == object:
            count = sum(p[name].size for p in parts)
            total += _aligned(8 * count) + _aligned(sum(_string_bytes(p[name]) for p in parts))
        else:
            total += _aligned(sum(p[name].nbytes for p in parts))
    return total


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _values(array: np.ndarray) -> list[bytes]:
    return [v if isinstance(v, bytes) else str(v).encode() for v in array.ravel()]


def _string_bytes(array: np.ndarray) -> int:
    return sum(map(len, _values(array)))


def write_batch(buffer: mmap.mmap, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, SlotArray | SlotStrings]:
    """Concatenate the parts' rows, input by input and in order, straight into the slot (the one
    copy a batch's inputs take on the server's side); describe where each input landed. Safe to
    run on another thread while the slot is not in use."""
    placed: dict[str, SlotArray | SlotStrings] = {}
    offset = 0
    for name, first in parts[0].items():
        arrays = [p[name] for p in parts]
        # One part is one request, whole (an unbatched signature's may be a scalar); parts are rows.
        shape = first.shape if len(arrays) == 1 else (sum(a.shape[0] for a in arrays), *first.shape[1:])
        if first.dtype == object:
            values = [v for a in arrays for v in _values(a)]
            lengths = np.ndarray((len(values),), np.int64, buffer=buffer, offset=offset)
            lengths[:] = [len(v) for v in values]
            data = offset + _aligned(lengths.nbytes)
            size = _write_strings(buffer, data, values)
            placed[name] = SlotStrings(shape, offset, data)
            offset = data + _aligned(size)
            continue
        view = np.ndarray(shape, first.dtype, buffer=buffer, offset=offset)
        if len(arrays) == 1:
            view[...] = first
        else:
            np.concatenate(arrays, axis=0, out=view)
        placed[name] = SlotArray(first.dtype if first.dtype.kind == "V" else first.dtype.str, shape, offset)
        offset += _aligned(view.nbytes)
    return placed


def _write_strings(buffer: mmap.mmap, at: int, values: list[bytes]) -> int:
    """Write the values one after another at `at`; the bytes written. Long values are copied by
    numpy, which lets go of the GIL (write_batch runs on a thread for large batches); many short
    ones are joined first, one C call instead of a Python step each."""
    if len(values) > 1024:
        values = [b"".join(values)]
    position = at
    for value in values:
        size = len(value)
        if size > 65536:
            np.ndarray((size,), np.uint8, buffer=buffer, offset=position)[:] = np.frombuffer(value, np.uint8)
        else:
            buffer[position:position + size] = value
        position += size
    return position - at


def read_batch(buffer: mmap.mmap | None, placed: Mapping[str, SlotArray | SlotStrings]) -> dict[str, np.ndarray]:
    """The arrays a Run describes: numbers as views of the slot (no copy), strings copied out."""
    batch = {}
    for name, where in placed.items():
        if buffer is None:
            raise ValueError(f"input '{name}' lies in a slot the worker was never given")
        if isinstance(where, SlotStrings):
            batch[name] = _read_strings(buffer, where)
        else:
            batch[name] = np.ndarray(where.shape, np.dtype(where.dtype), buffer=buffer, offset=where.offset)
    return batch


def _read_strings(buffer: mmap.mmap, where: SlotStrings) -> np.ndarray:
    count = math.prod(where.shape)
    lengths = np.ndarray((count,), np.int64, buffer=buffer, offset=where.lengths)
    ends = np.cumsum(lengths) + where.data
    out = np.empty(count, dtype=object)
    start = where.data
    for i, end in enumerate(ends.tolist()):
        out[i] = buffer[start:end]
        start = end
    return out.reshape(where.shape)
