"""What the server process and its model worker process say to each other. Pure: no TensorFlow.

Messages are pickled over one Unix socket pair. The worker holds any number of servables (model
versions), each known by an id the server gives it in Load; a Run names its servable. Batch
inputs do not travel in the messages: the server writes them into a shared-memory slot (an
anonymous memfd, mapped on both sides, so no /dev/shm size limit applies) and sends only where
each array lies. A slot is handed to the worker once (NewSlot, followed on the socket by its file
descriptor) and reused until a bigger batch needs a bigger one. Outputs come back pickled; they
are usually far smaller than the inputs.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from server.core.signatures import ModelInfo

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
    """Load version_dir as servable `servable` (an id the server picked), warm it up, say Loaded."""

    servable: int
    name: str
    version: int
    path: str
    warm_up_sizes: tuple[int, ...]
    """Batch sizes to run once before serving (the model's batching policy says which)."""
    max_inflight: int
    """Batches of this servable the server may send at once: the worker keeps that many threads."""


@dataclass(frozen=True)
class Loaded:
    servable: int
    info: ModelInfo
    signature_defs: dict[str, bytes]
    """Serialized SignatureDef protos, as GetModelMetadata returns them."""
    seconds: float
    """Load and warm-up time."""


@dataclass(frozen=True)
class LoadFailed:
    servable: int
    code: int
    """tensorflow.error.Code of the failure (NOT_FOUND, INVALID_ARGUMENT, DATA_LOSS, ...)."""
    message: str


@dataclass(frozen=True)
class Unload:
    """Drop the servable's functions and variables; the server sends no more batches for it."""

    servable: int


@dataclass(frozen=True)
class Unloaded:
    servable: int


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
class Run:
    seq: int
    servable: int
    signature: str
    slot: int
    inputs: dict[str, SlotArray | np.ndarray]
    """In the slot, or inline (string tensors, which have no fixed-size layout)."""


@dataclass(frozen=True)
class Done:
    seq: int
    outputs: dict[str, np.ndarray]
    seconds: float
    """Time spent in the model for this batch."""
    traces: dict[str, int]
    """tf.function traces per signature of this servable so far (the server makes a counter of it)."""


@dataclass(frozen=True)
class Failed:
    seq: int
    message: str


def slot_bytes(parts: Sequence[Mapping[str, np.ndarray]]) -> int:
    """Bytes a slot needs for the batch the parts make, each fixed-size input aligned."""
    return sum(_aligned(sum(p[name].nbytes for p in parts)) for name, a in parts[0].items() if a.dtype != object)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_batch(
    buffer: mmap.mmap | None, parts: Sequence[Mapping[str, np.ndarray]]
) -> dict[str, SlotArray | np.ndarray]:
    """Concatenate the parts' rows, input by input and in order, straight into the slot (the one
    copy a batch's inputs take on the server's side); describe where each input landed. String
    inputs have no fixed-size layout and travel inline; a batch of strings only needs no slot."""
    placed: dict[str, SlotArray | np.ndarray] = {}
    offset = 0
    for name, first in parts[0].items():
        arrays = [p[name] for p in parts]
        if first.dtype == object:
            placed[name] = np.concatenate(arrays, axis=0) if len(arrays) > 1 else first
            continue
        if buffer is None:
            raise ValueError(f"input '{name}' needs a slot and none was given")
        shape = (sum(a.shape[0] for a in arrays), *first.shape[1:])
        view = np.ndarray(shape, first.dtype, buffer=buffer, offset=offset)
        np.concatenate(arrays, axis=0, out=view)
        placed[name] = SlotArray(first.dtype if first.dtype.kind == "V" else first.dtype.str, shape, offset)
        offset += _aligned(view.nbytes)
    return placed


def read_batch(buffer: mmap.mmap | None, placed: Mapping[str, SlotArray | np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays a Run describes, as views of the slot (no copy)."""
    batch = {}
    for name, where in placed.items():
        if isinstance(where, np.ndarray):
            batch[name] = where
        elif buffer is None:
            raise ValueError(f"input '{name}' lies in a slot the worker was never given")
        else:
            batch[name] = np.ndarray(where.shape, np.dtype(where.dtype), buffer=buffer, offset=where.offset)
    return batch
