"""Runs in its own process with only the official `tensorflow-serving-api` package on the path
(never beside our generated code: both register the same proto symbols).

usage: official_zoo_client.py REQUESTS.npz ANSWERS.npz TARGET [TARGET ...]
REQUESTS.npz holds "MODE/MODEL/REQUEST/INPUT" arrays. Each target in turn is sent every request:
those of mode "alone" one at a time, each after the answer before; those of mode "together" all
at once. Each answer's outputs are written as "TARGET_INDEX/MODE/MODEL/REQUEST/OUTPUT"; a failed
call as ".../REQUEST/error" (its code and details).
"""

import sys
from collections import defaultdict

import grpc
import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc


def main() -> None:
    requests_path, answers_path, *targets = sys.argv[1:]
    requests: dict[tuple[str, str, str], predict_pb2.PredictRequest] = defaultdict(predict_pb2.PredictRequest)
    with np.load(requests_path, allow_pickle=True) as data:  # string inputs are object arrays
        for key in data.files:
            mode, model, request_id, name = key.split("/")
            request = requests[(mode, model, request_id)]
            request.model_spec.name = model
            request.inputs[name].CopyFrom(tf.make_tensor_proto(data[key]))
    answers: dict[str, np.ndarray] = {}
    for index, target in enumerate(targets):
        stub = prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(target))
        for key, request in requests.items():
            if key[0] == "alone":
                record(answers, "/".join((str(index), *key)), stub.Predict.future(request, timeout=120))
        together = [("/".join((str(index), *key)), stub.Predict.future(request, timeout=120))
                    for key, request in requests.items() if key[0] == "together"]
        for prefix, call in together:
            record(answers, prefix, call)
    np.savez(answers_path, **answers)


def record(answers: dict[str, np.ndarray], prefix: str, call: "grpc.Future") -> None:
    """A call's outputs as PREFIX/OUTPUT, or its failure as PREFIX/error."""
    try:
        response = call.result()
    except grpc.RpcError as error:
        answers[f"{prefix}/error"] = np.array(f"{error.code().name}: {error.details()}")
        return
    for name, tensor in response.outputs.items():
        answers[f"{prefix}/{name}"] = tf.make_ndarray(tensor)


if __name__ == "__main__":
    main()
