"""The server's handle on its model worker process (server.model_worker).

Everything here runs on the event loop and never blocks it for long: a batch is copied into a
shared-memory slot and announced with a small message; the worker's answers are read by a reader
callback on the socket, which resolves the waiting batch's future. There is one slot per batch in
flight, so the server never overwrites inputs the worker may still be reading.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import multiprocessing
import os
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

from server import model_worker
from server.assembly import Tensors
from server.config import Settings
from server.errors import ModelFailure, Unavailable
from server.worker_protocol import Done, Failed, LoadFailed, NewSlot, Ready, Run, slot_bytes, write_batch

log = logging.getLogger("server.model_process")

MIN_SLOT_BYTES = 1 << 20
CLEAN_EXIT = {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError, "OSError": OSError}


class ModelProcess:
    def __init__(
        self,
        settings: Settings,
        *,
        on_traces: Callable[[dict[str, int]], None] = lambda traces: None,
        on_lost: Callable[[str], None] = lambda why: None,
    ) -> None:
        self._settings = settings
        self._on_traces = on_traces
        self._on_lost = on_lost
        self._conn: Connection | None = None
        self._process: Any = None
        self._maps: dict[int, mmap.mmap] = {}
        self._free: list[int] = []
        self._slots = 0
        """Slots handed out so far; a slot is in use from run() until its answer arrives."""
        self._pending: dict[int, tuple[asyncio.Future[tuple[Tensors, float]], int]] = {}
        self._seq = itertools.count()
        self._lost: str | None = None
        self._reading = False

    async def start(self) -> Ready:
        """Spawn the worker and wait (off the event loop) until it has loaded and warmed up."""
        context = multiprocessing.get_context("spawn")  # never fork a process that runs gRPC threads
        conn, child = context.Pipe(duplex=True)
        self._process = context.Process(target=model_worker.run, args=(child, self._settings),
                                        name="mirrorserve-model", daemon=True)
        self._process.start()
        child.close()
        self._conn = conn
        loop = asyncio.get_running_loop()
        try:
            first = await loop.run_in_executor(None, conn.recv)
        except (EOFError, OSError):
            await loop.run_in_executor(None, self._process.join, 5)
            raise RuntimeError(f"the model worker exited while loading (exit code {self._process.exitcode})") from None
        if isinstance(first, LoadFailed):
            raise CLEAN_EXIT.get(first.kind, RuntimeError)(first.message)
        assert isinstance(first, Ready), f"unexpected first message {first!r}"
        loop.add_reader(conn.fileno(), self._on_readable)
        self._reading = True
        return first

    async def run(self, signature: str, parts: Sequence[Tensors]) -> tuple[Tensors, float]:
        """Run one batch, the parts' rows in order, in the worker; its outputs and the seconds the
        model spent."""
        if self._lost is not None or self._conn is None:
            raise Unavailable(f"the model worker is gone ({self._lost or 'not started'}); retry on another replica")
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._slots = self._slots, self._slots + 1
        need = slot_bytes(parts)
        if need > len(self._maps.get(slot, b"")):
            self._grow(slot, need)
        placed = write_batch(self._maps.get(slot), parts)
        seq = next(self._seq)
        future: asyncio.Future[tuple[Tensors, float]] = asyncio.get_running_loop().create_future()
        self._pending[seq] = (future, slot)
        try:
            self._conn.send(Run(seq, signature, slot, placed))
        except OSError as exc:  # the worker is gone; its socket's EOF may not have been read yet
            self._lose(type(exc).__name__)
        return await future

    def _grow(self, slot: int, need: int) -> None:
        assert self._conn is not None
        size = max(MIN_SLOT_BYTES, 1 << (need - 1).bit_length())
        fd = os.memfd_create(f"mirrorserve-slot-{slot}")
        try:
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size)
            self._conn.send(NewSlot(slot, size))
            reduction.send_handle(self._conn, fd, self._process.pid)
        finally:
            os.close(fd)
        old = self._maps.get(slot)
        self._maps[slot] = buffer
        if old is not None:
            old.close()

    def _on_readable(self) -> None:
        assert self._conn is not None
        # One message per call: the socket is level-triggered, so the loop calls again while more
        # are waiting. (Connection.poll() would build a new selector on every call.)
        try:
            self._answer(self._conn.recv())
        except (EOFError, OSError) as exc:
            self._process.join(1.0)  # it is gone or going: reap it for its exit code
            code = self._process.exitcode
            self._lose(f"exit code {code}" if code is not None else type(exc).__name__)

    def _answer(self, message: object) -> None:
        if not isinstance(message, Done | Failed):
            log.error("unexpected message from the model worker: %r", type(message).__name__)
            return
        future, slot = self._pending.pop(message.seq)
        self._free.append(slot)
        if isinstance(message, Failed):
            if not future.done():
                future.set_exception(ModelFailure(message.message))
            return
        self._on_traces(message.traces)
        if not future.done():
            future.set_result((message.outputs, message.seconds))

    def _lose(self, why: str) -> None:
        """The worker died: fail every batch waiting on it, and tell the server once."""
        if self._lost is not None:
            return
        self._lost = why
        self._stop_reading()
        log.error("the model worker process is gone (%s)", why)
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable(f"the model worker is gone ({why}); retry on another replica"))
        self._pending.clear()
        self._on_lost(why)

    def _stop_reading(self) -> None:
        if self._reading and self._conn is not None:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._reading = False

    def close(self, timeout_s: float = 5.0) -> None:
        """Close our end (the worker exits on it) and reap the process."""
        self._stop_reading()
        self._lost = self._lost or "closed"
        if self._conn is not None:
            self._conn.close()
        if self._process is not None:
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        for buffer in self._maps.values():
            buffer.close()
        self._maps.clear()
