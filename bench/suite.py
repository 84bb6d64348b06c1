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

usage: python -m bench.suite [--seconds S (3)] [--warmup-s S (1)] [--concurrency 1,16,64]
       [--models mlp,cnn,dense,attention,convnet] [--protocol-models mlp] [--sweep 0.25,0.5,0.75,0.9]
       [--repeat N] [--server-flags FLAGS] [--out DIR]
       [--smoke]   (about a minute: what `make test` runs; every code path, no figure is meaningful)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"mlp": ("x", (1, 256)), "cnn": ("image", (1, 96, 96, 3)), "dense": ("x", (1, 512)),
          "attention": ("tokens", (1, 32, 64)), "convnet": ("image", (1, 64, 64, 3))}
SERVING = re.compile(r"serving model=.* grpc_port=(\d+) rest_api_port=(\d+)")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}

SERVERS = {"fixed": "fixed-response", "off": "batching off", "default": "default", "reference": "reference"}
"""The servers measured side by side, in turn order, with the names the tables give them."""
SWEPT = ("off", "default", "reference")
"""The servers of the open-loop sweep."""
PROTOCOLS = {"v2": "v2", "rest": "REST"}
"""The default server's other front-ends (--protocol of client bench), measured on --protocol-models."""

BATCH_ROWS = "mirrorserve_batch_rows"
"""The server's histogram of rows per executed batch (server.metrics)."""
GOAL_LEVEL = 64
"""The clients at which goals a and d are judged, and the sweep's capacity is measured."""
GOAL_THROUGHPUT = 1.15
GOAL_LATENCY_MODELS = ("mlp", "cnn")
GOAL_LATENCY = 1.3
GOAL_CPU_MODEL = "mlp"
GOAL_CPU = 1.5


def run_json(args: list[str], timeout: float) -> Any:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Process:
    """A server subprocess, stopped with SIGTERM; `find` says when it serves, and where."""

    def __init__(self, args: list[str], log: Path, find: Callable[[], str | None]) -> None:
        self.log = log
        self.find = find
        self.handle = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=ENV,
                                       stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def wait_for(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.find()
            if found:
                return found
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


def launch_ours(base: Path, flags: list[str], work: Path, label: str) -> Process:
    """The server; it serves at 127.0.0.1:GRPC_PORT,REST_PORT (measure() takes the one it needs)."""
    log = work / f"{label}.log"

    def ports() -> str | None:
        match = SERVING.search(log.read_text(errors="replace"))
        return f"127.0.0.1:{match.group(1)},{match.group(2)}" if match else None

    return Process(["-m", "server", "--model-base-path", str(base), "--model-name", base.name,
                    "--port", "0", "--rest-api-port", "0", "--drain-delay-s", "0", *flags], log, ports)


def launch_port_file_server(module: str, args: list[str], work: Path, label: str) -> Process:
    """bench.fixed_server or bench.reference_batcher: PORT_FILE first, the port written there once it serves."""
    port_file = work / f"{label}.port"
    port_file.unlink(missing_ok=True)  # a repeat must not read the last run's port

    def port() -> str | None:
        text = port_file.read_text().strip() if port_file.exists() else ""
        return f"127.0.0.1:{text}" if text else None

    return Process(["-m", module, str(port_file), *args], work / f"{label}.log", port)


def start_servers(base: Path, response: Path, work: Path, model: str,
                  default_flags: list[str]) -> dict[str, tuple[Process, str]]:
    """The servers under comparison (SERVERS), launched together, each with its target once it serves."""
    processes: dict[str, Process] = {}
    try:
        processes["fixed"] = launch_port_file_server("bench.fixed_server", [str(response)], work, f"{model}-fixed")
        processes["off"] = launch_ours(base, ["--max-batch-size", "1"], work, f"{model}-off")
        processes["default"] = launch_ours(base, default_flags, work, f"{model}-default")
        processes["reference"] = launch_port_file_server("bench.reference_batcher", [str(base)], work,
                                                         f"{model}-reference")
        return {label: (process, process.wait_for()) for label, process in processes.items()}
    except BaseException:
        for process in processes.values():
            process.stop()
        raise


def measure(target: str, model: str, input_file: Path, opts: argparse.Namespace, load: list[str],
            server_pid: int | None = None, protocol: str = "tfserving") -> dict[str, Any]:
    """One client bench run; `load` is ["--concurrency", C] (closed loop) or ["--rate", R] (open loop)."""
    name = SHAPES[model][0]
    cpu_of = [] if server_pid is None else ["--cpu-of", str(server_pid)]
    host, _, ports = target.rpartition(":")
    grpc_port, _, rest_port = ports.partition(",")
    from client.cli import bench_results  # imports TensorFlow's protos: once, not once a run

    before = batch_totals(host, rest_port)
    (run,) = bench_results(
        ["--target", f"{host}:{grpc_port}", "--rest-target", f"{host}:{rest_port}",
         "--model", model, "--no-metadata", "--input", f"{name}={input_file}", *load, "--protocol", protocol,
         "--warmup-s", str(opts.warmup_s), "--seconds", str(opts.seconds), *cpu_of])
    after = batch_totals(host, rest_port)
    if before is not None and after is not None and after[1] > before[1]:
        run["rows_per_batch"] = (after[0] - before[0]) / (after[1] - before[1])
    return run


def batch_totals(host: str, rest_port: str) -> tuple[float, float] | None:
    """(rows, batches) this server has executed so far, from its Prometheus page; None for a server
    without one (the fixed-response server, the reference). A run's rows per batch is what decides
    how much of every process's per-request CPU is shared out over a batch."""
    if not rest_port:
        return None
    with urllib.request.urlopen(f"http://{host}:{rest_port}/metrics", timeout=10) as page:
        text = page.read().decode()
    totals = {f"{BATCH_ROWS}_sum": 0.0, f"{BATCH_ROWS}_count": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals[f"{BATCH_ROWS}_sum"], totals[f"{BATCH_ROWS}_count"]


def in_process_ceiling(model: str, base: Path, input_file: Path, response: Path, seconds: float) -> dict[str, Any]:
    """rows/s of the SavedModel called directly, per batch size, and its 1-row call in ms; also writes
    the fixed server's response."""
    found: dict[str, Any] = run_json(["-m", "bench.inprocess", str(base), str(input_file), str(response),
                                      str(seconds), "1", "16", "64"], timeout=600)
    print(f"{model} in-process: {found}", file=sys.stderr, flush=True)
    return found


def median_run(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat whose req/s is the median (its latencies with it), with every repeat's req/s."""
    if any(r["codes"] != {"OK": r["requests"]} or not r["requests"] for r in repeats):
        raise RuntimeError(f"a benchmark run had failures or no answers: {repeats}")
    ordered = sorted(repeats, key=lambda r: r["req_per_s"])
    return {**ordered[len(ordered) // 2], "repeats_req_per_s": [r["req_per_s"] for r in repeats]}


def at_level(runs: list[dict[str, Any]], clients: int) -> dict[str, Any] | None:
    return next((r for r in runs if r["concurrency"] == clients), None)


# --- the open-loop sweep ---------------------------------------------------------------------------

def unanswered(run: dict[str, Any]) -> tuple[int, int]:
    """(requests without an OK answer, requests in all) of an open-loop run: those failed in the
    window, and those offered in it (scheduled) that were still unanswered at its end."""
    total = max(run["requests"], run.get("offered") or 0)
    return total - run["codes"].get("OK", 0), total


def latency_ms(run: dict[str, Any], key: str) -> float:
    """An open-loop run's p50_ms or p99_ms, a request without an OK answer (unanswered()) counting as
    infinitely slow: inf when those reach that quantile."""
    quantile = {"p50_ms": 0.5, "p99_ms": 0.99}[key]
    missing, total = unanswered(run)
    if missing >= total or missing > (1 - quantile) * total:
        return math.inf
    return float(run[key])


def sweep_point(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Every round of one server at one rate: p50/p99 (None: failures reached it), and their medians."""
    point: dict[str, Any] = {"rate": repeats[0]["rate"], "runs": repeats}
    for key in ("p50_ms", "p99_ms"):
        rounds = [latency_ms(r, key) for r in repeats]
        point[key] = [None if math.isinf(v) else v for v in rounds]
        median = statistics.median(rounds)
        point[f"{key}_median"] = None if math.isinf(median) else median
    return point


def values(point: dict[str, Any], key: str) -> list[float]:
    return [math.inf if v is None else float(v) for v in point[key]]


def median_of(point: dict[str, Any], key: str) -> float:
    value = point[f"{key}_median"]
    return math.inf if value is None else float(value)


def no_worse(ours: dict[str, Any], other: dict[str, Any], key: str) -> bool:
    """The sweep's noise rule: ours' median is no worse than the other's worst round."""
    return median_of(ours, key) <= max(values(other, key))


# --- goals -----------------------------------------------------------------------------------------

@dataclass
class Goal:
    key: str
    text: str
    status: str = "NOT MEASURED"
    """PASS, FAIL, or NOT MEASURED (the run did not include what it needs)."""
    summary: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def judge(self, checks: list[bool]) -> None:
        if checks:
            self.status = "PASS" if all(checks) else "FAIL"


def finite(value: float) -> float | None:
    """A figure for results.json: None for inf (a failed request's latency) and NaN."""
    return value if math.isfinite(value) else None


def machine_reach(r: dict[str, Any]) -> dict[str, float] | None:
    """The most req/s at GOAL_LEVEL clients that this run's own figures allow any gRPC server on this
    machine, by two limits, the lower counting: the fixed-response server's req/s (a grpc.aio server
    that does no work answered no faster), and the machine's cores over the least CPU a request can
    cost: the model's own per row at its cheapest batch size in-process, plus the fixed-response
    server's per request, plus the least the load generator spent per request on any of the servers.
    Over the reference's req/s, it is the most goal a's ratio could be here, as far as the run can
    tell. None where the run lacks a figure."""
    per_row = r.get("inprocess_cpu_us_per_row")
    fixed = at_level(r["fixed"], GOAL_LEVEL)
    runs = [at_level(r[label], GOAL_LEVEL) for label in SERVERS]
    if not per_row or fixed is None or any(run is None for run in runs):
        return None
    model_us = min(per_row.values())
    client_us = min(run["client_cpu_us"] for run in runs if run is not None)
    least_us = model_us + fixed["server_cpu_us"] + client_us
    cores = len(os.sched_getaffinity(0))
    return {"reach_req_per_s": min(fixed["req_per_s"], cores * 1e6 / least_us), "cores": cores,
            "least_cpu_us": least_us, "model_cpu_us_per_row": model_us}


def goals(results: dict[str, Any]) -> list[Goal]:
    """The goals, judged on every model of the run that each needs."""
    a = Goal("a", f"at {GOAL_LEVEL} clients, on every model: default req/s / reference req/s >= {GOAL_THROUGHPUT}")
    b = Goal("b", "at every sweep load, on every model: default's p50 and p99 no worse than batching off's and "
                  "than the reference's (default's median <= the other's worst round)")
    c = Goal("c", f"at 1 client, on {' and '.join(GOAL_LATENCY_MODELS)}: default p50 <= {GOAL_LATENCY} x "
                  "(fixed-response p50 + in-process 1-row call)")
    d = Goal("d", f"at {GOAL_LEVEL} {GOAL_CPU_MODEL} clients: CPU per request of all the default server's "
                  f"processes <= {GOAL_CPU} x the fixed-response server's")
    checks: dict[str, list[bool]] = {"a": [], "b": [], "c": [], "d": []}
    notes: dict[str, list[str]] = {"a": [], "c": [], "d": []}
    worse: list[str] = []
    for model, r in results.items():
        default, reference = at_level(r["default"], GOAL_LEVEL), at_level(r["reference"], GOAL_LEVEL)
        if default and reference:
            value = default["req_per_s"] / reference["req_per_s"]
            a.figures[model] = {"ratio": value}
            checks["a"].append(value >= GOAL_THROUGHPUT)
            notes["a"].append(f"{model} {value:.2f}")
            reach = machine_reach(r)
            if reach is not None:
                reach_ratio = reach["reach_req_per_s"] / reference["req_per_s"]
                a.figures[model].update(reach, reach_ratio=reach_ratio)
                notes["a"][-1] += f" (reach {reach_ratio:.2f})"
        for point in r["sweep"]:
            for other in ("off", "reference"):
                for key in ("p50_ms", "p99_ms"):
                    ours, others_worst = median_of(point["default"], key), max(values(point[other], key))
                    ok = no_worse(point["default"], point[other], key)
                    checks["b"].append(ok)
                    where = f"{model} {point['fraction']:.0%} {key[:3]} vs {SERVERS[other]}"
                    b.figures[where] = {"default_median_ms": finite(ours), "other_worst_ms": finite(others_worst),
                                        "ratio_of_medians": finite(ours / median_of(point[other], key)),
                                        "pass": ok}
                    if not ok:
                        worse.append(f"{where}: {ms(ours)} > {ms(others_worst)} ms")
        fixed_1, default_1 = at_level(r["fixed"], 1), at_level(r["default"], 1)
        if model in GOAL_LATENCY_MODELS and fixed_1 and default_1:
            bound = GOAL_LATENCY * (fixed_1["p50_ms"] + r["inprocess_1_row_ms"])
            c.figures[model] = {"default_p50_ms": default_1["p50_ms"], "fixed_p50_ms": fixed_1["p50_ms"],
                                "inprocess_1_row_ms": r["inprocess_1_row_ms"], "bound_ms": bound}
            checks["c"].append(default_1["p50_ms"] <= bound)
            notes["c"].append(f"{model} {default_1['p50_ms']:.2f} ms vs {GOAL_LATENCY} x ({fixed_1['p50_ms']:.2f} "
                              f"+ {r['inprocess_1_row_ms']:.2f}) = {bound:.2f} ms")
        fixed_64 = at_level(r["fixed"], GOAL_LEVEL)
        if model == GOAL_CPU_MODEL and default and fixed_64 and all_server_cpu(fixed_64) > 0:
            ours_cpu, fixed_cpu = all_server_cpu(default), all_server_cpu(fixed_64)
            d.figures[model] = {"default_cpu_us": ours_cpu, "fixed_cpu_us": fixed_cpu,
                                "ratio": ours_cpu / fixed_cpu}
            checks["d"].append(ours_cpu <= GOAL_CPU * fixed_cpu)
            notes["d"].append(f"{model} {ours_cpu:,.0f} / {fixed_cpu:,.0f} µs = {ours_cpu / fixed_cpu:.2f}")
    for goal in (a, c, d):
        goal.summary = ", ".join(notes[goal.key])
    if checks["b"]:
        b.summary = f"{sum(checks['b'])} of {len(checks['b'])} comparisons pass"
        if worse:
            b.summary += "; worse than the other's worst round: " + "; ".join(worse)
    for goal in (a, b, c, d):
        goal.judge(checks[goal.key])
    return [a, b, c, d]


# --- the report ------------------------------------------------------------------------------------

def ms(value: float) -> str:
    return "failed" if math.isinf(value) else f"{value:.2f}"


def rate(run: dict[str, Any]) -> str:
    """req/s of the median run, with the range over the repeats."""
    repeats = run.get("repeats_req_per_s", [])
    spread = f" ({min(repeats):,.0f}-{max(repeats):,.0f})" if len(repeats) > 1 else ""
    return f"{run['req_per_s']:,.0f}{spread}"


def cpu(run: dict[str, Any], key: str) -> str:
    value = run.get(key)
    return "-" if value is None else f"{value:,.0f}"


def server_cpu(run: dict[str, Any]) -> str:
    """The server process's CPU per request, and in brackets the cores that came to."""
    value = run.get("server_cpu_us")
    return "-" if value is None else f"{value:,.0f} ({value * run['requests'] / run['seconds'] / 1e6:.2f})"


def per_batch(run: dict[str, Any]) -> str:
    value = run.get("rows_per_batch")
    return "-" if value is None else f"{value:.1f}"


def all_server_cpu(run: dict[str, Any]) -> float:
    """CPU per request of the server process and its children (the model worker), in µs."""
    return float((run.get("server_cpu_us") or 0.0) + (run.get("server_children_cpu_us") or 0.0))


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and math.isfinite(a) and math.isfinite(b) else "n/a"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def goals_section(found: list[Goal]) -> list[str]:
    lines = ["## Goals", "",
             "Each computed from this run. Sweep noise rule (goal b): a point passes when the default server's "
             "median over the rounds is no worse than the other server's worst round; a request without an OK "
             "answer (failed, or offered in the window and still unanswered at its end) counts as infinitely slow. "
             "Reach (goal a): the most any gRPC server could have answered on this machine by this run's own "
             "figures, over the reference's req/s: the lower of the fixed-response server's req/s and the cores "
             "over the least CPU a request needs (the model's in-process CPU per row at its cheapest batch size, the "
             "fixed-response server's CPU per request, the load generator's least CPU per request).",
             ""]
    for goal in found:
        lines.append(f"- {goal.key}) {goal.text}: **{goal.status}**" + (f" — {goal.summary}" if goal.summary else ""))
    return [*lines, ""]


def model_cpu(r: dict[str, Any]) -> str:
    """The in-process CPU per row at each batch size (the lower of the two measurements), if the run has it."""
    per_row = r.get("inprocess_cpu_us_per_row")
    if not per_row:
        return ""
    return "; CPU per row, every thread of the process, the lower of the two: " + ", ".join(
        f"batch {b}: {us:,.0f} µs" for b, us in per_row.items())


def closed_loop_section(r: dict[str, Any]) -> list[str]:
    ceiling = r["inprocess"]
    before, after = r["inprocess_runs"]
    one_before, one_after = r["inprocess_1_row_ms_runs"]
    best_ceiling = ceiling.get("64") or max(ceiling.values())
    lines = ["In-process ceiling (SavedModel called directly; before the servers / after them; the ratios use "
             "the better): " + ", ".join(f"batch {b}: {before[b]:,.0f} / {after[b]:,.0f} rows/s" for b in ceiling)
             + f"; one 1-row call: {one_before:.2f} / {one_after:.2f} ms" + model_cpu(r)
             + ". Rows per batch: the default server's average over the median run, its warm-up included.", ""]
    lines += table(
        ["clients", "fixed-response gRPC req/s", "batching off req/s", "default req/s", "reference req/s",
         "default / fixed", "default / off", "default / reference", "default / in-process@64", "p50 ms off",
         "p50 ms default", "p50 ms reference", "p99 ms default", "p99 ms reference", "default rows per batch"],
        [[str(d["concurrency"]), rate(f), rate(o), rate(d), rate(ref), ratio(d["req_per_s"], f["req_per_s"]),
          ratio(d["req_per_s"], o["req_per_s"]), ratio(d["req_per_s"], ref["req_per_s"]),
          ratio(d["rows_per_s"], best_ceiling), f"{o['p50_ms']:.2f}", f"{d['p50_ms']:.2f}", f"{ref['p50_ms']:.2f}",
          f"{d['p99_ms']:.2f}", f"{ref['p99_ms']:.2f}", per_batch(d)]
         for f, o, d, ref in zip(r["fixed"], r["off"], r["default"], r["reference"], strict=True)])
    lines += ["", "CPU per request in µs over the measured window of the median run; in brackets, the cores "
              "the server process itself used (its Python threads share one GIL, so about 1 means saturated):", ""]
    lines += table(
        ["clients", "fixed-response: load generator", "fixed-response: server", "batching off: load generator",
         "batching off: server", "batching off: model worker", "default: load generator", "default: server",
         "default: model worker", "reference: load generator", "reference: server"],
        [[str(d["concurrency"]), cpu(f, "client_cpu_us"), server_cpu(f), cpu(o, "client_cpu_us"), server_cpu(o),
          cpu(o, "server_children_cpu_us"), cpu(d, "client_cpu_us"), server_cpu(d),
          cpu(d, "server_children_cpu_us"), cpu(ref, "client_cpu_us"), server_cpu(ref)]
         for f, o, d, ref in zip(r["fixed"], r["off"], r["default"], r["reference"], strict=True)])
    lines += ["", f"CPU per request of all server processes together (the server and its model worker), µs (goal d, "
              f"on {GOAL_CPU_MODEL} at {GOAL_LEVEL} clients: default / fixed <= {GOAL_CPU}):", ""]
    lines += table(
        ["clients", "fixed-response", "batching off", "default", "reference", "default / fixed",
         "default / reference"],
        [[str(d["concurrency"]), f"{all_server_cpu(f):,.0f}", f"{all_server_cpu(o):,.0f}",
          f"{all_server_cpu(d):,.0f}", f"{all_server_cpu(ref):,.0f}", ratio(all_server_cpu(d), all_server_cpu(f)),
          ratio(all_server_cpu(d), all_server_cpu(ref))]
         for f, o, d, ref in zip(r["fixed"], r["off"], r["default"], r["reference"], strict=True)])
    return lines


def protocol_section(r: dict[str, Any], label: str) -> list[str]:
    """The default server over another front-end (v2 or REST) against its Predict, in the same turns."""
    name = PROTOCOLS[label]
    intro = {"v2": "Open Inference Protocol (v2 ModelInfer, raw contents) against TF Serving's Predict (the goal: "
                   "v2 / Predict CPU <= 1.10)",
             "rest": "TF Serving's REST predict (JSON, row format, aiohttp client) against its gRPC Predict"}[label]
    lines = ["", f"{intro}: the same default server measured in the same turns; server CPU is per request, the "
             "server and its model worker together, and the load generator's own is beside it:", ""]
    return lines + table(
        ["clients", "Predict req/s", f"{name} req/s", f"{name} / Predict req/s", "Predict p50 ms", f"{name} p50 ms",
         "Predict server CPU µs", f"{name} server CPU µs", f"{name} / Predict CPU", f"{name} load generator CPU µs"],
        [[str(d["concurrency"]), rate(d), rate(p), ratio(p["req_per_s"], d["req_per_s"]), f"{d['p50_ms']:.2f}",
          f"{p['p50_ms']:.2f}", f"{all_server_cpu(d):,.0f}", f"{all_server_cpu(p):,.0f}",
          ratio(all_server_cpu(p), all_server_cpu(d)), cpu(p, "client_cpu_us")]
         for d, p in zip(r["default"], r[label], strict=True)])


def spread(point: dict[str, Any], key: str) -> str:
    """A sweep cell: the median over the rounds, and the range of the rounds."""
    rounds = values(point, key)
    text = ms(median_of(point, key))
    return text + (f" ({ms(min(rounds))}-{ms(max(rounds))})" if len(rounds) > 1 else "")


def without_answer(run: dict[str, Any]) -> str:
    """What an open-loop run left without an OK answer ("" if nothing): failures, and the requests
    offered in the window still unanswered at its end."""
    missing, total = unanswered(run)
    if not missing:
        return ""
    parts = [f"{code} {n}" for code, n in sorted(run["codes"].items()) if code != "OK"]
    if total > run["requests"]:
        parts.append(f"{total - run['requests']} unanswered at the window's end")
    return f"{missing} of {total} ({', '.join(parts)})"


def sweep_section(r: dict[str, Any], rounds: int) -> list[str]:
    if not r["sweep"]:
        return []
    lines = ["", f"Open loop: Poisson arrivals at fractions of capacity ({r['capacity_req_per_s']:,.0f} req/s, the "
             f"default server's median at {r['capacity_clients']} clients above), latency from each request's "
             f"scheduled start; each cell the median of {rounds} rounds (their range in brackets). A point passes "
             "when default's median is no worse than the other's worst round (goal b):", ""]
    rows = []
    notes: list[str] = []
    for point in r["sweep"]:
        off, default, reference = point["off"], point["default"], point["reference"]
        passed = all(no_worse(default, other, key) for other in (off, reference) for key in ("p50_ms", "p99_ms"))
        rows.append([f"{point['fraction']:.0%}", f"{point['rate']:,.0f}",
                     *(spread(p, "p50_ms") for p in (off, default, reference)),
                     *(spread(p, "p99_ms") for p in (off, default, reference)),
                     f"{ratio(median_of(default, 'p50_ms'), median_of(off, 'p50_ms'))}, "
                     f"{ratio(median_of(default, 'p99_ms'), median_of(off, 'p99_ms'))}",
                     f"{ratio(median_of(default, 'p50_ms'), median_of(reference, 'p50_ms'))}, "
                     f"{ratio(median_of(default, 'p99_ms'), median_of(reference, 'p99_ms'))}",
                     "PASS" if passed else "FAIL"])
        for label in SWEPT:
            notes += [f"{point['fraction']:.0%} {SERVERS[label]} round {i}: {note}"
                      for i, run in enumerate(point[label]["runs"], 1) if (note := without_answer(run))]
    lines += table(["load", "rate req/s", "p50 ms off", "p50 ms default", "p50 ms reference", "p99 ms off",
                    "p99 ms default", "p99 ms reference", "default / off p50, p99", "default / reference p50, p99",
                    "pass"], rows)
    if notes:
        lines += ["", "Requests without an OK answer, counted as infinitely slow: " + "; ".join(notes)]
    return lines


def report(results: dict[str, Any], found: list[Goal], opts: argparse.Namespace) -> str:
    lines = [f"# Benchmark ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
             f"{opts.seconds:g} s per point after {opts.warmup_s:g} s warm-up, median of {opts.repeat} runs "
             "taken in turns with the four servers side by side, one client process sending 1-row "
             "requests on the same machine)", "", *goals_section(found)]
    for model, r in results.items():
        lines += [f"## {model}", "", *closed_loop_section(r)]
        for label in PROTOCOLS:
            if label in r:
                lines += protocol_section(r, label)
        lines += [*sweep_section(r, opts.repeat), ""]
    return "\n".join(lines)


# --- the run ---------------------------------------------------------------------------------------

def run_model(model: str, opts: argparse.Namespace, out: Path, work: Path) -> dict[str, Any]:
    base = Path(run_json(["-c", "import json, sys; from pathlib import Path; from bench.models import build; "
                          f"print(json.dumps(str(build({model!r}, Path(sys.argv[1])))))",
                          str(out / "models")], timeout=600))
    input_file = work / f"{model}-input.npy"
    np.save(input_file, np.random.default_rng(0).standard_normal(SHAPES[model][1]).astype(np.float32))
    response = work / f"{model}-response.pb"
    ceiling_s = max(opts.seconds / 2, 0.3)  # per batch size
    before = in_process_ceiling(model, base, input_file, response, ceiling_s)
    levels = [int(c) for c in opts.concurrency.split(",")]
    fractions = [float(f) for f in opts.sweep.split(",") if f.strip()]
    servers = start_servers(base, response, work, model, opts.server_flags.split())
    # (label, server, protocol): on --protocol-models, the default server is measured again in each
    # turn over the v2 ModelInfer and over TF Serving's REST predict (JSON, row format).
    turns = [(label, label, "tfserving") for label in SERVERS]
    if model in opts.protocol_models.split(","):
        turns += [(label, "default", label) for label in PROTOCOLS]
    runs: dict[str, list[list[dict[str, Any]]]] = {label: [[] for _ in levels] for label, _, _ in turns}
    sweep: list[dict[str, Any]] = []
    try:
        for i, level in enumerate(levels):
            for _ in range(opts.repeat):
                for label, server, protocol in turns:
                    process, target = servers[server]
                    run = measure(target, model, input_file, opts, ["--concurrency", str(level)],
                                  process.handle.pid, protocol)
                    runs[label][i].append(run)
                    print(f"{model} {label}: C={level} {run['req_per_s']:,.0f} req/s p50 {run['p50_ms']:.2f} ms",
                          file=sys.stderr, flush=True)
        closed = {label: [median_run(r) for r in label_runs] for label, label_runs in runs.items()}
        # capacity: the default server at 64 clients (or the most clients measured)
        capacity_clients = GOAL_LEVEL if GOAL_LEVEL in levels else max(levels)
        capacity = closed["default"][levels.index(capacity_clients)]["req_per_s"]
        for fraction in fractions:
            rounds: dict[str, list[dict[str, Any]]] = {label: [] for label in SWEPT}
            for _ in range(opts.repeat):
                for label in SWEPT:
                    process, target = servers[label]
                    run = measure(target, model, input_file, opts, ["--rate", f"{fraction * capacity:.1f}"],
                                  process.handle.pid)
                    rounds[label].append(run)
                    print(f"{model} {label}: {fraction:.0%} = {run['rate']:,.0f} req/s: p50 {run['p50_ms']:.2f} ms "
                          f"p99 {run['p99_ms']:.2f} ms {run['codes']}", file=sys.stderr, flush=True)
            sweep.append({"fraction": fraction, "rate": rounds["default"][0]["rate"],
                          **{label: sweep_point(r) for label, r in rounds.items()}})
    finally:
        for process, _ in servers.values():
            process.stop()
    # the machine's speed drifts: the ratios use the better ceiling
    after = in_process_ceiling(model, base, input_file, response, ceiling_s)
    rows_before, rows_after = before["rows_per_s"], after["rows_per_s"]
    return {"inprocess": {b: max(rows_before[b], rows_after[b]) for b in rows_before},
            "inprocess_runs": [rows_before, rows_after],
            "inprocess_cpu_us_per_row": {b: min(before["cpu_us_per_row"][b], after["cpu_us_per_row"][b])
                                         for b in before["cpu_us_per_row"]},
            "inprocess_1_row_ms": min(before["one_row_ms"], after["one_row_ms"]),
            "inprocess_1_row_ms_runs": [before["one_row_ms"], after["one_row_ms"]],
            **closed, "capacity_clients": capacity_clients, "capacity_req_per_s": capacity, "sweep": sweep}


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
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in opts.models.split(","):
            results[model] = run_model(model, opts, out, Path(tmp))
    found = goals(results)
    (out / "results.json").write_text(json.dumps({**results, "goals": {g.key: asdict(g) for g in found}}, indent=1))
    markdown = report(results, found, opts)
    (out / "results.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
