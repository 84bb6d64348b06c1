"""Request logging, which TF Serving's config accepts but its open-source build never shipped: a
model's `logging_config` has a share of its TF Serving requests (Predict, Classify, Regress over
gRPC and REST; MultiInference), each with its response, written as `PredictionLog` records to
TFRecord files, the format of TF Serving's warmup files (so `python -m client warmup-from-log`
turns captured traffic into one).

- **Sampling** is one random draw per request; only a sampled request costs more: its log record
  is built and serialized on the event loop, as the request and response it holds are at hand
  there and may change after.
- **Writing is off the request path**: the record goes to one writer thread per model, which
  every WRITE_INTERVAL_S writes what has come, flushes (so a reader sees whole records) and
  rotates files.
- **Bounded.** Records waiting for the writer are bounded by one file's worth of bytes; past it a
  record is dropped and counted (mirrorserve_request_log_dropped_total{reason="queue_full"}), and
  the request goes on unhindered. A file is closed at --request-log-file-bytes and a new one
  opened; only the newest --request-log-max-files of a logger are kept. A write that fails (a full
  disk) drops its record, counted as reason="write_error", logged at most every 10 s.

Files are `<filename_prefix>.<start time>.<pid>.<n>.tfrecord`, n counting from 0 in each process.
The Open Inference Protocol's requests are not logged: PredictionLog has no kind for them.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from protos.tensorflow_serving import prediction_log_pb2
from server import metrics
from server.api import tensor_codec as codec
from server.api import tfrecords
from server.core.model_config import RequestLogging
from server.core.servables import Registry, Servable

log = logging.getLogger("server.api.request_log")

ERROR_LOG_EVERY_S = 10.0
WRITE_INTERVAL_S = 0.01
SERVING_TAG = "serve"


class RequestLogger:
    """One model's sampled requests, written by a thread of its own."""

    def __init__(self, model: str, config: RequestLogging, max_file_bytes: int, max_files: int) -> None:
        self.model = model
        self.config = config
        self.rate = config.sampling_rate
        self._max_file_bytes = max_file_bytes
        self._max_files = max_files
        self._max_pending = max_file_bytes
        self._pending = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._stamp = time.strftime("%Y%m%d-%H%M%S")
        self._sequence = 0
        self._files: list[str] = []
        self._writer: tfrecords.Writer | None = None
        self._written_bytes = 0
        self._last_error_log = 0.0
        self._records = metrics.REQUEST_LOG_RECORDS.labels(model)
        self._bytes = metrics.REQUEST_LOG_BYTES.labels(model)
        self._dropped_full = metrics.REQUEST_LOG_DROPPED.labels(model, "queue_full")
        self._dropped_error = metrics.REQUEST_LOG_DROPPED.labels(model, "write_error")
        self._thread = threading.Thread(target=self._run, name=f"request-log-{model}", daemon=True)
        self._thread.start()
        log.info("logging model=%s requests: sampling_rate=%g files=%s.*.tfrecord", model, self.rate,
                 config.filename_prefix, extra={"model": model})

    def sampled(self) -> bool:
        return self.rate >= 1.0 or random.random() < self.rate

    def put(self, record: bytes) -> None:
        """Hand a record to the writer, or drop it (counted) when the writer is a file behind."""
        with self._lock:
            if self._pending + len(record) > self._max_pending:
                self._dropped_full.inc()
                return
            self._pending += len(record)
        self._queue.put(record)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, close the file, stop the thread (waiting at most timeout_s)."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            records = [self._queue.get()]
            while True:  # everything queued now, then one flush
                try:
                    records.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for record in records:
                if record is None:
                    stopping = True
                    continue
                with self._lock:
                    self._pending -= len(record)
                self._write(record)
            self._flush()
            if not stopping:
                # Records then wait a moment and are written together: one wake-up of this thread
                # (and one hand-over of the GIL to it) per WRITE_INTERVAL_S, not one per record.
                time.sleep(WRITE_INTERVAL_S)
        self._close_file()

    def _write(self, record: bytes) -> None:
        try:
            if self._writer is None or self._written_bytes >= self._max_file_bytes:
                self._next_file()
            assert self._writer is not None
            self._writer.write(record)
        except OSError as exc:
            self._failed(exc)
            self._dropped_error.inc()
            return
        self._written_bytes += len(record) + 16
        self._records.inc()
        self._bytes.inc(len(record) + 16)

    def _flush(self) -> None:
        if self._writer is not None:
            try:
                self._writer.flush()
            except OSError as exc:
                self._failed(exc)

    def _next_file(self) -> None:
        self._close_file()
        path = f"{self.config.filename_prefix}.{self._stamp}.{os.getpid()}.{self._sequence}.tfrecord"
        self._sequence += 1
        self._writer = tfrecords.Writer(path)
        self._written_bytes = 0
        self._files.append(path)
        while len(self._files) > self._max_files:
            oldest = self._files.pop(0)
            try:
                os.remove(oldest)
            except OSError as exc:
                self._failed(exc)

    def _close_file(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError as exc:
                self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        self._close_file()  # the next record opens a new file
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_EVERY_S:
            self._last_error_log = now
            log.error("request log of model=%s: %s; records are dropped until writing works again", self.model, exc,
                      extra={"model": self.model})


class RequestLogs:
    """Each configured model's logger, made on its first request and replaced when its
    logging_config changes (a config reload)."""

    def __init__(self, registry: Registry, max_file_bytes: int, max_files: int) -> None:
        self._registry = registry
        self._max_file_bytes = max_file_bytes
        self._max_files = max_files
        self._loggers: dict[str, RequestLogger] = {}

    def sample(self, servable: Servable) -> RequestLogger | None:
        """The version's model's logger if this request is to be logged, else None."""
        model = self._registry.models.get(servable.name)
        config = None if model is None else model.source.logging
        if config is None or config.sampling_rate <= 0.0:
            return None
        logger = self._loggers.get(servable.name)
        if logger is None or logger.config is not config:
            if logger is not None:
                logger.close(0.0)  # its thread writes what it holds, then ends
            logger = self._loggers[servable.name] = RequestLogger(servable.name, config, self._max_file_bytes,
                                                                  self._max_files)
        return logger if logger.sampled() else None

    def retire(self, registry: Registry) -> None:
        """Stop the writers of models no longer configured to log (after writing what they hold)."""
        for name, logger in list(self._loggers.items()):
            model = registry.models.get(name)
            if model is None or model.source.logging is not logger.config:
                del self._loggers[name]
                logger.close(0.0)

    def close(self, timeout_s: float = 5.0) -> None:
        for logger in self._loggers.values():
            logger.close(timeout_s)


def call_record(servable: Servable, signature: str, rate: float, kind: str, request: bytes, response: Any) -> bytes:
    """A serialized PredictionLog of one TF Serving call (`kind`: its log's field, "predict_log",
    "classify_log", "regress_log" or "multi_inference_log"), its request as the client's bytes
    (the same wire format as the message; parsed again only for a sampled call)."""
    record = prediction_log_pb2.PredictionLog()
    _metadata(record, servable, signature, rate)
    log_entry = getattr(record, kind)
    log_entry.request.MergeFromString(request)
    log_entry.response.CopyFrom(response)
    data: bytes = record.SerializeToString()
    return data


def predict_record_of_arrays(servable: Servable, signature: str, rate: float, inputs: Mapping[str, np.ndarray],
                             outputs: Mapping[str, np.ndarray]) -> bytes:
    """A serialized PredictionLog of a call that came as JSON (REST): its tensors as the gRPC call
    would have carried them."""
    record = prediction_log_pb2.PredictionLog()
    spec = _metadata(record, servable, signature, rate)
    request, response = record.predict_log.request, record.predict_log.response
    request.model_spec.CopyFrom(spec)
    response.model_spec.CopyFrom(spec)
    for name, array in inputs.items():
        codec.fill_tensor_proto(request.inputs[name], array)
    for name, array in outputs.items():
        codec.fill_tensor_proto(response.outputs[name], array)
    data: bytes = record.SerializeToString()
    return data


def _metadata(record: prediction_log_pb2.PredictionLog, servable: Servable, signature: str, rate: float) -> object:
    metadata = record.log_metadata
    spec = metadata.model_spec
    spec.name = servable.name
    spec.version.value = servable.version
    spec.signature_name = signature
    metadata.sampling_config.sampling_rate = rate
    metadata.saved_model_tags.append(SERVING_TAG)
    metadata.timestamp_secs = int(time.time())
    return spec
