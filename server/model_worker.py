"""The model worker: the child process that owns TensorFlow.

Why a process and not a thread of the server: TensorFlow's Python call path holds the GIL for
~120 µs a batch, and each hand-off back to the event loop is another GIL round trip, which the
event loop and gRPC's poller thread then wait for. Measured on the 2-core machine of issue 5, a
thread calling the MLP in a loop took 28-40% of a fixed-response grpc.aio server's throughput; the
same loop in a separate process took 14-21% (what its CPU use costs, and no more). Here the server
process keeps gRPC, parsing and batching; this process loads the model, warms up every batch size,
and then runs batches one after another as they arrive, so a batch sent while another runs starts
the moment it ends.

It ignores SIGINT and SIGTERM (the server drains on them and still needs the model) and exits when
the server's end of the socket closes, which also happens if the server dies.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import mmap
import os
import signal
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
    traces = ready.traces
    gc.collect()
    gc.freeze()  # as in the server: no full collection over TensorFlow's objects mid-batch
    conn.send(ready)
    _serve(conn, runners, traces)


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
    for runner in runners.values():
        runner.warm_up(settings.max_batch_size)
    ready = Ready(
        info=info,
        signature_defs={k: d.SerializeToString() for k, d in loaded.signature_defs.items()},
        path=str(loaded.path),
        devices=devices,
        traces=traces,  # the same Counter, updated by later traces
    )
    return ready, runners


def _serve(conn: Connection, runners: dict[str, SignatureRunner], traces: dict[str, int]) -> None:
    slots: dict[int, mmap.mmap] = {}
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
            conn.send(_run(message, slots.get(message.slot), runners, traces))
        else:
            log.error("unexpected message from the server: %r", type(message).__name__)


def _run(message: Run, slot: mmap.mmap | None, runners: dict[str, SignatureRunner],
         traces: dict[str, int]) -> Done | Failed:
    started = time.perf_counter()
    try:
        batch = read_batch(slot, message.inputs)
        outputs = runners[message.signature](batch)
    except ModelFailure as exc:
        return Failed(message.seq, str(exc))
    except Exception as exc:  # a bug here must fail the batch, not the worker
        log.error("batch of signature '%s' failed", message.signature, exc_info=True)
        return Failed(message.seq, f"{type(exc).__name__}: {exc}")
    return Done(message.seq, outputs, time.perf_counter() - started, dict(traces))


def _close(buffer: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view is still alive; it unmaps when that goes
        buffer.close()
