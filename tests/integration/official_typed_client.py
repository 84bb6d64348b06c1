"""Reads Predict's answers the way TF Serving's own example client (mnist_client.py) and the
clients built on it do: from each output's typed field (`.float_val`, `.int64_val`, ...), never
make_ndarray. Runs in its own process with only the official `tensorflow-serving-api` on the path.

usage: official_typed_client.py TARGET MODEL INPUT.npy
Prints one JSON object: for each output, its dtype, shape, the values of each typed field that
holds any (half_val as the uint16 bits it carries), and the bytes of tensor_content.
"""

import json
import sys

import grpc
import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

FIELDS = ("float_val", "half_val", "double_val", "int_val", "int64_val", "bool_val", "string_val", "scomplex_val")


def main() -> None:
    target, model, input_path = sys.argv[1:4]
    stub = prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(target))
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.load(input_path)))
    result = stub.Predict(request, timeout=60)
    report = {}
    for name, tensor in result.outputs.items():
        fields = {field: [v.decode() if isinstance(v, bytes) else v for v in getattr(tensor, field)]
                  for field in FIELDS if len(getattr(tensor, field))}
        report[name] = {"dtype": tf.dtypes.as_dtype(tensor.dtype).name, "fields": fields,
                        "shape": [d.size for d in tensor.tensor_shape.dim],
                        "tensor_content_bytes": len(tensor.tensor_content)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
