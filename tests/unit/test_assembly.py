"""server.core.assembly: replica row ranges, merging request rows, cutting outputs back apart."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from server.core.assembly import check_rows, concat_rows, replica_bounds, shard_bounds, split_rows
from server.errors import ModelFailure


@pytest.mark.parametrize(
    ("rows", "replicas", "expected"),
    [
        (7, 2, [(0, 4), (4, 7)]),
        (2, 3, [(0, 1), (1, 2), (2, 2)]),
        (0, 1, [(0, 0)]),
        (0, 3, [(0, 0), (0, 0), (0, 0)]),
        (1, 1, [(0, 1)]),
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (10, 3, [(0, 4), (4, 7), (7, 10)]),
        (5, 8, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 5), (5, 5), (5, 5)]),
    ],
)
def test_replica_bounds_examples(rows: int, replicas: int, expected: list[tuple[int, int]]) -> None:
    assert replica_bounds(rows, replicas) == expected


@pytest.mark.parametrize(("rows", "replicas"), [(4, 0), (4, -1), (-1, 2), (-5, 0)])
def test_replica_bounds_invalid_arguments(rows: int, replicas: int) -> None:
    with pytest.raises(ValueError, match=rf"rows={rows} replicas={replicas}"):
        replica_bounds(rows, replicas)


def test_replica_bounds_properties_over_many_combinations() -> None:
    for rows in range(0, 130):
        for replicas in range(1, 17):
            bounds = replica_bounds(rows, replicas)
            where = f"rows={rows} replicas={replicas}: {bounds}"
            assert len(bounds) == replicas, where
            # Contiguous, starting at 0 and ending at rows.
            assert bounds[0][0] == 0, where
            assert bounds[-1][1] == rows, where
            for (_, hi), (lo, _) in pairwise(bounds):
                assert hi == lo, where
            sizes = [hi - lo for lo, hi in bounds]
            assert all(s >= 0 for s in sizes), where
            assert sum(sizes) == rows, where
            assert max(sizes) - min(sizes) <= 1, where
            # The larger ranges come first (empty ranges, if any, are at the end).
            assert sizes == sorted(sizes, reverse=True), where


@pytest.mark.parametrize(
    ("rows", "replicas", "expected"),
    [
        (1, 2, [(0, 1)]),
        (2, 3, [(0, 1), (1, 2)]),
        (1, 4, [(0, 1)]),
        (3, 2, [(0, 2), (2, 3)]),
        (5, 8, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
        (7, 3, [(0, 3), (3, 5), (5, 7)]),
        (0, 2, []),
    ],
)
def test_shard_bounds_leave_out_the_replicas_without_rows(rows: int, replicas: int,
                                                          expected: list[tuple[int, int]]) -> None:
    assert shard_bounds(rows, replicas) == expected


def test_shard_bounds_over_many_combinations_cover_every_row_once_in_order() -> None:
    for rows in range(0, 40):
        for replicas in range(1, 9):
            bounds = shard_bounds(rows, replicas)
            assert len(bounds) == min(rows, replicas)
            assert all(hi > lo for lo, hi in bounds)
            assert [row for lo, hi in bounds for row in range(lo, hi)] == list(range(rows))


def test_concat_rows_keeps_order_key_by_key() -> None:
    parts = [
        {"a": np.array([[1, 1]]), "b": np.array([b"x"], dtype=object)},
        {"a": np.array([[2, 2], [3, 3]]), "b": np.array([b"y", b"z"], dtype=object)},
        {"a": np.array([[4, 4]]), "b": np.array([b"w"], dtype=object)},
    ]
    merged = concat_rows(parts)
    assert set(merged) == {"a", "b"}
    np.testing.assert_array_equal(merged["a"], [[1, 1], [2, 2], [3, 3], [4, 4]])
    assert merged["b"].tolist() == [b"x", b"y", b"z", b"w"]
    # Reversing the parts reverses the row blocks.
    back = concat_rows(parts[::-1])
    np.testing.assert_array_equal(back["a"], [[4, 4], [2, 2], [3, 3], [1, 1]])


def test_concat_rows_single_part_is_not_copied() -> None:
    x = np.arange(6).reshape(3, 2)
    s = np.array([b"a", b"b", b"c"], dtype=object)
    part = {"x": x, "s": s}
    merged = concat_rows([part])
    assert merged.keys() == part.keys()
    assert merged["x"] is x
    assert merged["s"] is s
    # A new dict, so the caller may add to it without touching the part.
    assert merged is not part


def test_concat_rows_with_empty_part() -> None:
    merged = concat_rows([{"x": np.zeros((0, 2))}, {"x": np.ones((2, 2))}])
    np.testing.assert_array_equal(merged["x"], np.ones((2, 2)))


def test_split_rows_exact_pieces() -> None:
    tensors = {"y": np.arange(10) * 10, "z": np.arange(20).reshape(10, 2)}
    pieces = split_rows(tensors, [3, 0, 5, 2])
    assert len(pieces) == 4
    assert [set(p) for p in pieces] == [{"y", "z"}] * 4
    assert pieces[0]["y"].tolist() == [0, 10, 20]
    assert pieces[1]["y"].tolist() == []
    assert pieces[1]["z"].shape == (0, 2)
    assert pieces[2]["y"].tolist() == [30, 40, 50, 60, 70]
    assert pieces[3]["y"].tolist() == [80, 90]
    np.testing.assert_array_equal(pieces[3]["z"], [[16, 17], [18, 19]])
    # split undoes concat.
    np.testing.assert_array_equal(concat_rows(pieces)["z"], tensors["z"])


def test_split_rows_then_concat_round_trip() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = list(rng.integers(0, 5, size=rng.integers(1, 6)))
        total = int(sum(sizes))
        tensors = {"a": rng.normal(size=(total, 3)), "b": np.arange(total)}
        pieces = split_rows(tensors, sizes)
        assert [len(p["a"]) for p in pieces] == sizes
        merged = concat_rows(pieces)
        np.testing.assert_array_equal(merged["a"], tensors["a"])
        np.testing.assert_array_equal(merged["b"], tensors["b"])


def test_check_rows_accepts_matching_outputs() -> None:
    check_rows({"a": np.zeros((4, 2)), "b": np.zeros(4)}, 4, "batch")
    check_rows({}, 3, "batch")
    check_rows({"a": np.zeros((0, 5))}, 0, "batch")


@pytest.mark.parametrize(
    ("tensors", "expected", "bad", "shape"),
    [
        ({"ok": np.zeros(3), "bad": np.zeros((2, 3))}, 3, "bad", "[2, 3]"),
        ({"bad": np.zeros(5)}, 4, "bad", "[5]"),
        ({"bad": np.array(1.0)}, 1, "bad", "[]"),
        ({"bad": np.array(1.0)}, 0, "bad", "[]"),
        ({"bad": np.zeros((0, 2))}, 2, "bad", "[0, 2]"),
    ],
)
def test_check_rows_refuses_wrong_row_count_or_scalar(
    tensors: dict[str, np.ndarray], expected: int, bad: str, shape: str
) -> None:
    with pytest.raises(ModelFailure) as info:
        check_rows(tensors, expected, "replica 1")
    message = str(info.value)
    assert message.startswith("replica 1: ")
    assert f"output '{bad}' has shape {shape}" in message
    assert f"expected {expected} rows" in message
