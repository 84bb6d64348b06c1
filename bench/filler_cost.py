"""What a batch with fewer rows than replicas costs, three ways: a 1-row batch run by
SignatureRunner on 1, 2 and 4 replicas,
- idle: on one replica, the others handed nothing the model sees (what the server does);
- filler: every replica runs a row, the idle ones a copy of the real row, whose answers are
  dropped (the way not taken);
- empty: the idle replicas run zero-row shards (what the server did before, which some CPUs'
  convolution kernels refuse).
No server: the runner alone, so the differences are the three ways' and nothing else's.

usage: python -m bench.filler_cost [--calls N] [--models mlp,cnn] [--out DIR]
Prints one table. Each replica count runs in a process of its own (logical devices are fixed
before TensorFlow starts); in it the three ways take turns call by call, so drift hits all alike.
A way the model refuses on this CPU is reported as refused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.launch import ROOT
from bench.run import build_models, run_json

REPLICAS = (1, 2, 4)
WAYS = ("idle", "filler", "empty")


def child(replicas: int, bases: dict[str, str], calls: int) -> dict[str, Any]:
    """In a fresh process: per model and way, the 1-row batch's times in ms."""
    import numpy as np

    from server.worker import replicas as replica_path
    from server.worker import saved_model

    strategy = replica_path.make_strategy(replica_path.configure_devices(replicas))
    found: dict[str, Any] = {}
    for name, base in bases.items():
        loaded = saved_model.load(Path(base) / "1", name, 1, strategy)
        signature = loaded.info.signatures["serving_default"]
        runner = replica_path.SignatureRunner(strategy, loaded.functions["serving_default"], signature)
        runner.warm_up([1, 2, 4])
        row = {k: np.random.default_rng(0).standard_normal(a.shape).astype(a.dtype)
               for k, a in signature.example(1).items()}
        chunks = {"idle": [row], "filler": [row] * replicas,
                  "empty": [row, *[{k: a[:0] for k, a in row.items()}] * (replicas - 1)]}
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        refused: dict[str, str] = {}
        for i in range(calls * len(WAYS)):
            way = WAYS[i % len(WAYS)]
            if way in refused:
                continue
            started = time.perf_counter()
            try:
                runner.run_chunks(chunks[way])
            except Exception as exc:  # an empty shard, refused on this CPU
                refused[way] = str(exc).splitlines()[0][:120]
                continue
            times[way].append((time.perf_counter() - started) * 1e3)
        found[name] = {way: ({"refused": refused[way]} if way in refused else
                             {"p50_ms": statistics.median(t), "p90_ms": float(np.percentile(t, 90))})
                       for way, t in times.items()}
    return found


def cell(way: dict[str, Any]) -> str:
    return f"refused ({way['refused']})" if "refused" in way else f"{way['p50_ms']:.3f} / {way['p90_ms']:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="1-row batches per way, model and replica count")
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
    print("| model | replicas | 1-row batch p50 / p90 ms: idle (served) | filler | empty (before) "
          "| idle / empty (p50) | filler / empty (p50) |\n|---|---|---|---|---|---|---|")
    for name in bases:
        for replicas, found in results.items():
            ways = found[name]
            ratios = [f"{ways[way]['p50_ms'] / ways['empty']['p50_ms']:.2f}"
                      if "p50_ms" in ways[way] and "p50_ms" in ways["empty"] else "-" for way in ("idle", "filler")]
            print(f"| {name} | {replicas} | {' | '.join(cell(ways[way]) for way in WAYS)} | {' | '.join(ratios)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
