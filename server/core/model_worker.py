"""The model worker: the child process that owns TensorFlow.

Why a process and not a thread of the server: TensorFlow's Python call path holds the GIL for
~120 µs a batch, and each hand-off back to the event loop is another GIL round trip, which the
event loop and gRPC's poller thread then wait for. Measured on the 2-core machine of issue 5, a
thread calling the MLP in a loop took 28-40% of a fixed-response grpc.aio server's throughput; the
same loop in a separate process took 14-21% (what its CPU use costs, and no more). Here the server
process keeps gRPC, parsing, batching and the model lifecycle; this process holds every loaded
model version (servable) under one strategy, and runs batches as they arrive, as many at once as
the largest max-inflight-batches of the servables it holds (default 1), whichever servables they
are for.

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
import ctypes
import ctypes.util
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

from server import logs
from server.config import Settings
from server.core.worker_protocol import (
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
from server.errors import ModelFailure

if TYPE_CHECKING:
    import tensorflow as tf

    from server.core.replicas import SignatureRunner

log = logging.getLogger("server.core.model_worker")


# tensorflow.error.Code values for load failures TensorFlow itself does not code.
UNKNOWN, INVALID_ARGUMENT, NOT_FOUND, DATA_LOSS = 2, 3, 5, 15
MAX_ERROR_CHARS = 2000


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
    send_lock = threading.Lock()
    slots: dict[int, mmap.mmap] = {}
    loaded: dict[int, _Servable] = {}
    batches = _Batches(conn, send_lock, slots, loaded)
    servables = _Servables(conn, send_lock, strategy, batches, loaded)
    gc.collect()
    gc.freeze()  # as in the server: no full collection over TensorFlow's objects mid-batch
    conn.send(Started(devices, demo))
    _serve(conn, handles, slots, batches, servables)


def _start(settings: Settings) -> tuple[tf.distribute.Strategy, list[str]]:
    from server.core import replicas

    replicas.configure_threads(settings.intra_op_threads, settings.inter_op_threads)
    devices = replicas.configure_devices(settings.replicas)
    return replicas.make_strategy(devices), devices


def _demo_base_path(settings: Settings) -> str | None:
    """With no model configured, the built-in demo model (built here, where TensorFlow runs)."""
    if settings.model_base_path is not None or settings.model_config_file is not None:
        return None
    from server.core import demo_model

    return str(demo_model.ensure_demo_model())


def error_code(exc: BaseException) -> int:
    """The tensorflow.error.Code GetModelStatus reports for a failed load."""
    import tensorflow as tf
    from google.protobuf.message import DecodeError

    if isinstance(exc, tf.errors.OpError):
        return int(exc.error_code)
    if isinstance(exc, FileNotFoundError):
        return NOT_FOUND
    if isinstance(exc, DecodeError):
        return DATA_LOSS
    if isinstance(exc, ValueError):
        return INVALID_ARGUMENT
    return UNKNOWN


class _Servable:
    def __init__(self, runners: dict[str, SignatureRunner], handle: Any, traces: Counter[str]) -> None:
        self.runners = runners
        self.handle = handle
        self.traces = traces


class _Servables:
    """The loaded servables, and the thread that loads and unloads them one at a time."""

    def __init__(self, conn: Connection, send_lock: threading.Lock, strategy: tf.distribute.Strategy,
                 batches: _Batches, loaded: dict[int, _Servable]) -> None:
        self._conn = conn
        self._send_lock = send_lock
        self._strategy = strategy
        self._batches = batches
        self._loaded = loaded
        """Servable id -> its runners, shared with the batches that run them."""
        self._jobs: queue.SimpleQueue[Load | Unload] = queue.SimpleQueue()
        threading.Thread(target=self._work, name="loader", daemon=True).start()

    def submit(self, message: Load | Unload) -> None:
        self._jobs.put(message)

    def _send(self, message: object) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, Load):
                self._send(self._load(job))
            else:
                self._unload(job.servable)
                self._send(Unloaded(job.servable))

    def _load(self, job: Load) -> Loaded | LoadFailed:
        from server.core import model, replicas

        started = time.perf_counter()
        self._batches.grow(job.max_inflight)  # before Loaded: the server may then send that many at once
        try:
            loaded = model.load(job.path, job.name, job.version, self._strategy)
            info = loaded.info
            for name, problem in info.unservable.items():
                log.warning("model '%s' version %d: signature '%s' will not be served: %s",
                            job.name, job.version, name, problem)
            traces: Counter[str] = Counter()

            def counter(name: str) -> Any:
                return lambda: traces.update((name,))

            runners = {
                name: replicas.SignatureRunner(self._strategy, loaded.functions[name], signature,
                                               on_trace=counter(name))
                for name, signature in info.signatures.items()
                if name not in info.unservable
            }
            for runner in runners.values():
                runner.warm_up(job.warm_up_sizes)
        except Exception as exc:
            log.debug("loading %s failed", job.path, exc_info=True)
            failed = LoadFailed(job.servable, error_code(exc), f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
            del exc  # its traceback holds the half-loaded model
            _collect()
            return failed
        self._loaded[job.servable] = _Servable(runners, loaded.handle, traces)
        gc.collect()
        gc.freeze()
        return Loaded(job.servable, info, {k: d.SerializeToString() for k, d in loaded.signature_defs.items()},
                      time.perf_counter() - started)

    def _unload(self, servable: int) -> None:
        self._loaded.pop(servable, None)
        _collect()


def _collect() -> None:
    """Free what an unloaded (or failed) servable held: its objects may sit in the frozen
    generation, so thaw, collect, freeze again; then give freed heap pages back to the OS."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _malloc_trim()


def _malloc_trim() -> None:
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


class _Batches:
    """Runs batches and sends their answers. While one batch at a time is asked for, inline on the
    thread reading the socket (no hand-off, no wake-up). Once a servable allows N > 1 at once, on
    N threads, so batches the server sends together run together. Each thread makes one small
    TensorFlow call before it takes batches, as TensorFlow sets up per-thread state on a thread's
    first call; each servable's own warm-up (tracing, every batch size) is done by the loader
    before the server may send it a batch."""

    def __init__(self, conn: Connection, send_lock: threading.Lock, slots: dict[int, mmap.mmap],
                 loaded: dict[int, _Servable]) -> None:
        self._conn = conn
        self._send_lock = send_lock
        self._slots = slots
        self._loaded = loaded
        self._jobs: queue.SimpleQueue[Run] | None = None
        self._threads = 1
        """Threads that run batches: the reader itself while _jobs is None. Each Load says how many
        batches of its servable may run at once, and grow() adds threads before it is answered."""
        _first_call()

    def grow(self, threads: int) -> None:
        """Have at least `threads` batch threads (only ever called by one thread at a time)."""
        if threads <= self._threads:
            return
        jobs = self._jobs if self._jobs is not None else queue.SimpleQueue()
        new = threads if self._jobs is None else threads - self._threads
        warmed = threading.Barrier(new + 1)
        for _ in range(new):
            threading.Thread(target=self._work, args=(jobs, warmed), name="batches", daemon=True).start()
        warmed.wait()
        self._jobs = jobs  # from here on the reader hands batches over
        self._threads = threads

    def submit(self, message: Run) -> None:
        jobs = self._jobs
        if jobs is None:
            self._answer(message)
        else:
            jobs.put(message)

    def _work(self, jobs: queue.SimpleQueue[Run], warmed: threading.Barrier) -> None:
        _first_call()
        warmed.wait()
        while True:
            self._answer(jobs.get())

    def _answer(self, message: Run) -> None:
        result = self._run(message)
        with self._send_lock:
            self._conn.send(result)

    def _run(self, message: Run) -> Done | Failed:
        started = time.perf_counter()
        servable = self._loaded.get(message.servable)
        if servable is None:
            return Failed(message.seq, f"servable {message.servable} is not loaded in the model worker")
        try:
            batch = read_batch(self._slots.get(message.slot), message.inputs)
            outputs = servable.runners[message.signature](batch)
        except ModelFailure as exc:
            return Failed(message.seq, str(exc))
        except Exception as exc:  # a bug here must fail the batch, not the worker
            log.error("batch of signature '%s' failed", message.signature, exc_info=True)
            return Failed(message.seq, f"{type(exc).__name__}: {exc}")
        return Done(message.seq, outputs, time.perf_counter() - started, dict(servable.traces))


def _first_call() -> None:
    import tensorflow as tf

    tf.reduce_sum(tf.ones((2, 2))).numpy()


def _serve(conn: Connection, handles: Connection, slots: dict[int, mmap.mmap], batches: _Batches,
           servables: _Servables) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the server closed its end or is gone
        if isinstance(message, NewSlot):
            try:
                fd = reduction.recv_handle(handles)
            except (EOFError, OSError):
                return
            old = slots.pop(message.index, None)
            slots[message.index] = mmap.mmap(fd, message.size)
            os.close(fd)
            if old is not None:
                _close(old)
        elif isinstance(message, Run):
            batches.submit(message)
        elif isinstance(message, Load | Unload):
            servables.submit(message)
        else:
            log.error("unexpected message from the server: %r", type(message).__name__)


def _close(buffer: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view is still alive; it unmaps when that goes
        buffer.close()
