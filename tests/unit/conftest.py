"""Fixtures for the batcher's unit tests: a one-thread executor and a fake model on it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from batcher_fakes import FakeModel, RecordingObserver


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    ex = ThreadPoolExecutor(1, thread_name_prefix="fake-model")
    yield ex
    ex.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def model(executor: ThreadPoolExecutor) -> Iterator[FakeModel]:
    m = FakeModel()
    yield m
    m.release_all()  # torn down before the executor, so its shutdown never waits on a held batch


@pytest.fixture
def observer() -> RecordingObserver:
    return RecordingObserver()
