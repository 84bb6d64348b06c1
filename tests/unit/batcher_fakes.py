"""Fakes and helpers shared by the batcher's unit tests (tests/unit is not a package; pytest puts
this folder on sys.path, so test modules import this one by name)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Hashable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from server.core.assembly import concat_rows
from server.core.batcher import Answer, BatchTiming, Ran, RunBatch
from server.errors import Overloaded

Tensors = dict[str, np.ndarray]


@dataclass(frozen=True)
class Call:
    key: Hashable
    x: np.ndarray
    at: float

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])


def double(key: Hashable, batch: Tensors) -> Tensors:
    return {"y": batch["x"] * 2}


class Poisoned(RuntimeError):
    """What fail_on_negative raises for a batch holding a negative row."""


def fail_on_negative(key: Hashable, batch: Tensors) -> Tensors:
    x = batch["x"]
    if (x < 0).any():
        raise Poisoned(f"batch of {x.shape[0]} rows")
    return double(key, batch)


def on_thread(model: Callable[[Hashable, Tensors], Tensors], executor: Executor) -> RunBatch:
    """The batcher's RunBatch for a blocking fake model: run it on the executor and time it there."""

    def timed(key: Hashable, batch: Tensors) -> Ran:
        started = time.monotonic()
        outputs = model(key, batch)
        return Ran(outputs, time.monotonic() - started)

    async def run(key: Hashable, parts: list[Tensors], rows: int) -> Ran:
        # The parts are joined where the batch runs, as the model worker joins them into its slot.
        return await asyncio.get_running_loop().run_in_executor(executor, timed, key, concat_rows(parts))

    return run


class FakeModel:
    """The run_batch stand-in: records every batch, then waits on `gate` (open unless a test closes
    it) and on a hold keyed by the batch's first row, if any, and answers with `respond` (y = 2x
    unless a test swaps it)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.respond: Callable[[Hashable, Tensors], Tensors] = double
        self.holds: dict[int, threading.Event] = {}
        """A batch whose first row has one of these values waits on its event after the gate."""

    def __call__(self, key: Hashable, batch: Tensors) -> Tensors:
        with self.lock:
            self.calls.append(Call(key, batch["x"].copy(), time.monotonic()))
        assert self.gate.wait(timeout=10), "test left the gate closed"
        hold = self.holds.get(int(batch["x"][0, 0]))
        if hold is not None:
            assert hold.wait(timeout=10), "test left a hold closed"
        return self.respond(key, batch)

    def release_all(self) -> None:
        self.gate.set()
        for hold in self.holds.values():
            hold.set()

    def rows_seen(self) -> list[int]:
        return [int(v) for c in self.calls for v in c.x[:, 0]]

    def batches(self) -> list[list[int]]:
        return [[int(v) for v in c.x[:, 0]] for c in self.calls]


class RecordingObserver:
    """A BatchObserver that remembers every report."""

    def __init__(self) -> None:
        self.queue: list[tuple[int, int]] = []
        self.started: list[int] = []
        self.finished: list[float | None] = []
        self.request_queue_seconds: list[float] = []
        self.timings: list[BatchTiming | None] = []
        self.dropped: list[str] = []

    def queue_changed(self, rows: int, requests: int) -> None:
        self.queue.append((rows, requests))

    def batch_started(self, rows: int) -> None:
        self.started.append(rows)

    def batch_finished(self, rows: int, padded: int, timing: BatchTiming | None, counted: int) -> None:
        self.finished.append(None if timing is None else timing.infer_seconds)
        self.timings.append(timing)

    def request_finished(self, answer: Answer) -> None:
        self.request_queue_seconds.append(answer.queue_seconds)

    def request_dropped(self, reason: str) -> None:
        self.dropped.append(reason)


def request(first: int, rows: int, width: int = 1) -> Tensors:
    """Rows first..first+rows-1 (each value repeated `width` times), so every row is identifiable."""
    column = np.arange(first, first + rows, dtype=np.int64).reshape(rows, 1)
    return {"x": np.repeat(column, width, axis=1)}


def assert_answer(inputs: Tensors, outputs: Any) -> None:
    assert isinstance(outputs, dict), outputs
    assert set(outputs) == {"y"}
    assert outputs["y"].shape == inputs["x"].shape
    np.testing.assert_array_equal(outputs["y"], inputs["x"] * 2)


async def refused(call: Coroutine[Any, Any, Tensors], match: str) -> None:
    """The submit must fail with Overloaded at once (a short wait_for keeps a miss from hanging)."""
    with pytest.raises(Overloaded, match=match):
        await asyncio.wait_for(call, timeout=0.5)


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)
