"""Which event loop runs the server: uvloop by default, the standard library's on request.

grpc.aio, the batcher, the model worker's socket reader and the metrics all run on this one loop,
and on a busy server the loop's own cost per request (futures, timers, task steps, selector calls)
is a good part of the time a request takes: an ablation of a fixed-response grpc.aio server
measured ~86 µs of event-loop CPU per request with asyncio's loop and ~75 µs with uvloop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
NAMES = ("uvloop", "asyncio")
"""The loops --event-loop accepts; the first is the default."""


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory for the named loop: "uvloop" or "asyncio"."""
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    if name == "asyncio":
        return asyncio.new_event_loop
    raise ValueError(f"unknown event loop '{name}'; choose one of {', '.join(NAMES)}")


def run(main: Coroutine[Any, Any, T], name: str) -> T:
    """asyncio.run on the named loop."""
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(main)
