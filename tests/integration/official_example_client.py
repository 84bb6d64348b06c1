"""Runs in its own process with only the official `tensorflow-serving-api` package on the path
(never beside our generated code: both register the same proto symbols).

usage: official_example_client.py TARGET CALLS.json RESULTS.json
CALLS.json is a list of calls, all sent at once:
  {"method": "Classify" | "Regress" | "MultiInference", "model": NAME, "signature": NAME,
   "examples": [hex of a serialized tf.Example, ...], "context": hex or null,
   "tasks": [[signature, method_name], ...] (MultiInference)}
RESULTS.json gets one entry per call: {"classes": [[[label, score], ...], ...]} (Classify),
{"values": [...]} (Regress), {"results": [entry, ...]} (MultiInference), each with "model_spec",
or {"code": STATUS, "details": text}. Prints the module that answered.
"""

import json
import sys

import grpc
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    inference_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)


def fill_input(message, call):
    examples = [example_pb2.Example.FromString(bytes.fromhex(e)) for e in call["examples"]]
    if call.get("context") is None:
        message.input.example_list.examples.extend(examples)
    else:
        message.input.example_list_with_context.examples.extend(examples)
        message.input.example_list_with_context.context.CopyFrom(
            example_pb2.Example.FromString(bytes.fromhex(call["context"])))


def spec(model_spec):
    return {"name": model_spec.name, "version": model_spec.version.value, "signature": model_spec.signature_name}


def classes(result):
    return [[[c.label, c.score] for c in each.classes] for each in result.classifications]


def send(stub, call):
    if call["method"] == "MultiInference":
        request = inference_pb2.MultiInferenceRequest()
        for signature, method in call["tasks"]:
            task = request.tasks.add(method_name=method)
            task.model_spec.name = call["model"]
            task.model_spec.signature_name = signature
        fill_input(request, call)
        return stub.MultiInference.future(request, timeout=120)
    message = classification_pb2.ClassificationRequest() if call["method"] == "Classify" \
        else regression_pb2.RegressionRequest()
    message.model_spec.name = call["model"]
    message.model_spec.signature_name = call.get("signature", "")
    fill_input(message, call)
    return getattr(stub, call["method"]).future(message, timeout=120)


def answer(call, future):
    try:
        response = future.result()
    except grpc.RpcError as error:
        return {"code": error.code().name, "details": error.details()}
    if call["method"] == "Classify":
        return {"classes": classes(response.result), "model_spec": spec(response.model_spec)}
    if call["method"] == "Regress":
        return {"values": [r.value for r in response.result.regressions], "model_spec": spec(response.model_spec)}
    results = []
    for result in response.results:
        kind = result.WhichOneof("result")
        entry = {"model_spec": spec(result.model_spec)}
        if kind == "classification_result":
            entry["classes"] = classes(result.classification_result)
        else:
            entry["values"] = [r.value for r in result.regression_result.regressions]
        results.append(entry)
    return {"results": results}


def main():
    target, calls_path, results_path = sys.argv[1:4]
    with open(calls_path) as f:
        calls = json.load(f)
    stub = prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(target))
    futures = [send(stub, call) for call in calls]
    with open(results_path, "w") as f:
        json.dump([answer(call, future) for call, future in zip(calls, futures, strict=True)], f)
    print(json.dumps({"module": classification_pb2.__file__}))


if __name__ == "__main__":
    main()
