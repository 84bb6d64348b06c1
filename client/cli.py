"""`python -m client predict`: call Predict once and print the outputs.
`python -m client bench`: measure a server under closed-loop or open-loop load, over gRPC (TF
Serving's Predict or the v2 ModelInfer) or REST.
`python -m client warmup-from-log`: a warmup file from request logs (client/warmup_log.py).

Inputs come from `.npy` files (`--input NAME=PATH`), or, for inputs not given, are made up at
random from the model's metadata (`--rows` rows; unknown non-batch dimensions become 1).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from client import bench, rest, warmup_log
from client.api import DEFAULT_TIMEOUT_S, PredictClient, PredictError, Tls, build_predict_request
from server.api.tensor_codec import numpy_dtype


def random_input(info: Any, rows: int, rng: np.random.Generator) -> np.ndarray:
    """A random array matching a TensorInfo (dtype and shape, -1 filled in)."""
    dtype = numpy_dtype(info.dtype)
    dims = [d.size for d in info.tensor_shape.dim]
    shape = tuple(rows if i == 0 else (1 if d < 0 else d) for i, d in enumerate(dims))
    if dtype.kind == "O":
        return np.full(shape, b"hello", dtype=object)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0, 10, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _parse_input(text: str) -> tuple[str, np.ndarray]:
    name, sep, path = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH.npy, got {text!r}")
    return name, np.load(path, allow_pickle=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("predict", help="call Predict once and print the outputs")
    p.add_argument("--target", default="localhost:8500", help="HOST:PORT (default localhost:8500)")
    p.add_argument("--model", required=True, help="model name")
    p.add_argument("--signature", default="", help="signature name (default serving_default)")
    p.add_argument("--version", type=int, default=None, help="model version (default: the served one)")
    p.add_argument("--input", type=_parse_input, action="append", default=[], metavar="NAME=PATH.npy",
                   help="an input from a .npy file; repeat per input; the rest are random")
    p.add_argument("--rows", type=int, default=1, help="rows of random inputs (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed for random inputs (default 0)")
    p.add_argument("--output-filter", action="append", default=[], metavar="NAME",
                   help="return only this output; repeatable")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="deadline in seconds")
    _add_tls_args(p)

    w = commands.add_parser("warmup-from-log", help="make a warmup file from request logs")
    w.add_argument("logs", nargs="+", type=Path, metavar="LOG", help="request log files (TFRecord)")
    w.add_argument("--out", type=Path, required=True,
                   help="the warmup file: VERSION_DIR/assets.extra/tf_serving_warmup_requests")
    w.add_argument("--model", default=None, help="keep only this model's requests (default: all)")
    w.add_argument("--max-records", type=int, default=warmup_log.MAX_RECORDS,
                   help=f"records to keep, in log order (default {warmup_log.MAX_RECORDS}, TF Serving's maximum)")

    b = commands.add_parser("bench", help="measure throughput and latency under load")
    b.add_argument("--target", default="localhost:8500", help="HOST:PORT (default localhost:8500)")
    b.add_argument("--model", required=True, help="model name")
    b.add_argument("--signature", default="", help="signature name (default serving_default)")
    b.add_argument("--input", type=_parse_input, action="append", default=[], metavar="NAME=PATH.npy",
                   help="an input from a .npy file; the rest are random, from the model's metadata")
    b.add_argument("--no-metadata", action="store_true",
                   help="send exactly the --input arrays; do not ask the server for the signature")
    b.add_argument("--rows", type=int, default=1, help="rows per request (default 1)")
    b.add_argument("--protocol", choices=("tfserving", "v2", "rest"), default="tfserving",
                   help="send TF Serving Predict requests (default), Open Inference Protocol ModelInfer ones, "
                        "or TF Serving REST predict calls (JSON, row format) to --rest-target")
    b.add_argument("--rest-target", default="localhost:8501",
                   help="HOST:PORT of the REST API, for --protocol rest (default localhost:8501)")
    b.add_argument("--concurrency", default="1,16,64",
                   help="closed loop: comma-separated caller counts (default 1,16,64)")
    b.add_argument("--rate", default="", help="open loop: comma-separated Poisson arrival rates in req/s")
    b.add_argument("--warmup-s", type=float, default=2.0, help="warm-up before each measurement (default 2)")
    b.add_argument("--seconds", type=float, default=10.0, help="measured window per load level (default 10)")
    b.add_argument("--timeout", type=float, default=30.0, help="per-request deadline in seconds")
    b.add_argument("--within-ms", type=float, default=None, metavar="MS",
                   help="also count the OK answers a second within MS, by the client's clock and by the "
                        "server's own time (goodput against a latency target)")
    b.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")
    b.add_argument("--cpu-of", type=int, action="append", default=[], metavar="PID",
                   help="also report the CPU this process and its children (a server and its model worker) "
                        "use per request in the measured window; repeatable; Linux (/proc)")
    return parser


def _add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls", action="store_true", help="use TLS (system roots unless --tls-ca-file)")
    p.add_argument("--tls-ca-file", default=None, help="PEM CA that signed the server's certificate (implies --tls)")
    p.add_argument("--tls-cert-file", default=None, help="PEM client certificate for mutual TLS (implies --tls)")
    p.add_argument("--tls-key-file", default=None, help="PEM key of --tls-cert-file")


def tls_from_args(args: argparse.Namespace) -> Tls | None:
    if not (args.tls or args.tls_ca_file or args.tls_cert_file):
        return None
    return Tls(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)


def complete_inputs(client: PredictClient, args: argparse.Namespace, seed: int) -> dict[str, np.ndarray] | None:
    """The inputs given as files, plus random ones for the rest, from the signature's metadata."""
    inputs = dict(args.input)
    defs = client.signature_defs(args.model, version=getattr(args, "version", None), timeout=args.timeout)
    sdef = defs.get(args.signature or "serving_default")
    if sdef is None:
        print(f"signature not found; available: {', '.join(sorted(defs))}", file=sys.stderr)
        return None
    rng = np.random.default_rng(seed)
    for name, info in sorted(sdef.inputs.items()):
        if name not in inputs:
            inputs[name] = random_input(info, args.rows, rng)
    return inputs


def predict(args: argparse.Namespace) -> int:
    with PredictClient(args.target, tls=tls_from_args(args)) as client:
        try:
            inputs = complete_inputs(client, args, args.seed)
            if inputs is None:
                return 2
            outputs = client.predict(
                args.model, inputs, signature=args.signature, version=args.version,
                output_filter=args.output_filter, timeout=args.timeout,
            )
        except PredictError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    for name, array in sorted(inputs.items()):
        print(f"input {name}: {array.dtype} {list(array.shape)}\n{array}")
    for name, array in sorted(outputs.items()):
        print(f"output {name}: {array.dtype} {list(array.shape)}\n{array}")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    results = bench_runs(args)
    if isinstance(results, int):
        return results
    print(bench.table(results))
    print(bench.to_json(results))
    if args.json:
        with open(args.json, "w") as f:
            f.write(bench.to_json(results))
    return 0


def bench_results(argv: Sequence[str]) -> list[dict[str, Any]]:
    """`python -m client bench ARGV` in this process, its results as the dicts its JSON line holds:
    a harness that runs many measurements pays this process's start-up (TensorFlow's protos) once."""
    args = build_parser().parse_args(["bench", *argv])
    results = bench_runs(args)
    if isinstance(results, int):
        raise RuntimeError(f"client bench {' '.join(argv)} failed (exit code {results})")
    return [dataclasses.asdict(r) for r in results]


def bench_runs(args: argparse.Namespace) -> list[bench.BenchResult] | int:
    """The measurements `client bench` asks for, or the exit code of a failure before them."""
    if args.no_metadata:
        inputs: dict[str, np.ndarray] | None = dict(args.input)
    else:
        with PredictClient(args.target) as client:
            try:
                inputs = complete_inputs(client, args, seed=0)
            except PredictError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
    if inputs is None:
        return 2
    if args.protocol == "v2":
        from client import v2

        payload = v2.build_infer_request(args.model, inputs, signature=args.signature).SerializeToString()
        connect = bench.grpc_connection(args.target, payload, v2.INFER_PATH, args.timeout)
    elif args.protocol == "rest":
        body = rest.build_predict_body(inputs, signature=args.signature)
        connect = bench.http_connection(rest.predict_url(args.rest_target, args.model), body, args.timeout)
    else:
        payload = build_predict_request(args.model, inputs, signature=args.signature).SerializeToString()
        connect = bench.grpc_connection(args.target, payload, bench.PREDICT_PATH, args.timeout)
    results = []
    for level in (int(c) for c in args.concurrency.split(",") if c.strip() and not args.rate):
        results.append(asyncio.run(bench.closed_loop(connect, level, args.warmup_s, args.seconds, args.rows,
                                                     args.cpu_of, args.within_ms)))
        print(bench.table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    for rate in (float(r) for r in args.rate.split(",") if r.strip()):
        results.append(asyncio.run(bench.open_loop(connect, rate, args.warmup_s, args.seconds, args.rows,
                                                   cpu_of=args.cpu_of, within_ms=args.within_ms)))
        print(bench.table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "predict":
        return predict(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "warmup-from-log":
        try:
            written, read = warmup_log.warmup_from_logs(args.logs, args.out, args.model, args.max_records)
        except (OSError, RuntimeError, ValueError, DecodeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {written} requests (of {read} records read) to {args.out}")
        return 0
    raise AssertionError(args.command)
