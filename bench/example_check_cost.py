"""What reading and checking Classify's examples costs: the same classify signature, the same
serialized tf.Examples, called as Classify (each example parsed and checked against the features
the model reads, results encoded as classes) and as Predict with the examples as its DT_STRING
"inputs" tensor (passed through unchecked). One server throughout, the two calls interleaved
`--repeat` times, the median run counting, at each concurrency.

usage: python -m bench.example_check_cost [--examples 32] [--concurrency 1,16] [--repeat 3] [--seconds 3]
Prints a markdown table: req/s, examples/s and p50 of each call, and Classify against Predict.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

from bench.launch import start_server
from client.bench import BenchResult, closed_loop, grpc_connection
from protos.tensorflow_serving import predict_pb2, serialized_input_pb2

SERVICE = "/tensorflow.serving.PredictionService/"


def payloads(examples: list[bytes]) -> dict[str, tuple[str, bytes]]:
    classify = serialized_input_pb2.SerializedExamplesRequest()
    classify.model_spec.name = "classifier"
    classify.input.example_list.examples.extend(examples)
    predict = predict_pb2.PredictRequest()
    predict.model_spec.name = "classifier"
    tensor = predict.inputs["inputs"]
    tensor.dtype = 7  # DT_STRING
    tensor.tensor_shape.dim.add(size=len(examples))
    tensor.string_val.extend(examples)
    return {"Classify": (SERVICE + "Classify", classify.SerializeToString()),
            "Predict": (SERVICE + "Predict", predict.SerializeToString())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    from tests.integration.example_models import build_classifier, example  # TensorFlow, for the model only

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_classifier(folder / "classifier" / "1")
        examples = [example([0.1 * i, -0.2 * i], i, [f"t{i % 3}"] * (i % 4)).SerializeToString()
                    for i in range(args.examples)]
        calls = payloads(examples)
        server = start_server(["--model-base-path", str(folder / "classifier"), "--model-name", "classifier",
                               "--drain-delay-s", "0"], folder / "server.log")
        try:
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                runs: dict[str, list[BenchResult]] = {name: [] for name in calls}
                for _ in range(args.repeat):
                    for name, (path, payload) in calls.items():
                        runs[name].append(asyncio.run(closed_loop(grpc_connection(server.target, payload, path),
                                                                  concurrency, 1.0, args.seconds, len(examples))))
                median = {name: sorted(found, key=lambda r: r.req_per_s)[len(found) // 2]
                          for name, found in runs.items()}
                for name, result in median.items():
                    assert set(result.codes) == {"OK"}, result.codes
                    spread = statistics.pstdev(r.req_per_s for r in runs[name])
                    against = result.req_per_s / median["Predict"].req_per_s
                    rows.append(f"| {name} | {concurrency} | {result.req_per_s:,.0f} ± {spread:,.0f} | "
                                f"{result.rows_per_s:,.0f} | {result.p50_ms:.2f} | {against:.2f} |")
        finally:
            server.stop()
    print(f"{args.examples} examples a call, of up to 3 features (x, age, tags: all read by the model), "
          f"median of {args.repeat}:\n")
    print("| call | callers | req/s | examples/s | p50 ms | against Predict |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
