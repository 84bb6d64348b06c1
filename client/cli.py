"""`python -m client predict`: call Predict once and print the outputs.

Inputs come from `.npy` files (`--input NAME=PATH`), or, for inputs not given, are made up at
random from the model's metadata (`--rows` rows; unknown non-batch dimensions become 1).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from client.api import DEFAULT_TIMEOUT_S, PredictClient, PredictError, Tls
from server.codec import numpy_dtype


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
    p.add_argument("--tls", action="store_true", help="use TLS (system roots unless --tls-ca-file)")
    p.add_argument("--tls-ca-file", default=None, help="PEM CA that signed the server's certificate (implies --tls)")
    p.add_argument("--tls-cert-file", default=None, help="PEM client certificate for mutual TLS (implies --tls)")
    p.add_argument("--tls-key-file", default=None, help="PEM key of --tls-cert-file")
    return parser


def tls_from_args(args: argparse.Namespace) -> Tls | None:
    if not (args.tls or args.tls_ca_file or args.tls_cert_file):
        return None
    return Tls(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)


def predict(args: argparse.Namespace) -> int:
    inputs = dict(args.input)
    with PredictClient(args.target, tls=tls_from_args(args)) as client:
        try:
            defs = client.signature_defs(args.model, version=args.version, timeout=args.timeout)
            sdef = defs.get(args.signature or "serving_default")
            if sdef is None:
                print(f"signature not found; available: {', '.join(sorted(defs))}", file=sys.stderr)
                return 2
            rng = np.random.default_rng(args.seed)
            for name, info in sorted(sdef.inputs.items()):
                if name not in inputs:
                    inputs[name] = random_input(info, args.rows, rng)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "predict":
        return predict(args)
    raise AssertionError(args.command)
