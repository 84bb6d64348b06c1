"""An asyncio event loop on virtual time, for tests of timing rules that must not flake: where the
loop would wait for its next timer, its clock jumps there instead. Every timer, sleep and timeout
(asyncio.timeout, wait_for) runs on it; nothing real may be awaited (no threads, no sockets): a
loop with nothing to run and no timer is a test bug, and says so."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Selector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("virtual time: nothing to run and no timer; the test waits on something real")
        self._loop.now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_Selector(self))

    def time(self) -> float:
        return self.now


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on virtual time (from 0 s)."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()


def now() -> float:
    """The running loop's (virtual) time."""
    return asyncio.get_running_loop().time()
