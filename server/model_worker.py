"""The model worker: the child process that owns TensorFlow.

Why a process and not a thread of the server: TensorFlow's Python call path holds the GIL for
~120 µs a batch, and each hand-off back to the event loop is another GIL round trip, which the
event loop and gRPC's poller thread then wait for. Measured on the 2-core machine of issue 5, a
thread calling the MLP in a loop took 28-40% of a fixed-response grpc.aio server's throughput; the
same loop in a separate process took 14-21% (what its CPU use costs, and no more). Here the server
process keeps gRPC, parsing and batching; this process loads the model, warms up every batch size,
and then runs batches as they arrive, up to --max-inflight-batches (default 2) at once; with 1, one
after another, so a batch sent while another runs starts the moment it ends.

It ignores SIGINT and SIGTERM (the server drains on them and still needs the model) and exits when
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

from server import logs
from server.config import Settings
from server.errors import ModelFailure
from server.worker_protocol import Done, Failed, LoadFailed, NewSlot, Ready, Run, read_batch

if TYPE_CHECKING:
    from server.replicas import SignatureRunner

log = logging.getLogger("server.model_worker")


def run(conn: Connection, settings: Settings) -> None:
    """Process entry point (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logs.configure(settings.log_format, settings.log_level)
    try:
        ready, runners = _load(settings)
    except Exception as exc:
        log.debug("loading failed", exc_info=True)
        conn.send(LoadFailed(type(exc).__name__, str(exc)))
        return
    slots: dict[int, mmap.mmap] = {}
    batches = _Batches(conn, runners, ready.traces, slots, settings.max_inflight_batches,
                       settings.max_batch_size)
    gc.collect()
    gc.freeze()  # as in the server: no full collection over TensorFlow's objects mid-batch
    conn.send(ready)
    _serve(conn, slots, batches)


def _load(settings: Settings) -> tuple[Ready, dict[str, SignatureRunner]]:
    from server import demo_model, model, replicas

    replicas.configure_threads(settings.intra_op_threads, settings.inter_op_threads)
    devices = replicas.configure_devices(settings.replicas)
    base_path = settings.model_base_path or str(demo_model.ensure_demo_model())
    strategy = replicas.make_strategy(devices)
    loaded = model.load(base_path, settings.model_name, strategy)
    info = loaded.info
    for name, problem in info.unservable.items():
        log.warning("signature '%s' will not be served: %s", name, problem)
    traces: Counter[str] = Counter()

    def counter(name: str) -> Any:
        return lambda: traces.update((name,))

    runners = {
        name: replicas.SignatureRunner(strategy, loaded.functions[name], signature, on_trace=counter(name))
        for name, signature in info.signatures.items()
        if name not in info.unservable
    }
    ready = Ready(
        info=info,
        signature_defs={k: d.SerializeToString() for k, d in loaded.signature_defs.items()},
        path=str(loaded.path),
        devices=devices,
        traces=traces,  # the same Counter, updated by later traces
    )
    return ready, runners


class _Batches:
    """Runs batches and sends their answers. With --max-inflight-batches 1, inline on the thread
    reading the socket. With --max-inflight-batches N > 1, on N threads, so batches the
    server sends together run together: on a CPU, TensorFlow's thread pool leaves cores idle while
    one call waits for its slowest shard, and a second call fills them. Every thread that will run
    batches is warmed up (every batch size of every signature) before the worker says ready, as
    TensorFlow sets up per-thread state on a thread's first call."""

    def __init__(self, conn: Connection, runners: dict[str, SignatureRunner], traces: dict[str, int],
                 slots: dict[int, mmap.mmap], threads: int, max_rows: int) -> None:
        self._conn = conn
        self._runners = runners
        self._traces = traces
        self._slots = slots
        self._send_lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Run] | None = None
        if threads == 1:
            self._warm_up(max_rows)
        else:
            self._jobs = queue.SimpleQueue()
            warmed = threading.Barrier(threads + 1)
            for i in range(threads):
                threading.Thread(target=self._work, args=(warmed, max_rows), name=f"batches-{i}",
                                 daemon=True).start()
            warmed.wait()

    def submit(self, message: Run) -> None:
        if self._jobs is None:
            self._answer(message)
        else:
            self._jobs.put(message)

    def _warm_up(self, max_rows: int) -> None:
        for runner in self._runners.values():
            runner.warm_up(max_rows)

    def _work(self, warmed: threading.Barrier, max_rows: int) -> None:
        self._warm_up(max_rows)
        warmed.wait()
        assert self._jobs is not None
        while True:
            self._answer(self._jobs.get())

    def _answer(self, message: Run) -> None:
        result = self._run(message)
        with self._send_lock:
            self._conn.send(result)

    def _run(self, message: Run) -> Done | Failed:
        started = time.perf_counter()
        try:
            batch = read_batch(self._slots.get(message.slot), message.inputs)
            outputs = self._runners[message.signature](batch)
        except ModelFailure as exc:
            return Failed(message.seq, str(exc))
        except Exception as exc:  # a bug here must fail the batch, not the worker
            log.error("batch of signature '%s' failed", message.signature, exc_info=True)
            return Failed(message.seq, f"{type(exc).__name__}: {exc}")
        return Done(message.seq, outputs, time.perf_counter() - started, dict(self._traces))


def _serve(conn: Connection, slots: dict[int, mmap.mmap], batches: _Batches) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the server closed its end or is gone
        if isinstance(message, NewSlot):
            fd = reduction.recv_handle(conn)
            old = slots.pop(message.index, None)
            slots[message.index] = mmap.mmap(fd, message.size)
            os.close(fd)
            if old is not None:
                _close(old)
        elif isinstance(message, Run):
            batches.submit(message)
        else:
            log.error("unexpected message from the server: %r", type(message).__name__)


def _close(buffer: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view is still alive; it unmaps when that goes
        buffer.close()
