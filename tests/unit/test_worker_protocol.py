"""server.core.worker_protocol: batches through a shared-memory slot, exactly, with no TensorFlow."""

from __future__ import annotations

import mmap
import pickle

import numpy as np
import pytest

from server.core.worker_protocol import ALIGN, Run, SlotArray, SlotStrings, read_batch, slot_bytes, write_batch


def test_slot_bytes_aligns_every_array_strings_included() -> None:
    batch = {
        "a": np.zeros((3, 5), np.float32),  # 60 bytes -> 64
        "b": np.zeros((3,), np.int64),  # 24 bytes -> 64
        "s": np.array([b"x", b"yy", b"z" * 70], dtype=object),  # lengths 24 -> 64, bytes 73 -> 128
    }
    assert slot_bytes([batch]) == 5 * ALIGN


def test_round_trip_through_a_slot_is_exact_and_aligned() -> None:
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.standard_normal((4, 3, 3, 2)).astype(np.float32),
        "ids": rng.integers(-9, 9, (4, 7)).astype(np.int64),
        "mask": rng.integers(0, 2, (4,)).astype(bool),
        "half": rng.standard_normal((4, 1)).astype(np.float16),
    }
    buffer = mmap.mmap(-1, slot_bytes([batch]))
    placed = write_batch(buffer, [batch])
    assert all(isinstance(p, SlotArray) and p.offset % ALIGN == 0 for p in placed.values())
    # What the worker receives went through pickle, as over the socket.
    back = read_batch(buffer, pickle.loads(pickle.dumps(placed)))
    assert list(back) == list(batch)
    for name, array in batch.items():
        assert back[name].dtype == array.dtype
        np.testing.assert_array_equal(back[name], array)


def test_parts_land_in_the_slot_as_one_batch_rows_in_order() -> None:
    rng = np.random.default_rng(1)
    parts = [
        {"x": rng.standard_normal((rows, 3)).astype(np.float32), "k": np.full((rows,), rows, np.int64),
         "s": np.array([b"r%d" % rows] * rows, dtype=object)}
        for rows in (2, 1, 0, 4)
    ]
    buffer = mmap.mmap(-1, slot_bytes(parts))
    assert len(buffer) == 5 * ALIGN  # x: 7*3*4 = 84 bytes -> 128; k: 7*8 = 56 -> 64; s: 56 -> 64, 14 -> 64
    placed = write_batch(buffer, parts)
    assert placed["x"] == SlotArray("<f4", (7, 3), 0)
    assert placed["k"] == SlotArray("<i8", (7,), 2 * ALIGN)
    assert placed["s"] == SlotStrings((7,), 3 * ALIGN, 4 * ALIGN)
    back = read_batch(buffer, pickle.loads(pickle.dumps(placed)))
    for name in ("x", "k", "s"):
        np.testing.assert_array_equal(back[name], np.concatenate([p[name] for p in parts]))
    assert back["k"].tolist() == [2, 2, 1, 4, 4, 4, 4]


def test_an_extension_dtype_keeps_its_type_through_the_slot() -> None:
    """bfloat16's dtype.str is a bare '<V2' (raw bytes); the slot must hand back bfloat16."""
    import ml_dtypes

    part = {"h": np.array([[1.5, -2.0]], dtype=ml_dtypes.bfloat16)}
    buffer = mmap.mmap(-1, slot_bytes([part]))
    back = read_batch(buffer, pickle.loads(pickle.dumps(write_batch(buffer, [part]))))
    assert back["h"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert back["h"].tolist() == part["h"].tolist()


def test_string_tensors_travel_in_the_slot_whole() -> None:
    strings = np.array([[b"a", b""], [b"\x00bc", "t\u00e9xt"]], dtype=object)
    long = np.array([[b"x" * 100_000, b"y"]], dtype=object)
    parts = [{"s": strings}, {"s": long}]
    buffer = mmap.mmap(-1, slot_bytes(parts))
    placed = write_batch(buffer, parts)
    assert isinstance(placed["s"], SlotStrings) and placed["s"].shape == (3, 2)
    back = read_batch(buffer, pickle.loads(pickle.dumps(placed)))["s"]
    assert back.shape == (3, 2) and back.dtype == object
    assert back.tolist() == [[b"a", b""], [b"\x00bc", "t\u00e9xt".encode()], [b"x" * 100_000, b"y"]]
    assert len(pickle.dumps(placed)) < 300, "the strings stay out of the message"


def test_a_slot_array_without_a_slot_is_an_error_not_garbage() -> None:
    run = Run(seq=1, servable_id=0, signature="serving_default", slot=0, inputs={"x": SlotArray("<f4", (2, 3), 0)})
    with pytest.raises(ValueError, match="input 'x' lies in a slot the worker was never given"):
        read_batch(None, run.inputs)


def test_views_read_the_slot_without_copying() -> None:
    buffer = mmap.mmap(-1, ALIGN)
    placed = write_batch(buffer, [{"x": np.arange(4, dtype=np.int32)}])
    view = read_batch(buffer, placed)["x"]
    np.ndarray((4,), np.int32, buffer=buffer)[0] = 42  # the server reusing the slot...
    assert view[0] == 42  # ...is seen: so a slot must not be reused before its answer arrives
    del view
