"""Runs in its own process with only the official `tensorflow-serving-api` package on the path
(as official_client.py): one Predict of 2 rows of ones as input "x", sent with the W3C
`traceparent` given, read the way TF Serving's examples read it (`.float_val`). Prints, as JSON,
the outputs' float_val and the call's trailing metadata.

usage: official_traced_client.py TARGET MODEL TRACEPARENT
"""

import json
import sys

import grpc
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc


def main() -> None:
    target, model, traceparent = sys.argv[1:4]
    with grpc.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        request = predict_pb2.PredictRequest()
        request.model_spec.name = model
        request.inputs["x"].CopyFrom(tf.make_tensor_proto([[1.0] * 8] * 2, dtype=tf.float32))
        response, call = stub.Predict.with_call(request, timeout=60, metadata=(("traceparent", traceparent),))
    print(json.dumps({"outputs": {name: list(t.float_val) for name, t in response.outputs.items()},
                      "trailers": dict(call.trailing_metadata())}))


if __name__ == "__main__":
    main()
