"""The server's handle on its model worker process (server.worker.loop).

Everything here runs on the event loop and never blocks it for long: a batch is copied into a
shared-memory slot and announced with a small message over the worker channel
(server.core.worker_channel: sends wait for a full socket instead of failing, reads reassemble
messages of any size); each answer resolves the waiting batch's future. There is one slot per
batch in flight, so the server never overwrites inputs the worker may still be reading. Slots
reach the worker as file descriptors over a second socket of their own, so the channel carries
nothing but pickled messages. The worker is taken for gone only when the channel ends: EOF, a
reset or a broken pipe, or when a batch outruns its time limit (server.core.watchdog, `watch`):
then the worker counts as hung, that version's waiting batches fail with UNAVAILABLE, and
`on_hung` tells the server, which drains and exits 1 (as for a dead worker) so the orchestrator
restarts it. Its other versions keep being answered until then.

With several front-end processes (--frontends), each has a WorkerLink of its own, to the same
worker: its own channel and its own slots. The primary's link is the ModelProcess, which also
spawns the worker, loads and unloads, and attaches the others (attach: a new pair of sockets,
whose worker ends it hands over on the slot socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import mmap
import multiprocessing
import os
import socket
import time
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

from server.config import Settings
from server.core.assembly import Tensors
from server.core.watchdog import BatchTimes, HangRule
from server.core.worker_channel import WorkerChannel
from server.core.worker_protocol import (
    AttachFrontEnd,
    Done,
    Failed,
    Load,
    Loaded,
    LoadFailed,
    NewSlot,
    Run,
    Started,
    StartFailed,
    Unload,
    Unloaded,
    slot_bytes,
    write_batch,
)
from server.errors import ModelError, ModelFailure, Unavailable

log = logging.getLogger("server.core.model_process")

MIN_SLOT_BYTES = 1 << 20
KEEP_RESIDENT_BYTES = 16 << 20
"""Slots up to this size keep their pages between batches; larger ones hand them back after each."""
INLINE_WRITE_BYTES = 4 << 20
"""Batches up to this size are copied into their slot on the loop (about a millisecond); larger
ones on a thread, so the loop serves other requests meanwhile."""
WATCH_TICK_S = 1.0
"""How often `watch` looks for a batch past its time limit."""
CLEAN_EXIT = {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError, "OSError": OSError}


def _worker_main(*args: Any) -> None:
    """The worker process's entry point. The worker's code (and TensorFlow) is imported there, in
    the child, never in the serving process."""
    from server.worker import loop

    loop.run(*args)


class _StartLost(Exception):
    """The channel ended before the worker said it had started."""


class LoadError(Exception):
    """A version failed to load in the worker; code is a tensorflow.error.Code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class WorkerLink:
    """One front-end's channel to the model worker: its batches, its shared-memory slots, and their
    answers."""

    def __init__(
        self,
        *,
        on_traces: Callable[[int, dict[str, int]], None] = lambda servable_id, traces: None,
        on_lost: Callable[[str], None] = lambda why: None,
        on_hung: Callable[[int, str], None] = lambda servable_id, why: None,
        hang_rule: HangRule | None = None,
    ) -> None:
        self._on_traces = on_traces
        self._on_lost = on_lost
        self._on_hung = on_hung
        self._hang_rule = hang_rule or HangRule(floor_s=0)
        self._times: dict[int, BatchTimes] = {}
        """Each servable's recent batch times, for its time limit."""
        self._hung: dict[int, str] = {}
        """Servables with a batch past its limit, and why: their batches are refused from then on."""
        self._channel: WorkerChannel | None = None
        self._handles: Connection | None = None
        """Where slots' file descriptors go (blocking: a few bytes each, read at once by the worker)."""
        self._worker_pid = 0
        self._maps: dict[int, mmap.mmap] = {}
        self._free: list[int] = []
        self._slots = 0
        """Slots handed out so far; a slot is in use from run() until its answer arrives."""
        self._pending: dict[int, tuple[asyncio.Future[Done], int, int, float]] = {}
        """seq -> (its answer, its slot, its servable, when it was sent)."""
        self._seq = itertools.count()
        self._lost: str | None = None

    async def connect(self, channel: socket.socket, handles: Connection, worker_pid: int) -> None:
        """Use the sockets ModelProcess.attach made for this front-end."""
        self._handles = handles
        self._worker_pid = worker_pid
        self._channel = await WorkerChannel.open(channel, self._on_message, self._on_channel_lost)

    @property
    def alive(self) -> bool:
        return self._lost is None and self._channel is not None

    def _check_alive(self) -> None:
        if self._lost is not None or self._channel is None:
            raise Unavailable(f"the model worker is gone ({self._lost or 'not started'}); retry on another replica")

    def _send(self, message: object) -> None:
        assert self._channel is not None
        self._channel.send(message)

    async def run(self, servable_id: int, signature: str, parts: Sequence[Tensors], rows: int = 1,
                  counted_rows: int = 1) -> Done:
        """Run one batch, the parts' rows in order, in the worker: its outputs, the seconds the
        model spent and the rows each replica ran. `rows`: the parts' rows (padding included),
        `counted_rows` without padding."""
        self._check_alive()
        if servable_id in self._hung:
            raise Unavailable(f"the model worker is hung ({self._hung[servable_id]}); retry on another replica")
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._slots = self._slots, self._slots + 1
        try:
            need = max(slot_bytes(parts), 1)
            if need > len(self._maps.get(slot, b"")):
                self._grow(slot, need)
            if need <= INLINE_WRITE_BYTES:
                placed = write_batch(self._maps[slot], parts)
            else:  # copying tens of megabytes would hold the loop; numpy copies without the GIL
                placed = await asyncio.get_running_loop().run_in_executor(None, write_batch, self._maps[slot], parts)
            self._check_alive()
        except BaseException:
            self._free.append(slot)
            raise
        seq = next(self._seq)
        future: asyncio.Future[Done] = asyncio.get_running_loop().create_future()
        self._pending[seq] = (future, slot, servable_id, time.monotonic())
        self._send(Run(seq, servable_id, signature, slot, placed, rows, counted_rows))
        return await future

    def _grow(self, slot: int, need: int) -> None:
        assert self._handles is not None
        size = max(MIN_SLOT_BYTES, 1 << (need - 1).bit_length())
        fd = os.memfd_create(f"mirrorserve-slot-{slot}")
        try:
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size)
            try:
                reduction.send_handle(self._handles, fd, self._worker_pid)
            except OSError as exc:
                buffer.close()
                self._lose(f"its slot socket failed: {type(exc).__name__}")
                raise Unavailable(f"the model worker is gone ({self._lost}); retry on another replica") from None
        finally:
            os.close(fd)
        self._send(NewSlot(slot, size))  # the worker takes the descriptor once it reads this
        old = self._maps.get(slot)
        self._maps[slot] = buffer
        if old is not None:
            old.close()

    def _on_message(self, message: object) -> None:
        self._answer(message)

    def _on_channel_lost(self, why: str) -> None:
        self._lose(why)

    def _answer(self, message: object) -> None:
        if not isinstance(message, Done | Failed):
            log.error("unexpected message from the model worker: %r", type(message).__name__)
            return
        pending = self._pending.pop(message.seq, None)
        if pending is None:  # a batch given up as hung, done at last: its slot stays out of use
            return
        future, slot, servable_id, sent = pending
        self._reuse(slot)
        if isinstance(message, Failed):
            if not future.done():
                future.set_exception(ModelFailure(message.message) if message.code is None
                                     else ModelError(message.message, message.code))
            return
        self._on_traces(servable_id, message.traces)
        self._times.setdefault(servable_id, BatchTimes(self._hang_rule.window)).add(time.monotonic() - sent)
        if not future.done():
            future.set_result(message)

    def _reuse(self, slot: int) -> None:
        """The worker is done with the slot. A large one also gives its memory back: its pages are
        removed from the memfd (for both processes' mappings) and fault in again when next used,
        so one 64 MiB batch does not leave 64 MiB resident in each process for good."""
        buffer = self._maps.get(slot)
        if buffer is not None and len(buffer) > KEEP_RESIDENT_BYTES:
            with contextlib.suppress(OSError, AttributeError):
                buffer.madvise(mmap.MADV_REMOVE)
        self._free.append(slot)

    def _lose(self, why: str) -> None:
        """The worker died: fail every batch waiting on it, and tell the server once."""
        if self._lost is not None:
            return
        self._lost = why
        self._close_channel()
        log.error("the model worker process is gone (%s)", why)
        gone = Unavailable(f"the model worker is gone ({why}); retry on another replica")
        for future in self._waiting():
            if not future.done():
                future.set_exception(gone)
        self._pending.clear()
        self._on_lost(why)

    def _waiting(self) -> list[asyncio.Future[Any]]:
        return [f for f, _, _, _ in self._pending.values()]

    async def watch(self) -> None:
        """Until cancelled: every WATCH_TICK_S, look for a batch past its time limit."""
        if not self._hang_rule.enabled:
            return
        while self._lost is None:
            await asyncio.sleep(WATCH_TICK_S)
            self.check_hung(time.monotonic())

    def check_hung(self, now: float) -> None:
        """Declare hung each servable that has a batch past its time limit: fail its waiting
        batches (their slots stay out of use: the worker may still write to them), refuse its
        later ones, and tell the server. Only each servable's oldest batch is timed (pending
        batches are in the order they were sent), so its limit is worked out once a tick."""
        oldest: dict[int, float] = {}
        for _, _, servable_id, sent in self._pending.values():
            oldest.setdefault(servable_id, sent)
        for servable_id, sent in oldest.items():
            if servable_id in self._hung:
                continue
            limit = self._hang_rule.limit_s(self._times.get(servable_id) or BatchTimes())
            if now - sent <= limit:
                continue
            why = f"a batch has run {now - sent:.0f}s, past its limit of {limit:.0f}s"
            self._hung[servable_id] = why
            hung = Unavailable(f"the model worker is hung ({why}); the server restarts; retry on another replica")
            for other, (future, _, other_id, _) in list(self._pending.items()):
                if other_id == servable_id:
                    del self._pending[other]
                    if not future.done():
                        future.set_exception(hung)
            self._on_hung(servable_id, why)

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()  # a no-op once the channel is lost

    def close(self, timeout_s: float = 5.0) -> None:
        """Close our end (the worker forgets this front-end, or exits when it is the primary's)."""
        self._lost = self._lost or "closed"
        self._close_channel()
        if self._handles is not None:
            self._handles.close()
        for buffer in self._maps.values():
            buffer.close()
        self._maps.clear()


class ModelProcess(WorkerLink):
    """The primary front-end's link, which also owns the worker process: spawns it, loads and
    unloads versions, and attaches the other front-ends."""

    def __init__(
        self,
        settings: Settings,
        *,
        on_traces: Callable[[int, dict[str, int]], None] = lambda servable_id, traces: None,
        on_lost: Callable[[str], None] = lambda why: None,
        on_hung: Callable[[int, str], None] = lambda servable_id, why: None,
    ) -> None:
        super().__init__(on_traces=on_traces, on_lost=on_lost, on_hung=on_hung,
                         hang_rule=HangRule(floor_s=settings.hang_timeout_s))
        self._settings = settings
        self._first: asyncio.Future[object] | None = None
        self._process: Any = None
        self._loads: dict[int, asyncio.Future[Loaded]] = {}
        self._unloads: dict[int, asyncio.Future[None]] = {}

    async def start(self) -> Started:
        """Spawn the worker and wait until its devices and threads are set up."""
        context = multiprocessing.get_context("spawn")  # never fork a process that runs gRPC threads
        ours, theirs = socket.socketpair()
        handles, their_handles = socket.socketpair()
        child = Connection(theirs.detach())
        child_handles = Connection(their_handles.detach())
        self._handles = Connection(handles.detach())
        self._process = context.Process(target=_worker_main, args=(child, child_handles, self._settings),
                                        name="mirrorserve-model", daemon=True)
        loop = asyncio.get_running_loop()
        self._first = loop.create_future()
        self._channel = await WorkerChannel.open(ours, self._on_message, self._on_channel_lost)
        self._process.start()
        self._worker_pid = self._process.pid
        child.close()
        child_handles.close()
        try:
            first = await self._first
        except _StartLost:
            await loop.run_in_executor(None, self._process.join, 5)
            raise RuntimeError(f"the model worker exited while loading (exit code {self._process.exitcode})") from None
        if isinstance(first, StartFailed):
            raise CLEAN_EXIT.get(first.kind, RuntimeError)(first.message)
        assert isinstance(first, Started), f"unexpected first message {first!r}"
        return first

    async def load(self, servable_id: int, name: str, version: int, path: str,
                   warm_up_sizes: tuple[int, ...], max_inflight: int,
                   warm_up_failure_allowed_by: str | None = None, max_batch_rows: int = 0,
                   allowed_batch_sizes: tuple[int, ...] = (), measure_cost: bool = False) -> Loaded:
        """Load and warm up one version in the worker under a fresh servable id; LoadError if it
        fails (Load.warm_up_failure_allowed_by says when a failed warm-up does not)."""
        self._check_alive()
        future: asyncio.Future[Loaded] = asyncio.get_running_loop().create_future()
        self._loads[servable_id] = future
        self._send(Load(servable_id, name, version, path, warm_up_sizes, max_inflight, warm_up_failure_allowed_by,
                        max_batch_rows, allowed_batch_sizes, measure_cost))
        return await future

    async def unload(self, servable_id: int) -> None:
        """Free a servable the server will send no more batches for."""
        self._check_alive()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._unloads[servable_id] = future
        self._send(Unload(servable_id))
        await future

    def attach(self) -> tuple[socket.socket, Connection]:
        """Sockets for another front-end process's WorkerLink (its channel, its slot socket); the
        worker's ends go to the worker now. Pass them to the front-end process and close them here."""
        self._check_alive()
        assert self._handles is not None
        ours, theirs = socket.socketpair()
        handles, their_handles = socket.socketpair()
        self._send(AttachFrontEnd())
        try:
            reduction.send_handle(self._handles, theirs.fileno(), self._process.pid)
            reduction.send_handle(self._handles, their_handles.fileno(), self._process.pid)
        finally:
            theirs.close()
            their_handles.close()
        return ours, Connection(handles.detach())

    @property
    def pid(self) -> int:
        return int(self._process.pid)

    def _on_message(self, message: object) -> None:
        first = self._first
        if first is not None and not first.done():
            first.set_result(message)
            return
        self._answer(message)

    def _on_channel_lost(self, why: str) -> None:
        first = self._first
        if first is not None and not first.done():
            first.set_exception(_StartLost(why))
            return
        if self._lost is not None:
            return
        self._process.join(1.0)  # it is gone or going: reap it for its exit code
        code = self._process.exitcode
        self._lose(f"exit code {code}" if code is not None else why)

    def _answer(self, message: object) -> None:
        if isinstance(message, Loaded | LoadFailed):
            loading = self._loads.pop(message.servable_id)
            if loading.done():
                return
            if isinstance(message, Loaded):
                loading.set_result(message)
            else:
                loading.set_exception(LoadError(message.code, message.message))
            return
        if isinstance(message, Unloaded):
            unloading = self._unloads.pop(message.servable_id)
            if not unloading.done():
                unloading.set_result(None)
            return
        super()._answer(message)

    def _waiting(self) -> list[asyncio.Future[Any]]:
        waiting = [*super()._waiting(), *self._loads.values(), *self._unloads.values()]
        self._loads.clear()
        self._unloads.clear()
        return waiting

    def close(self, timeout_s: float = 5.0) -> None:
        """Close our end (the worker exits on it) and reap the process."""
        super().close()
        if self._process is not None:
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
