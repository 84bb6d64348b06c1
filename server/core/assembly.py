"""Pure row arithmetic: merge request rows into one batch, split a batch over replicas, and cut
outputs back into per-request pieces. The batcher owns time; this module owns offsets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate

import numpy as np

from server.errors import ModelFailure

Tensors = dict[str, np.ndarray]


def replica_bounds(rows: int, replicas: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) row ranges, one per replica, sizes differing by at most one.

    The first `rows % replicas` replicas take one extra row; with fewer rows than replicas the
    last ones get empty ranges (shard_bounds leaves those replicas out).
    """
    if replicas < 1 or rows < 0:
        raise ValueError(f"rows={rows} replicas={replicas}")
    base, extra = divmod(rows, replicas)
    sizes = [base + (1 if i < extra else 0) for i in range(replicas)]
    ends = list(accumulate(sizes))
    return [(end - size, end) for size, end in zip(sizes, ends, strict=True)]


def shard_bounds(rows: int, replicas: int) -> list[tuple[int, int]]:
    """The row ranges a batch runs as, one per replica in use: replica_bounds without its empty
    ranges. A batch with fewer rows than replicas runs on as many replicas as it has rows, one row
    each; the others run nothing, as some convolution and batch-norm kernels refuse a zero-row
    tensor (oneDNN's, on some CPUs).
    """
    return [(lo, hi) for lo, hi in replica_bounds(rows, replicas) if hi > lo]


def concat_rows(parts: Sequence[Mapping[str, np.ndarray]]) -> Tensors:
    """Stack parts along dimension 0, key by key, in the order given (no copy for one part)."""
    if len(parts) == 1:
        return dict(parts[0])
    return {name: np.concatenate([p[name] for p in parts], axis=0) for name in parts[0]}


def split_rows(tensors: Mapping[str, np.ndarray], sizes: Sequence[int]) -> list[Tensors]:
    """Cut every tensor along dimension 0 into consecutive pieces of the given sizes."""
    ends = list(accumulate(sizes))
    return [
        {name: t[end - size:end] for name, t in tensors.items()}
        for size, end in zip(sizes, ends, strict=True)
    ]


def check_rows(tensors: Mapping[str, np.ndarray], expected: int, where: str) -> None:
    """A model output whose dimension 0 is not the input's row count cannot be split back."""
    for name, t in tensors.items():
        if t.ndim == 0 or t.shape[0] != expected:
            raise ModelFailure(
                f"{where}: output '{name}' has shape {list(t.shape)}, expected {expected} rows"
            )


def padding_rows(part: Tensors, rows: int) -> Tensors:
    """`rows` copies of the first row of every input of `part`: filler up to an allowed batch size
    that the model computes like any row (a copy of real data, so no value is out of its range)."""
    return {name: np.repeat(array[:1], rows, axis=0) for name, array in part.items()}
