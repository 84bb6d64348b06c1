"""The model worker: the child process that owns TensorFlow.

Why a process and not a thread of the server: TensorFlow's Python call path holds the GIL for
~120 µs a batch, and each hand-off back to the event loop is another GIL round trip, which the
event loop and gRPC's poller thread then wait for. Measured on a 2-core machine, a
thread calling the MLP in a loop took 28-40% of a fixed-response grpc.aio server's throughput; the
same loop in a separate process took 14-21% (what its CPU use costs, and no more). Here the server
process keeps gRPC, parsing, batching and the model lifecycle; this process holds every loaded
model version (servable) under one strategy, and runs batches as they arrive, as many at once as
the servables it holds allow together (each its max-inflight-batches, default 1), so one model's
long batch does not hold up another's.

Loads and unloads run on a thread of their own, so batches of the versions already serving keep
running while a new version loads and warms up. Unloading drops the servable's functions and
variables, collects the garbage and hands freed heap back to the OS (malloc_trim). The collection
has to walk every frozen object (TensorFlow's ~270k and the models'), which holds the GIL for
about 0.1 s (111 ms measured here with the demo model): batches of other versions wait that long,
once per unload.

It ignores SIGINT and SIGTERM (the server drains on them and still needs the models) and exits when
the server's end of the socket closes, which also happens if the server dies.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import mmap
import os
import queue
import signal
import threading
import time
from collections import Counter
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from server import logs, memory
from server.config import Settings
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
    read_batch,
)
from server.errors import ModelError, ModelFailure
from server.worker.run_queue import Part, Rules, RunQueue, cut, shares

if TYPE_CHECKING:
    import tensorflow as tf

    from server.worker.replicas import SignatureRunner

log = logging.getLogger(__name__)


# tensorflow.error.Code values for load failures TensorFlow itself does not code.
UNKNOWN, INVALID_ARGUMENT, NOT_FOUND, DATA_LOSS = 2, 3, 5, 15
MAX_ERROR_CHARS = 2000
DEFAULT_SIGNATURE = "serving_default"
MAX_BATCH_THREADS = 16
"""Most batches run at once, whatever the servables allow together (more wait for a thread)."""


def run(conn: Connection, handles: Connection, settings: Settings) -> None:
    """Process entry point (multiprocessing, spawn). `conn` carries the messages; `handles` the
    file descriptor of each new slot, one per NewSlot message."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logs.configure(settings.log_format, settings.log_level)
    try:
        strategy, devices = _start(settings)
        demo = _demo_base_path(settings)
    except Exception as exc:
        log.debug("start-up failed", exc_info=True)
        conn.send(StartFailed(type(exc).__name__, str(exc)))
        return
    primary = FrontEnd(0, conn, handles)
    loaded: dict[int, _Servable] = {}
    batches = _Batches(loaded)
    servables = _Servables(primary, strategy, batches, loaded)
    gc.collect()
    gc.freeze()  # as in the server: no full collection over TensorFlow's objects mid-batch
    memory.trim_periodically()
    conn.send(Started(devices, demo))
    _serve(primary, batches, servables)


def _start(settings: Settings) -> tuple[tf.distribute.Strategy, list[str]]:
    from server.worker import replicas

    replicas.configure_threads(settings.intra_op_threads, settings.inter_op_threads)
    devices = replicas.configure_devices(settings.replicas)
    return replicas.make_strategy(devices), devices


def _demo_base_path(settings: Settings) -> str | None:
    """With no model configured, the built-in demo model (built here, where TensorFlow runs)."""
    if settings.model_base_path is not None or settings.model_config_file is not None:
        return None
    from server.worker import demo_model

    return str(demo_model.ensure_demo_model())


def error_code(exc: BaseException) -> int:
    """The tensorflow.error.Code GetModelStatus reports for a failed load."""
    import tensorflow as tf
    from google.protobuf.message import DecodeError

    cause: BaseException | None = exc
    while cause is not None:  # a failed warm-up wraps the model's own error
        if isinstance(cause, tf.errors.OpError):
            return int(cause.error_code)
        cause = cause.__cause__
    if isinstance(exc, FileNotFoundError):
        return NOT_FOUND
    if isinstance(exc, DecodeError):
        return DATA_LOSS
    if isinstance(exc, ValueError):
        return INVALID_ARGUMENT
    return UNKNOWN


class _Servable:
    def __init__(self, runners: dict[str, SignatureRunner], handle: Any, traces: Counter[str],
                 max_inflight: int) -> None:
        self.runners = runners
        self.handle = handle
        self.traces = traces
        self.max_inflight = max_inflight


class _Servables:
    """The loaded servables, and the thread that loads and unloads them one at a time."""

    def __init__(self, primary: FrontEnd, strategy: tf.distribute.Strategy, batches: _Batches,
                 loaded: dict[int, _Servable]) -> None:
        self._primary = primary
        self._strategy = strategy
        self._batches = batches
        self._loaded = loaded
        """Servable id -> its runners, shared with the batches that run them."""
        self._jobs: queue.SimpleQueue[Load | Unload] = queue.SimpleQueue()
        threading.Thread(target=self._work, name="loader", daemon=True).start()

    def submit(self, message: Load | Unload) -> None:
        self._jobs.put(message)

    def _send(self, message: object) -> None:
        self._primary.send(message)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, Load):
                self._send(self._load(job))
            else:
                self._unload(job.servable_id)
                self._send(Unloaded(job.servable_id))

    def _load(self, job: Load) -> Loaded | LoadFailed:
        from server.worker import replicas, saved_model

        started = time.perf_counter()
        # Before Loaded: the server may then send this servable's batches beside the others'.
        self._batches.allow(self._at_once() + job.max_inflight)
        try:
            loaded = saved_model.load(job.path, job.name, job.version, self._strategy)
            info = loaded.info
            for name, problem in info.unbatched.items():
                log.info("model '%s' version %d: signature '%s' is served unbatched (each request runs alone, "
                         "whole, on one replica): %s", job.name, job.version, name, problem)
            traces: Counter[str] = Counter()

            def counter(name: str) -> Any:
                return lambda: traces.update((name,))

            runners = {
                name: replicas.SignatureRunner(self._strategy, loaded.functions[name], signature,
                                               on_trace=counter(name))
                for name, signature in info.signatures.items()
            }
            costs: dict[str, tuple[float, float]] = {}
            for name, runner in runners.items():
                try:
                    costs[name] = runner.warm_up(job.warm_up_sizes, job.measure_cost)
                except replicas.WarmUpFailed as exc:
                    if job.warm_up_failure_allowed_by is None:
                        raise
                    log.warning("model '%s' version %d: %s; served anyway (%s)", job.name, job.version, exc,
                                job.warm_up_failure_allowed_by)
        except Exception as exc:
            log.debug("loading %s failed", job.path, exc_info=True)
            message = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            if isinstance(exc, replicas.WarmUpFailed):
                message += f" -- {exc.WAYS_THROUGH}"
            failed = LoadFailed(job.servable_id, error_code(exc), message)
            del exc  # its traceback holds the half-loaded model
            _collect()
            self._batches.allow(self._at_once())
            return failed
        self._loaded[job.servable_id] = _Servable(runners, loaded.handle, traces, job.max_inflight)
        self._batches.serve(job.servable_id, Rules(job.max_inflight, job.max_batch_rows, job.allowed_batch_sizes,
                                                frozenset(info.unbatched)))
        gc.collect()
        gc.freeze()
        first = DEFAULT_SIGNATURE if DEFAULT_SIGNATURE in costs else next(iter(costs), "")
        return Loaded(job.servable_id, info, loaded.signature_defs,
                      time.perf_counter() - started, costs.get(first, (0.0, 0.0)))

    def _unload(self, servable_id: int) -> None:
        self._batches.forget(servable_id)
        self._loaded.pop(servable_id, None)
        self._batches.allow(self._at_once())
        _collect()

    def _at_once(self) -> int:
        """Batches the loaded servables may have running at once, all together."""
        return sum(s.max_inflight for s in list(self._loaded.values()))


def _collect() -> None:
    """Free what an unloaded (or failed) servable held: its objects may sit in the frozen
    generation, so thaw, collect, freeze again; then give freed heap pages back to the OS."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    memory.trim()


class FrontEnd:
    """The worker's end of one front-end's channel: its messages, its slots (shared memory only
    that front-end writes) and its answers (one sender at a time: batch threads share it)."""

    def __init__(self, index: int, conn: Connection, handles: Connection) -> None:
        self.index = index
        self.conn = conn
        self.handles = handles
        self.slots: dict[int, mmap.mmap] = {}
        self.gone = False
        self._send_lock = threading.Lock()

    def send(self, message: object) -> None:
        if self.gone:
            return
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError):  # it died: its reader frees what the worker held for it
            self.gone = True

    def close(self) -> None:
        self.gone = True
        for buffer in self.slots.values():
            _close(buffer)
        self.slots.clear()
        self.conn.close()
        self.handles.close()


class _Batches:
    """Runs batches and sends their answers. As many run at once as the loaded servables allow
    together (each its max-inflight-batches), so one model's long batch does not hold up another
    model's: a 500 ms batch of long strings no longer made every other model's clients wait for it.
    While that is one batch (one servable, the default max-inflight-batches 1), it runs inline on
    the thread reading the socket it came from (no hand-off, no wake-up); otherwise batches go to a
    pool of threads. Either way, batches of a servable that arrive while it runs all it may (from
    other front-ends: server.worker.run_queue) wait, and the thread that finishes its run takes
    them next, merged into one run. Each pool thread makes one small TensorFlow call
    before it takes batches, as TensorFlow sets up per-thread state on a thread's first call; each
    servable's own warm-up (tracing, every batch size) is done by the loader before the server may
    send it a batch."""

    def __init__(self, loaded: dict[int, _Servable]) -> None:
        self._loaded = loaded
        self._queue: RunQueue[tuple[FrontEnd, Run]] = RunQueue()
        self._jobs: queue.SimpleQueue[list[Part[tuple[FrontEnd, Run]]]] = queue.SimpleQueue()
        self._threads = 0
        """Pool threads started so far (they are never stopped; idle while batches run inline)."""
        self._inline = True
        _first_call()

    def allow(self, at_once: int) -> None:
        """Let `at_once` batches run at the same time from now on (only ever called by the loader,
        before it answers a Load, and after an unload)."""
        at_once = min(at_once, MAX_BATCH_THREADS)
        if at_once <= 1:
            self._inline = True
            return
        if at_once > self._threads:
            new = at_once - self._threads
            warmed = threading.Barrier(new + 1)
            for _ in range(new):
                threading.Thread(target=self._work, args=(warmed,), name="batches", daemon=True).start()
            warmed.wait()
            self._threads = at_once
        self._inline = False  # from here on the reader hands batches over

    def serve(self, servable_id: int, rules: Rules) -> None:
        self._queue.add(servable_id, rules)

    def forget(self, servable_id: int) -> None:
        for part in self._queue.remove(servable_id):
            front_end, message = part.origin
            front_end.send(Failed(message.seq, f"servable {servable_id} is not loaded in the model worker"))

    def submit(self, front_end: FrontEnd, message: Run) -> None:
        run = self._queue.submit(Part((front_end, message), message.servable_id, message.signature, message.rows))
        if run is None:
            return  # it waits; the thread running its servable's batch takes it next, merged
        if self._inline:
            self._run_through(run)
        else:
            self._jobs.put(run)

    def _work(self, warmed: threading.Barrier) -> None:
        _first_call()
        warmed.wait()
        while True:
            self._run_through(self._jobs.get())

    def _run_through(self, run: list[Part[tuple[FrontEnd, Run]]] | None) -> None:
        """Run it, then whatever waited for the same servable meanwhile, until nothing does."""
        while run is not None:
            servable_id = run[0].servable_id
            self._answer(run)
            run = self._queue.finished(servable_id)

    def _answer(self, run: list[Part[tuple[FrontEnd, Run]]]) -> None:
        for (front_end, _), answer in zip((p.origin for p in run), self._run(run), strict=True):
            front_end.send(answer)

    def _run(self, run: list[Part[tuple[FrontEnd, Run]]]) -> list[Done | Failed]:
        """One model run of one signature: one front-end's batch, or several front-ends' batches
        concatenated (each its own rows back). A batch alone is read straight from its slot and its
        outputs go back as they are (an unbatched signature's need not have a row per input row)."""
        import numpy as np

        started_at = time.monotonic()  # CLOCK_MONOTONIC: the server process reads the same clock
        started = time.perf_counter()
        messages = [p.origin[1] for p in run]
        first = messages[0]
        servable = self._loaded.get(first.servable_id)

        def failed(text: str, code: int | None = None) -> list[Done | Failed]:
            return [Failed(m.seq, text, code) for m in messages]

        if servable is None:
            return failed(f"servable {first.servable_id} is not loaded in the model worker")
        try:
            batches = [read_batch(front_end.slots.get(m.slot), m.inputs) for (front_end, m) in (p.origin for p in run)]
            batch = batches[0] if len(batches) == 1 else {
                name: np.concatenate([b[name] for b in batches], axis=0) for name in batches[0]}
            outputs, replica_rows = servable.runners[first.signature].run(batch)
        except ModelError as exc:
            return failed(str(exc), exc.code)
        except ModelFailure as exc:
            return failed(str(exc))
        except Exception as exc:  # a bug here must fail the batch, not the worker
            log.error("batch of signature '%s' (%d part(s)) failed", first.signature, len(run), exc_info=True)
            return failed(f"{type(exc).__name__}: {exc}")
        seconds = time.perf_counter() - started
        traces = dict(servable.traces)
        if len(messages) == 1:
            return [Done(first.seq, outputs, seconds, traces, replica_rows, started_at, first.rows, first.counted_rows)]
        total = sum(m.rows for m in messages)
        counted = sum(m.counted_rows for m in messages)
        return [Done(m.seq, {name: array[start:end] for name, array in outputs.items()}, seconds, traces,
                     shares(replica_rows, start, end), started_at, total, counted if i == 0 else 0)
                for i, (m, (start, end)) in enumerate(zip(messages, cut([m.rows for m in messages]), strict=True))]


def _first_call() -> None:
    import tensorflow as tf

    tf.reduce_sum(tf.ones((2, 2))).numpy()


def _serve(primary: FrontEnd, batches: _Batches, servables: _Servables) -> None:
    """Read the primary front-end's channel (it also loads and unloads, and attaches the others)."""
    index = 1
    while True:
        try:
            message = primary.conn.recv()
        except (EOFError, OSError):
            return  # the server closed its end or is gone
        if isinstance(message, AttachFrontEnd):
            try:
                conn = Connection(reduction.recv_handle(primary.handles))
                handles = Connection(reduction.recv_handle(primary.handles))
            except (EOFError, OSError):
                return
            front_end = FrontEnd(index, conn, handles)
            index += 1
            threading.Thread(target=_read, args=(front_end, batches), name=f"front-end-{front_end.index}",
                             daemon=True).start()
        elif isinstance(message, Load | Unload):
            servables.submit(message)
        elif not _handle(primary, message, batches):
            return


def _read(front_end: FrontEnd, batches: _Batches) -> None:
    """A secondary front-end's channel, until it closes (it stopped, or died): then its slots are
    unmapped."""
    try:
        while True:
            try:
                message = front_end.conn.recv()
            except (EOFError, OSError):
                return
            if not _handle(front_end, message, batches):
                return
    finally:
        front_end.close()


def _handle(front_end: FrontEnd, message: object, batches: _Batches) -> bool:
    """A slot or a batch from a front-end; False when its channel can no longer be read."""
    if isinstance(message, NewSlot):
        try:
            fd = reduction.recv_handle(front_end.handles)
        except (EOFError, OSError):
            return False
        old = front_end.slots.pop(message.index, None)
        front_end.slots[message.index] = mmap.mmap(fd, message.size)
        os.close(fd)
        if old is not None:
            _close(old)
    elif isinstance(message, Run):
        batches.submit(front_end, message)
    else:
        log.error("unexpected message from front-end %d: %r", front_end.index, type(message).__name__)
    return True


def _close(buffer: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view is still alive; it unmaps when that goes
        buffer.close()
