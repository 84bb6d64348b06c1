"""`python -m client warmup-from-log LOG... --out DIR/assets.extra/tf_serving_warmup_requests`:
turn captured traffic (the server's request logs, server.api.request_log) into a TF Serving warmup
file, which the server (and TF Serving) replays before a version serves.

Keeps the Predict, Classify, Regress and MultiInference requests (responses and metadata dropped:
warmup only sends requests), of one model with --model, up to --max-records (TF Serving replays at
most 1,000; a file with more fails the load), in the order of the logs given. The file is written
beside its final name and renamed into place, so a server polling the folder never sees half of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from protos.tensorflow_serving import prediction_log_pb2
from server.api import tfrecords

MAX_RECORDS = 1000
KINDS = ("predict_log", "classify_log", "regress_log", "multi_inference_log")
"""The records a warmup replays."""


def warmup_from_logs(logs: Sequence[Path], out: Path, model: str | None = None,
                     max_records: int = MAX_RECORDS) -> tuple[int, int]:
    """Write the warmup file; (records written, records read)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    written = read = 0
    with tfrecords.Writer(partial) as writer:
        for path in logs:
            for raw in tfrecords.read(path):
                read += 1
                record = prediction_log_pb2.PredictionLog.FromString(raw)
                kind = record.WhichOneof("log_type")
                if kind not in KINDS:
                    continue
                if model is not None and record.log_metadata.model_spec.name != model:
                    continue
                warmup = prediction_log_pb2.PredictionLog()
                getattr(warmup, kind).request.CopyFrom(getattr(record, kind).request)
                writer.write(warmup.SerializeToString())
                written += 1
                if written == max_records:
                    break
            if written == max_records:
                break
    os.replace(partial, out)
    return written, read
