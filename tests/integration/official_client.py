"""Runs in its own process with only the official `tensorflow-serving-api` package on the path
(never beside our generated code: both register the same proto symbols).

usage: official_client.py TARGET MODEL INPUTS.npz OUTPUTS.npz
Sends every array in INPUTS.npz as input "x" of its own Predict call, all calls in flight at
once, and writes each response's outputs as "<key>/<output>". Prints the model's metadata as JSON.
"""

import json
import sys

import grpc
import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import get_model_metadata_pb2, predict_pb2, prediction_service_pb2_grpc


def main() -> None:
    target, model, inputs_path, outputs_path = sys.argv[1:5]
    channel = grpc.insecure_channel(target)
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)

    metadata_request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    metadata_request.model_spec.name = model
    metadata = stub.GetModelMetadata(metadata_request, timeout=60)
    signature_map = get_model_metadata_pb2.SignatureDefMap()
    metadata.metadata["signature_def"].Unpack(signature_map)
    described = {
        name: {
            kind: {k: [int(v.dtype), [int(d.size) for d in v.tensor_shape.dim]]
                   for k, v in getattr(sig, kind).items()}
            for kind in ("inputs", "outputs")
        } | {"method_name": sig.method_name}
        for name, sig in signature_map.signature_def.items()
    }

    data = np.load(inputs_path)
    calls = []
    for key in data.files:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = model
        request.inputs["x"].CopyFrom(tf.make_tensor_proto(data[key]))
        calls.append((key, stub.Predict.future(request, timeout=120)))
    results = {}
    versions = set()
    for key, call in calls:
        response = call.result()
        versions.add(response.model_spec.version.value)
        for name, tensor in response.outputs.items():
            results[f"{key}/{name}"] = tf.make_ndarray(tensor)
    np.savez(outputs_path, **results)
    print(json.dumps({"signatures": described, "model_spec_versions": sorted(versions),
                      "module": predict_pb2.__file__}))


if __name__ == "__main__":
    main()
