"""`make bench`: every figure of the performance table, in one run, with one client.

For an overhead-bound model (mlp) and a compute-bound one (cnn), it measures
  (a) the in-process ceiling: the SavedModel called directly at batch 1, 16 and 64, before the
      servers start and again after they stop; the ratios use the higher of the two;
  (b) the wire ceiling: a grpc.aio server replaying one precomputed response (bench.fixed_server);
  (c) this server with batching off (--max-batch-size 1);
  (d) this server with its defaults, over TF Serving's Predict, over the Open Inference
      Protocol's ModelInfer, and over TF Serving's REST predict (same server, same turns: each
      one's CPU per request against Predict's);
each server under `python -m client bench` at 1, 4, 16 and 64 concurrent 1-row callers (4: where
waiting for more rows could cost more than it gains), and writes a
markdown table with the ratios (build/bench/results.md) and the raw figures (results.json).
With the throughput goes the CPU each request cost, read from /proc over the measured window:
the load generator's, each server process's, and its model worker's. On a machine that the
client shares with the servers, that is what decides the ratios.

A shared 2-core machine drifts by tens of percent from one minute to the next, so the three
servers run side by side for the whole model (an idle server costs the others nothing) and, at
each concurrency, are measured in turns (fixed, off, default, fixed, off, default, ...) `--repeat`
times: the figures a ratio compares are taken seconds apart, not minutes, and each figure is the
median of its repeats.

usage: python -m bench.suite [--seconds S] [--warmup-s S] [--concurrency 1,4,16,64] [--models mlp,cnn] [--repeat N]
       [--smoke]   (a few seconds in all: what `make test` runs; no figure is meaningful)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"mlp": ("x", (1, 256)), "cnn": ("image", (1, 96, 96, 3))}
SERVING = re.compile(r"serving model=.* grpc_port=(\d+) rest_api_port=(\d+)")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def run_json(args: list[str], timeout: float) -> Any:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Process:
    """A server subprocess, stopped with SIGTERM."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self.handle = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=ENV,
                                       stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def wait_for(self, find: Callable[[], object], timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = find()
            if found:
                return str(found)
            if self.handle.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.handle.args!r} did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.handle.send_signal(signal.SIGTERM)
        try:
            self.handle.wait(30)
        except subprocess.TimeoutExpired:
            self.handle.kill()


def start_ours(base: Path, flags: list[str], work: Path, label: str) -> tuple[Process, str]:
    """The server and its target: 127.0.0.1:GRPC_PORT,REST_PORT (measure() takes the one it needs)."""
    log = work / f"{label}.log"
    process = Process(["-m", "server", "--model-base-path", str(base), "--model-name", base.name,
                       "--port", "0", "--rest-api-port", "0", "--drain-delay-s", "0", *flags], log)

    def ports() -> str | None:
        match = SERVING.search(log.read_text(errors="replace"))
        return f"{match.group(1)},{match.group(2)}" if match else None

    return process, f"127.0.0.1:{process.wait_for(ports)}"


def start_fixed(response: Path, work: Path, label: str) -> tuple[Process, str]:
    port_file = work / f"{label}.port"
    port_file.unlink(missing_ok=True)  # a repeat must not read the last run's port
    process = Process(["-m", "bench.fixed_server", str(port_file), str(response)], work / f"{label}.log")
    port = process.wait_for(lambda: port_file.read_text() if port_file.exists() else None)
    return process, f"127.0.0.1:{port}"


def measure(target: str, model: str, input_file: Path, opts: argparse.Namespace, concurrency: int,
            server_pid: int | None = None, protocol: str = "tfserving") -> dict[str, Any]:
    name = SHAPES[model][0]
    cpu_of = [] if server_pid is None else ["--cpu-of", str(server_pid)]
    host, _, ports = target.rpartition(":")
    grpc_port, _, rest_port = ports.partition(",")
    (run,) = run_json(
        ["-m", "client", "bench", "--target", f"{host}:{grpc_port}", "--rest-target", f"{host}:{rest_port}",
         "--model", model, "--no-metadata",
         "--input", f"{name}={input_file}", "--concurrency", str(concurrency), "--protocol", protocol,
         "--warmup-s", str(opts.warmup_s), "--seconds", str(opts.seconds), *cpu_of],
        timeout=600,
    )
    return dict(run)


def in_process_ceiling(model: str, base: Path, input_file: Path, response: Path, seconds: float) -> dict[str, float]:
    """rows/s of the SavedModel called directly, per batch size; also writes the fixed server's response."""
    found: dict[str, float] = run_json(["-m", "bench.inprocess", str(base), str(input_file), str(response),
                                        str(seconds), "1", "16", "64"], timeout=600)
    print(f"{model} in-process rows/s: {found}", file=sys.stderr, flush=True)
    return found


def median_run(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat whose req/s is the median (its latencies with it), with every repeat's req/s."""
    if any(r["codes"] != {"OK": r["requests"]} or not r["requests"] for r in repeats):
        raise RuntimeError(f"a benchmark run had failures or no answers: {repeats}")
    ordered = sorted(repeats, key=lambda r: r["req_per_s"])
    return {**ordered[len(ordered) // 2], "repeats_req_per_s": [r["req_per_s"] for r in repeats]}


def rate(run: dict[str, Any]) -> str:
    """req/s of the median run, with the range over the repeats."""
    repeats = run.get("repeats_req_per_s", [])
    spread = f" ({min(repeats):,.0f}-{max(repeats):,.0f})" if len(repeats) > 1 else ""
    return f"{run['req_per_s']:,.0f}{spread}"


def start_servers(base: Path, response: Path, work: Path, model: str,
                  default_flags: list[str]) -> dict[str, tuple[Process, str]]:
    """The three servers under comparison, started together: fixed-response, batching off, defaults."""
    servers: dict[str, tuple[Process, str]] = {}
    try:
        servers["fixed"] = start_fixed(response, work, f"{model}-fixed")
        servers["off"] = start_ours(base, ["--max-batch-size", "1"], work, f"{model}-off")
        servers["default"] = start_ours(base, default_flags, work, f"{model}-default")
    except BaseException:
        for process, _ in servers.values():
            process.stop()
        raise
    return servers


def cpu(run: dict[str, Any], key: str) -> str:
    value = run.get(key)
    return "-" if value is None else f"{value:,.0f}"


def server_cpu(run: dict[str, Any]) -> str:
    """The server process's CPU per request, and in brackets the cores that came to."""
    value = run.get("server_cpu_us")
    return "-" if value is None else f"{value:,.0f} ({value * run['requests'] / run['seconds'] / 1e6:.2f})"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


def report(results: dict[str, Any], opts: argparse.Namespace) -> str:
    lines = [f"# Benchmark ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
             f"{opts.seconds:g} s per point after {opts.warmup_s:g} s warm-up, median of {opts.repeat} runs "
             "taken in turns with the three servers side by side, one closed-loop client sending 1-row "
             "requests on the same machine)", ""]
    for model, r in results.items():
        ceiling = r["inprocess"]
        before, after = r["inprocess_runs"]
        lines += [f"## {model}", "",
                  "In-process ceiling (SavedModel called directly; before the servers / after them; the "
                  "ratios use the higher): "
                  + ", ".join(f"batch {b}: {before[b]:,.0f} / {after[b]:,.0f} rows/s" for b in ceiling), "",
                  "| clients | fixed-response gRPC req/s | batching off req/s | default req/s | default / fixed "
                  "| default / off | default / in-process@64 | p50 ms off | p50 ms default | p99 ms default |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        best_ceiling = ceiling.get("64") or max(ceiling.values())
        for fixed, off, default in zip(r["fixed"], r["off"], r["default"], strict=True):
            lines.append(
                f"| {default['concurrency']} | {rate(fixed)} | {rate(off)} "
                f"| {rate(default)} | {ratio(default['req_per_s'], fixed['req_per_s'])} "
                f"| {ratio(default['req_per_s'], off['req_per_s'])} "
                f"| {ratio(default['rows_per_s'], best_ceiling)} | {off['p50_ms']:.2f} | {default['p50_ms']:.2f} "
                f"| {default['p99_ms']:.2f} |")
        lines += ["", "CPU per request in µs over the measured window of the median run; in brackets, the cores "
                  "the server process itself used (its Python threads share one GIL, so about 1 means saturated):",
                  "", "| clients | fixed-response: load generator | fixed-response: server "
                  "| batching off: load generator | batching off: server | batching off: model worker "
                  "| default: load generator | default: server | default: model worker |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for fixed, off, default in zip(r["fixed"], r["off"], r["default"], strict=True):
            lines.append(f"| {default['concurrency']} | {cpu(fixed, 'client_cpu_us')} | {server_cpu(fixed)} "
                         f"| {cpu(off, 'client_cpu_us')} | {server_cpu(off)} | {cpu(off, 'server_children_cpu_us')} "
                         f"| {cpu(default, 'client_cpu_us')} | {server_cpu(default)} "
                         f"| {cpu(default, 'server_children_cpu_us')} |")
        lines += ["", "Open Inference Protocol (v2 ModelInfer, raw contents) against TF Serving's Predict, the same "
                  "default server measured in the same turns; CPU per request of the server and its model worker "
                  "together (the goal: v2 / Predict <= 1.10):", "",
                  "| clients | Predict req/s | v2 req/s | Predict server CPU µs | v2 server CPU µs "
                  "| v2 / Predict CPU |",
                  "|---|---|---|---|---|---|"]
        for default, v2 in zip(r["default"], r["v2"], strict=True):
            tfs_cpu, v2_cpu = all_server_cpu(default), all_server_cpu(v2)
            lines.append(f"| {default['concurrency']} | {rate(default)} | {rate(v2)} | {tfs_cpu:,.0f} "
                         f"| {v2_cpu:,.0f} | {ratio(v2_cpu, tfs_cpu)} |")
        lines += ["", "TF Serving's REST predict (JSON, row format, aiohttp client) against its gRPC Predict, the "
                  "same default server in the same turns; server CPU per request as above, and the load "
                  "generator's own:", "",
                  "| clients | Predict req/s | REST req/s | REST / Predict req/s | Predict p50 ms | REST p50 ms "
                  "| Predict server CPU µs | REST server CPU µs | REST / Predict CPU | REST load generator CPU µs |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for default, rest in zip(r["default"], r["rest"], strict=True):
            tfs_cpu, rest_cpu = all_server_cpu(default), all_server_cpu(rest)
            lines.append(f"| {default['concurrency']} | {rate(default)} | {rate(rest)} "
                         f"| {ratio(rest['req_per_s'], default['req_per_s'])} | {default['p50_ms']:.2f} "
                         f"| {rest['p50_ms']:.2f} | {tfs_cpu:,.0f} | {rest_cpu:,.0f} | {ratio(rest_cpu, tfs_cpu)} "
                         f"| {cpu(rest, 'client_cpu_us')} |")
        lines.append("")
    return "\n".join(lines)


def all_server_cpu(run: dict[str, Any]) -> float:
    """CPU per request of the server process and its children (the model worker), in µs."""
    return float((run.get("server_cpu_us") or 0.0) + (run.get("server_children_cpu_us") or 0.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs per point; the median counts")
    parser.add_argument("--out", default=str(ROOT / "build" / "bench"))
    parser.add_argument("--smoke", action="store_true", help="seconds in all; for `make test`")
    parser.add_argument("--server-flags", default="", help="extra flags for the default-settings server")
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.seconds, opts.warmup_s, opts.concurrency, opts.models, opts.repeat = 0.5, 0.3, "1,4", "mlp", 1
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in opts.models.split(","):
            base = Path(run_json(["-c", "import json, sys; from pathlib import Path; from bench.models import build; "
                                  f"print(json.dumps(str(build({model!r}, Path(sys.argv[1])))))",
                                  str(out / "models")], timeout=600))
            shape = SHAPES[model][1]
            input_file = work / f"{model}-input.npy"
            np.save(input_file, np.random.default_rng(0).standard_normal(shape).astype(np.float32))
            response = work / f"{model}-response.pb"
            ceiling_s = max(opts.seconds / 2, 0.3)  # per batch size
            before = in_process_ceiling(model, base, input_file, response, ceiling_s)
            levels = [int(c) for c in opts.concurrency.split(",")]
            servers = start_servers(base, response, work, model, opts.server_flags.split())
            # The default server is measured twice in each turn: TF Serving's Predict, then v2's ModelInfer.
            # The default server is measured over REST too: TF Serving's REST predict, JSON row format.
            turns = [(label, label, "tfserving") for label in servers] + [("v2", "default", "v2"),
                                                                          ("rest", "default", "rest")]
            runs: dict[str, list[list[dict[str, Any]]]] = {label: [[] for _ in levels] for label, _, _ in turns}
            try:
                for i, level in enumerate(levels):
                    for _ in range(opts.repeat):
                        for label, server, protocol in turns:
                            process, target = servers[server]
                            run = measure(target, model, input_file, opts, level, process.handle.pid, protocol)
                            runs[label][i].append(run)
                            print(f"{model} {label}: C={level} {run['req_per_s']:,.0f} req/s "
                                  f"p50 {run['p50_ms']:.2f} ms", file=sys.stderr, flush=True)
            finally:
                for process, _ in servers.values():
                    process.stop()
            # the machine's speed drifts: the ratios use the higher ceiling
            after = in_process_ceiling(model, base, input_file, response, ceiling_s)
            results[model] = {"inprocess": {b: max(before[b], after[b]) for b in before},
                              "inprocess_runs": [before, after],
                              **{label: [median_run(r) for r in label_runs] for label, label_runs in runs.items()}}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    markdown = report(results, opts)
    (out / "results.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
