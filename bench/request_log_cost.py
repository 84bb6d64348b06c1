"""What request logging costs: one server of the bench's mlp, its config file switched between no
logging_config, sampling_rate 0.01 and sampling_rate 1.0 (the server re-reads it every second),
measured with the same closed-loop client at each concurrency; the three settings interleaved in
rotating order `--repeat` times, the median run counting. One process throughout, so the figures
differ by the setting alone, not by which of several processes got which cores or memory.

usage: python -m bench.request_log_cost [--concurrency 1,64] [--repeat 5] [--seconds 3]
Prints a markdown table (req/s, p50, p99, and against logging off) and writes it, with every
repeat, to build/bench/request-log.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.launch import ROOT, ServerProcess, start_server
from bench.results import Run
from bench.run import SHAPES, build_models, measure

RATES = {"off": None, "0.01": 0.01, "1.0": 1.0}


def config(folder: Path, base: Path, rate: float | None) -> Path:
    logging = "" if rate is None else (
        f'logging_config {{ log_collector_config {{ type: "file" filename_prefix: "{folder}/logs/mlp" }} '
        f'sampling_config {{ sampling_rate: {rate} }} }}')
    path = folder / "models.config"
    path.write_text(f'model_config_list {{ config {{ name: "mlp" base_path: "{base}" {logging} }} }}\n')
    return path


def switch(server: ServerProcess, path: Path, folder: Path, base: Path, rate: float | None) -> None:
    """Rewrite the config file, and wait until the server has applied it."""
    before = server.log().count("model config file")
    text = path.read_text()
    config(folder, base, rate)
    if path.read_text() == text:
        return
    deadline = time.monotonic() + 30
    while server.log().count("model config file") == before:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not apply the changed config file")
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.request_log_cost")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--out", default=str(ROOT / "build" / "bench"))
    opts = parser.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        base = build_models(["mlp"], out / "models")["mlp"]
        input_file = work / "mlp-input.npy"
        np.save(input_file, np.random.default_rng(0).standard_normal(SHAPES["mlp"][1]).astype(np.float32))
        folder = work / "server"
        (folder / "logs").mkdir(parents=True)
        path = config(folder, base, None)
        server = start_server(["--model-config-file", str(path), "--model-config-file-poll-wait-seconds", "1",
                               "--drain-delay-s", "0"], folder / "server.log")
        try:
            runs: dict[tuple[str, int], list[Run]] = {}
            labels = list(RATES)
            for repeat in range(opts.repeat):
                for concurrency in (int(c) for c in opts.concurrency.split(",")):
                    order = labels[repeat % len(labels):] + labels[:repeat % len(labels)]
                    for label in order:
                        switch(server, path, folder, base, RATES[label])
                        run = measure(f"127.0.0.1:{server.port},{server.rest_port}", "mlp", input_file, opts,
                                      ["--concurrency", str(concurrency)], server.process.pid)
                        runs.setdefault((label, concurrency), []).append(run)
                        print(f"{label} c={concurrency}: {run.req_per_s:.0f} req/s p50 {run.p50_ms:.2f} ms",
                              file=sys.stderr, flush=True)
            logged = server.metric("mirrorserve_request_log_records_total", model="mlp")
            dropped = server.metric("mirrorserve_request_log_dropped_total", model="mlp")
        finally:
            server.stop()
    table = ["| sampling_rate | callers | req/s | vs off | p50 ms | vs off | p99 ms |", "|---|---|---|---|---|---|---|"]
    result: dict[str, object] = {}
    for (label, concurrency), found in runs.items():
        median = sorted(found, key=lambda r: r.req_per_s)[len(found) // 2]
        off = sorted(runs[("off", concurrency)], key=lambda r: r.req_per_s)[len(found) // 2]
        p50 = statistics.median(r.p50_ms for r in found)
        off_p50 = statistics.median(r.p50_ms for r in runs[("off", concurrency)])
        table.append(f"| {label} | {concurrency} | {median.req_per_s:,.0f} "
                     f"| {median.req_per_s / off.req_per_s - 1:+.1%} | {p50:.2f} | {p50 / off_p50 - 1:+.1%} "
                     f"| {median.p99_ms:.2f} |")
        result[f"{label}/{concurrency}"] = {"median": median.to_json(), "p50_ms_median": p50,
                                            "repeats_req_per_s": [r.req_per_s for r in found]}
    result["records_logged"] = logged
    result["records_dropped"] = dropped
    (out / "request-log.json").write_text(json.dumps(result, indent=2))
    print("\n".join(table))
    print(f"records logged: {logged}; dropped: {dropped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
