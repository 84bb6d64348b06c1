"""`make bench`: every figure of the performance table and its goals, in one run, with one client.

For each model of bench.models (mlp, overhead-bound; dense, attention, convnet and cnn, costing more
and more per row), it measures
  (a) the in-process ceiling: the SavedModel called directly at batch 1, 16 and 64, and the median
      wall time of one 1-row call, before the servers start and again after they stop; the ratios
      use the better of the two;
  (b) the wire ceiling: a grpc.aio server replaying one precomputed response (bench.fixed_server);
  (c) this server with batching off (--max-batch-size 1);
  (d) this server with its defaults;
  (e) the reference: the minimal 64-row / 2 ms asyncio batcher a user could write
      (bench.reference_batcher);
each under `python -m client bench` at 1, 16 and 64 concurrent 1-row callers (closed loop; 1 and
64 are where the goals are judged; add 4 with --concurrency to see where waiting for more rows
could cost more than it gains), 3 s a point after 1 s of warm-up. On --protocol-models (mlp), the
default server is also measured over the Open Inference Protocol's ModelInfer and TF Serving's
REST predict, in the same turns, each against its Predict.

Then, per model, an open-loop sweep: Poisson arrivals at 25, 50, 75 and 90% of the model's
capacity (the default server's median req/s at 64 clients in this run), latency counted from each
request's scheduled start, for batching off, the defaults and the reference.

With the throughput goes the CPU each request cost, read from /proc over the measured window:
the load generator's, each server process's, and its model worker's. On a machine that the
client shares with the servers, that is what decides the ratios.

A shared 2-core machine drifts by tens of percent from one minute to the next, so a model's
servers run side by side for the whole model (an idle server costs the others nothing) and, at
each load, are measured in turns (fixed, off, default, reference, fixed, ...) `--repeat` times:
the figures a ratio compares are taken seconds apart, not minutes. A closed-loop figure is the
median of its repeats; a sweep point keeps every round, to judge the noise.

It writes build/bench/results.md, opening with the goals (each PASS or FAIL from this run's
figures), and build/bench/results.json (the raw figures, the goals under "goals").

The work is split three ways: bench.run measures (servers started through bench.launch, the
launcher the tests use too) into typed results (bench.results), bench.judge judges the goals, and
bench.report writes the tables; this module only parses the command line and ties them together.

usage: python -m bench.suite [--seconds S (3)] [--warmup-s S (1)] [--concurrency 1,16,64]
       [--models mlp,cnn,dense,attention,convnet] [--protocol-models mlp] [--sweep 0.25,0.5,0.75,0.9]
       [--repeat N] [--server-flags FLAGS] [--out DIR]
       [--smoke]   (about a minute: what `make test` runs; every code path, no figure is meaningful)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench.judge import GOAL_LEVEL, goals
from bench.launch import ROOT
from bench.report import report
from bench.results import ModelResults
from bench.run import run_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured window per point")
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--concurrency", default="1,16,64", help="closed-loop client counts")
    parser.add_argument("--models", default=",".join(["mlp", "cnn", "dense", "attention", "convnet"]))
    parser.add_argument("--protocol-models", default="mlp",
                        help="models on which v2 and REST are measured too (comma-separated; empty: none)")
    parser.add_argument("--sweep", default="0.25,0.5,0.75,0.9",
                        help="open-loop rates as fractions of the capacity (comma-separated; empty: no sweep)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs per point; the median counts")
    parser.add_argument("--out", default=str(ROOT / "build" / "bench"))
    parser.add_argument("--smoke", action="store_true", help="about a minute, every code path; for `make test`")
    parser.add_argument("--server-flags", default="", help="extra flags for the default-settings server")
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.seconds, opts.warmup_s, opts.concurrency, opts.repeat = 0.4, 0.2, f"1,{GOAL_LEVEL}", 1
        opts.models, opts.protocol_models, opts.sweep = "mlp", "mlp", "0.5"
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, ModelResults] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in opts.models.split(","):
            results[model] = run_model(model, opts, out, Path(tmp))
    found = goals(results)
    (out / "results.json").write_text(json.dumps(
        {**{model: r.to_json() for model, r in results.items()}, "goals": {g.key: asdict(g) for g in found}},
        indent=1))
    markdown = report(results, found, opts)
    (out / "results.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
