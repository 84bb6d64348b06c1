"""TensorFlow Serving's warmup files: before a version turns AVAILABLE, the requests in its
`assets.extra/tf_serving_warmup_requests` are run through the same decode -> `infer` path, batcher
and model worker as real ones, so that what a model sets up on its first calls (tracing, kernels,
allocations for real shapes) is paid before clients arrive.

As in TF Serving: the file is a TFRecord file of `PredictionLog`s, read a record at a time
(each runs before the next is read); more than MAX_RECORDS records fail the load, so do a corrupt
record and a record that fails; each record runs `iterations` times
(--num_request_iterations_for_warmup); the model spec in a record is ignored (the version being
loaded answers); no file is no warmup. Predict, Classify, Regress and MultiInference records are
run. Unlike TF Serving, records of kinds this server does not serve (session run, streamed
predict) are skipped and counted in the log line instead of failing the load.

A failure is a LoadError naming the file and the record, so the lifecycle fails that version's
load like a corrupt SavedModel: versions already serving go on serving. The file is read through
server.api.tfrecords.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from protos.tensorflow_serving import prediction_log_pb2, serialized_input_pb2
from protos.tf.tensorflow.core.protobuf import error_codes_pb2
from protos.tf.tensorflow.core.protobuf.error_codes_pb2 import DATA_LOSS, INTERNAL, INVALID_ARGUMENT
from server import metrics
from server.api import tensor_codec as codec
from server.api import tfrecords
from server.api.status import STATUS_FOR
from server.api.tfserving.examples import ExampleCalls
from server.core.example_methods import CLASSIFY, REGRESS
from server.core.inference import infer
from server.core.model_process import LoadError
from server.core.servables import Servable
from server.core.version_folders import WARMUP_FILE
from server.errors import ModelError, ServingError

log = logging.getLogger("server.api.warmup")

MAX_RECORDS = 1000
"""TF Serving's WarmupConsts::kMaxNumRecords."""


@dataclass
class Replayed:
    """What a warmup ran: its records, the requests it sent, what it skipped, by kind."""

    path: Path
    records: int = 0
    requests: int = 0
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)
    seconds: float = 0.0

    def describe(self) -> str:
        skipped = ", ".join(f"{n} {kind}" for kind, n in sorted(self.skipped.items()))
        return (f"{self.records} records, {self.requests} requests in {self.seconds:.2f} s"
                + (f"; skipped (not served here): {skipped}" if skipped else ""))


def iter_records(path: Path, limit: int = MAX_RECORDS) -> Iterator[bytes]:
    """The file's records one at a time, each checked against its CRC32C; LoadError DATA_LOSS for a
    corrupt or truncated file, INVALID_ARGUMENT past `limit` records (both TF Serving's codes)."""
    count = 0
    try:
        for record in tfrecords.read(path):
            if count == limit:
                raise LoadError(INVALID_ARGUMENT, f"Number of warmup records exceeds the maximum ({limit}) at {path}")
            count += 1
            yield record
    except (RuntimeError, MemoryError, OverflowError) as exc:
        raise LoadError(DATA_LOSS, f"{path}: record {count} cannot be read ({exc}); "
                                   f"is the warmup file in TFRecord format?") from None
    except OSError as exc:
        raise LoadError(DATA_LOSS, f"cannot read warmup file {path}: {exc.strerror or exc}") from None


def _failure(exc: Exception) -> tuple[int, str]:
    """A failed warmup request's code and message (the model's own error text included: this goes
    to the operator's log and the version's status, not to a client)."""
    if isinstance(exc, ModelError):
        return exc.code, str(exc)
    if isinstance(exc, ServingError) and type(exc) in STATUS_FOR:
        return STATUS_FOR[type(exc)].value[0], str(exc) or type(exc).__name__
    log.error("warmup request failed unexpectedly", exc_info=exc)
    return INTERNAL, f"{type(exc).__name__}: {exc}"


class Warmup:
    """The lifecycle's warm-up hook: replays a version's warmup file, if it has one."""

    def __init__(self, iterations: int, max_tensor_bytes: int, examples: ExampleCalls) -> None:
        self._iterations = iterations
        self._max_tensor_bytes = max_tensor_bytes
        self._examples = examples

    def covers(self, path: str) -> bool:
        return (Path(path) / WARMUP_FILE).is_file()

    async def __call__(self, servable: Servable) -> Replayed | None:
        path = Path(servable.path) / WARMUP_FILE
        if not path.is_file():
            return None
        started = time.monotonic()
        done = Replayed(path)
        status = "OK"
        try:
            # Read a record at a time off the loop, as TF Serving streams the file: one record in memory.
            records = iter_records(path)
            while (raw := await asyncio.to_thread(next, records, None)) is not None:
                await self._replay(servable, path, done.records, raw, done)
                done.records += 1
        except LoadError as exc:
            status = error_codes_pb2.Code.Name(exc.code)
            raise
        finally:
            done.seconds = time.monotonic() - started
            metrics.TFS_WARMUP_LATENCY.labels(servable.path, status).observe(done.seconds * 1e6)
        log.info("warmed up model=%s version=%d from %s: %s", servable.name, servable.version, path,
                 done.describe(), extra={"model": servable.name, "version": servable.version})
        return done

    async def _replay(self, servable: Servable, path: Path, index: int, raw: bytes, done: Replayed) -> None:
        try:
            record = prediction_log_pb2.PredictionLog.FromString(raw)
        except DecodeError as exc:
            raise LoadError(INVALID_ARGUMENT, f"{path}: record {index} is not a PredictionLog: {exc}") from None
        kind = record.WhichOneof("log_type")
        try:
            run = self._runner(servable, record, kind)
            if run is None:
                done.skipped[kind or "empty"] += 1
                return
            for _ in range(self._iterations):
                await run()
                done.requests += 1
        except Exception as exc:  # any failure fails the load, named
            code, message = _failure(exc)
            raise LoadError(code, f"{path}: record {index} ({kind}) failed: {message}") from None

    def _runner(self, servable: Servable, record: Any, kind: str | None) -> Callable[[], Awaitable[object]] | None:
        """The call a record makes (decoded once, run `iterations` times), or None for a kind not served."""
        if kind == "predict_log":
            request = record.predict_log.request
            inputs = {name: codec.to_ndarray(tensor, name=name, max_bytes=self._max_tensor_bytes)
                      for name, tensor in request.inputs.items()}
            return lambda: infer(servable, request.model_spec.signature_name, inputs, request.output_filter, None)
        if kind in ("classify_log", "regress_log"):
            examples = serialized_input_pb2.SerializedExamplesRequest.FromString(
                getattr(record, kind).request.SerializeToString())
            method = CLASSIFY if kind == "classify_log" else REGRESS
            return lambda: self._examples.run(servable, method, examples, None)
        if kind == "multi_inference_log":
            multi = serialized_input_pb2.SerializedMultiInferenceRequest.FromString(
                record.multi_inference_log.request.SerializeToString())
            return lambda: self._examples.multi_inference(servable, multi, None)
        return None
