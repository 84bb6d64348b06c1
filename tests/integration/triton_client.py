"""Runs in its own process with tritonclient on the path (its protos and ours cannot share one):
Triton's own gRPC client sends each array as its own ModelInfer, all at once.

usage: triton_client.py TARGET MODEL INPUT_NAME INPUTS.npz OUTPUTS.npz
Writes "<key>/<output>" for each output of each answer; prints the module that answered.
"""

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as triton


def main() -> None:
    target, model, input_name, inputs_path, outputs_path = sys.argv[1:6]
    client = triton.InferenceServerClient(target)
    outputs = [o["name"] for o in client.get_model_metadata(model, as_json=True)["outputs"]]
    answers: queue.Queue = queue.Queue()
    with np.load(inputs_path) as arrays:
        keys = list(arrays.files)
        for key in keys:
            tensor = triton.InferInput(input_name, list(arrays[key].shape), "FP32")
            tensor.set_data_from_numpy(arrays[key])
            client.async_infer(model, [tensor], lambda result, error, key=key: answers.put((key, result, error)),
                               client_timeout=120)
    results = {}
    for _ in keys:
        key, result, error = answers.get(timeout=180)
        if error is not None:
            raise SystemExit(f"{key}: {error}")
        for output in outputs:
            results[f"{key}/{output}"] = result.as_numpy(output)
    np.savez(outputs_path, **results)
    print(json.dumps({"module": triton.__file__}))


if __name__ == "__main__":
    main()
