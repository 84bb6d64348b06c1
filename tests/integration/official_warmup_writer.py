"""Runs in its own process with only the official `tensorflow-serving-api` package on the path:
writes a warmup file the way TF Serving's documentation does (PredictionLog records, serialized,
through TensorFlow's own tf.io.TFRecordWriter).

usage: official_warmup_writer.py OUT INPUTS.npz [SESSION_RUN_RECORDS]
Each array "<record>/<input>" of INPUTS.npz becomes input <input> of predict record <record>
(records in sorted order); then SESSION_RUN_RECORDS session_run_log records (default 0), a kind
the server skips.
"""

import sys

import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_log_pb2


def main() -> None:
    out, inputs_path = sys.argv[1:3]
    session_runs = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    records: dict[str, dict[str, np.ndarray]] = {}
    with np.load(inputs_path) as arrays:
        for key in arrays.files:
            record, _, name = key.partition("/")
            records.setdefault(record, {})[name] = arrays[key]
    with tf.io.TFRecordWriter(out) as writer:
        for record in sorted(records):
            request = predict_pb2.PredictRequest()
            request.model_spec.name = "whatever"  # ignored: the version being loaded answers
            request.model_spec.signature_name = "serving_default"
            for name, array in records[record].items():
                request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
            log = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
            writer.write(log.SerializeToString())
        for _ in range(session_runs):
            log = prediction_log_pb2.PredictionLog(session_run_log=prediction_log_pb2.SessionRunLog())
            writer.write(log.SerializeToString())
    print(out)


if __name__ == "__main__":
    main()
