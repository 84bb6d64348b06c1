"""Runs in its own process with only the official `tensorflow-serving-api` package on the path
(never beside our generated code: both register the same proto symbols).

usage: official_zoo_client.py TARGET REQUESTS.npz ANSWERS.npz
REQUESTS.npz holds "MODE/MODEL/REQUEST/INPUT" arrays. The requests of mode "alone" are sent one
at a time, each after the answer before; those of mode "together" all at once. Each answer's
outputs are written as "MODE/MODEL/REQUEST/OUTPUT"; a failed call as "MODE/MODEL/REQUEST/error"
(its code and details).
"""

import sys
from collections import defaultdict

import grpc
import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc


def main() -> None:
    target, requests_path, answers_path = sys.argv[1:4]
    stub = prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(target))
    requests: dict[tuple[str, str, str], predict_pb2.PredictRequest] = defaultdict(predict_pb2.PredictRequest)
    with np.load(requests_path, allow_pickle=True) as data:  # string inputs are object arrays
        for key in data.files:
            mode, model, request_id, name = key.split("/")
            request = requests[(mode, model, request_id)]
            request.model_spec.name = model
            request.inputs[name].CopyFrom(tf.make_tensor_proto(data[key]))
    answers: dict[str, np.ndarray] = {}

    def record(key: tuple[str, str, str], call: "grpc.Future") -> None:
        prefix = "/".join(key)
        try:
            response = call.result()
        except grpc.RpcError as error:
            answers[f"{prefix}/error"] = np.array(f"{error.code().name}: {error.details()}")
            return
        for name, tensor in response.outputs.items():
            answers[f"{prefix}/{name}"] = tf.make_ndarray(tensor)

    for key, request in requests.items():
        if key[0] == "alone":
            record(key, stub.Predict.future(request, timeout=120))
    together = [(key, stub.Predict.future(request, timeout=120)) for key, request in requests.items()
                if key[0] == "together"]
    for key, call in together:
        record(key, call)
    np.savez(answers_path, **answers)


if __name__ == "__main__":
    main()
