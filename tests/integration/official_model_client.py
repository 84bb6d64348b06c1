"""Runs in its own process with only the official `tensorflow-serving-api` package on the path
(never beside our generated code: both register the same proto symbols).

usage: official_model_client.py TARGET MODEL VERSION LABEL
Calls ModelService.GetModelStatus for MODEL, then Predict with no version, with VERSION and with
LABEL, and prints what came back as JSON.
"""

import json
import sys

import grpc
import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import (
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)


def main() -> None:
    target, model, version, label = sys.argv[1:5]
    channel = grpc.insecure_channel(target)
    status_request = get_model_status_pb2.GetModelStatusRequest()
    status_request.model_spec.name = model
    status = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(status_request, timeout=60)
    states = {
        str(s.version): [get_model_status_pb2.ModelVersionStatus.State.Name(s.state), s.status.error_code]
        for s in status.model_version_status
    }
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    answers = {}
    for how in ("default", "version", "label"):
        request = predict_pb2.PredictRequest()
        request.model_spec.name = model
        if how == "version":
            request.model_spec.version.value = int(version)
        elif how == "label":
            request.model_spec.version_label = label
        request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((2, 2), np.float32)))
        response = stub.Predict(request, timeout=60)
        answers[how] = [response.model_spec.version.value, int(tf.make_ndarray(response.outputs["version"])[0])]
    print(json.dumps({"states": states, "answers": answers, "module": predict_pb2.__file__}))


if __name__ == "__main__":
    main()
