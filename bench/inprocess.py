"""The in-process ceiling: the SavedModel called directly, no server, at several batch sizes.

usage: python -m bench.inprocess MODEL_BASE INPUT.npy RESPONSE_OUT SECONDS BATCH [BATCH ...]
Prints one JSON object: {"rows_per_s": {BATCH: rows/s, ...}, "cpu_us_per_row": {BATCH: µs, ...},
"one_row_ms": M}, where the CPU is the whole process's (every TensorFlow thread) over the calls at
that batch size, and M is the median wall time of single 1-row calls, each timed on its own
(outputs converted to numpy, as a server must). Also writes the PredictResponse a server would
send for INPUT.npy, for the fixed-response server to replay, and the GetModelMetadataResponse
beside it (bench.metadata).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from bench.metadata import metadata_file, metadata_response
from protos.tensorflow_serving import predict_pb2
from server.api.tensor_codec import to_tensor_proto

ONE_ROW_CALLS = (20, 2000)
"""Fewest and most single 1-row calls timed (within SECONDS otherwise)."""


def main() -> None:
    base, input_path, response_out, seconds = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
    batches = [int(b) for b in sys.argv[5:]]
    signature = tf.saved_model.load(str(base / "1")).signatures["serving_default"]
    (name,) = signature.structured_input_signature[1]
    row = np.load(input_path)
    response = predict_pb2.PredictResponse()
    for out_name, value in signature(**{name: row}).items():
        response.outputs[out_name].CopyFrom(to_tensor_proto(value.numpy()))
    response.model_spec.name = base.name
    response.model_spec.version.value = 1
    response.model_spec.signature_name = "serving_default"
    response_out.write_bytes(response.SerializeToString())
    metadata_file(response_out).write_bytes(metadata_response(base / "1", base.name, 1))

    rows_per_s, cpu_us_per_row = {}, {}
    for batch in batches:
        x = np.repeat(row, batch, axis=0)
        for _ in range(3):
            signature(**{name: x})
        calls = 0
        started, cpu_started = time.perf_counter(), time.process_time()
        while time.perf_counter() - started < seconds:
            {k: v.numpy() for k, v in signature(**{name: x}).items()}
            calls += 1
        rows_per_s[batch] = calls * batch / (time.perf_counter() - started)
        cpu_us_per_row[batch] = (time.process_time() - cpu_started) * 1e6 / (calls * batch)

    fewest, most = ONE_ROW_CALLS
    one_row: list[float] = []
    started = time.perf_counter()
    while len(one_row) < most and (len(one_row) < fewest or time.perf_counter() - started < seconds):
        call_started = time.perf_counter()
        {k: v.numpy() for k, v in signature(**{name: row}).items()}
        one_row.append(time.perf_counter() - call_started)
    print(json.dumps({"rows_per_s": rows_per_s, "cpu_us_per_row": cpu_us_per_row,
                      "one_row_ms": statistics.median(one_row) * 1e3}))


if __name__ == "__main__":
    main()
