"""Another client, in a process of its own (so an attack run from the test process cannot slow it
through the GIL): TF Serving Predict calls of one row, one after another, each written as a line
`monotonic_start latency_seconds code` until it is told to stop (stdin closes).

python -m tests.security.bystander TARGET MODEL INPUT ROWS_SHAPE...
"""

from __future__ import annotations

import sys
import threading
import time

import grpc
import numpy as np

from client.api import build_predict_request
from protos.tensorflow_serving import prediction_service_pb2_grpc


def main() -> None:
    target, model, name, *dims = sys.argv[1:]
    request = build_predict_request(model, {name: np.ones([1, *map(int, dims)], np.float32)})
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    with grpc.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        stub.Predict(request, timeout=10)
        print("ready", flush=True)
        while not stop.is_set():
            started = time.monotonic()
            try:
                stub.Predict(request, timeout=5)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            print(f"{started:.6f} {time.monotonic() - started:.6f} {code}", flush=True)
            time.sleep(0.002)


if __name__ == "__main__":
    main()
