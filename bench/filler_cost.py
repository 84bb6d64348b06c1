"""What a replica's filler row costs: a 1-row batch run by SignatureRunner on 1, 2 and 4 replicas,
each replica left without rows given a copy of the batch's first row (what the server does), or
an empty shard (what it did before, which some CPUs' convolution kernels refuse). No server: the
runner alone, so the difference is the filler's and nothing else's.

usage: python -m bench.filler_cost [--calls N] [--models mlp,cnn] [--out DIR]
Prints one table. Each replica count runs in a process of its own (logical devices are fixed
before TensorFlow starts); in it the two ways alternate call by call, so drift hits both alike.
An empty shard that the model refuses on this CPU is reported as refused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.launch import ROOT
from bench.run import build_models, run_json

REPLICAS = (1, 2, 4)


def child(replicas: int, bases: dict[str, str], calls: int) -> dict[str, Any]:
    """In a fresh process: per model, the 1-row times (ms) with filler rows and with empty shards."""
    import numpy as np

    from server.core import assembly
    from server.worker import replicas as replica_path
    from server.worker import saved_model

    strategy = replica_path.make_strategy(replica_path.configure_devices(replicas))

    def empty_shards(batch: Mapping[str, np.ndarray], count: int) -> tuple[list[assembly.Tensors], list[int]]:
        bounds = assembly.replica_bounds(next(iter(batch.values())).shape[0], count)
        return [{k: a[lo:hi] for k, a in batch.items()} for lo, hi in bounds], [hi - lo for lo, hi in bounds]

    found: dict[str, Any] = {}
    for name, base in bases.items():
        loaded = saved_model.load(Path(base) / "1", name, 1, strategy)
        signature = loaded.info.signatures["serving_default"]
        runner = replica_path.SignatureRunner(strategy, loaded.functions["serving_default"], signature)
        runner.warm_up([1, 2, 4])
        row = {k: np.random.default_rng(0).standard_normal(a.shape).astype(a.dtype)
               for k, a in signature.example(1).items()}
        ways = {"filler": assembly.replica_chunks, "empty": empty_shards}
        times: dict[str, list[float]] = {way: [] for way in ways}
        refused: dict[str, str] = {}
        for i in range(calls * len(ways)):
            way = list(ways)[i % len(ways)]
            if way in refused:
                continue
            replica_path.replica_chunks = ways[way]  # type: ignore[attr-defined,assignment]  # what SignatureRunner.run splits with
            started = time.perf_counter()
            try:
                runner.run(row)
            except Exception as exc:  # the empty shard refused on this CPU
                refused[way] = str(exc).splitlines()[0][:120]
                continue
            times[way].append((time.perf_counter() - started) * 1e3)
        found[name] = {way: ({"refused": refused[way]} if way in refused else
                             {"p50_ms": statistics.median(t), "p90_ms": float(np.percentile(t, 90))})
                       for way, t in times.items()}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="1-row calls per way, model and replica count")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "filler-cost")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--bases", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, json.loads(args.bases), args.calls)))
        return 0
    bases = build_models(args.models.split(","), args.out / "models", {"CUDA_VISIBLE_DEVICES": ""})
    paths = json.dumps({name: str(path) for name, path in bases.items()})
    results = {replicas: run_json(["-m", "bench.filler_cost", "--child", str(replicas), "--bases", paths,
                                   "--calls", str(args.calls)], 1200, {"CUDA_VISIBLE_DEVICES": ""})
               for replicas in REPLICAS}
    print("| model | replicas | 1 row, filler rows: p50 / p90 ms | 1 row, empty shards: p50 / p90 ms "
          "| filler / empty (p50) |\n|---|---|---|---|---|")
    for name in bases:
        for replicas, found in results.items():
            filler, empty = found[name]["filler"], found[name]["empty"]
            ratio = f"{filler['p50_ms'] / empty['p50_ms']:.2f}" if "p50_ms" in filler and "p50_ms" in empty else "-"
            print(f"| {name} | {replicas} | {cell(filler)} | {cell(empty)} | {ratio} |")
    return 0


def cell(way: dict[str, Any]) -> str:
    return f"refused ({way['refused']})" if "refused" in way else f"{way['p50_ms']:.3f} / {way['p90_ms']:.3f}"


if __name__ == "__main__":
    sys.exit(main())
