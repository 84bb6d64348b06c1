"""The measuring half of `make bench` (bench.suite): the servers under comparison side by side,
`client bench` against each in turns, the in-process ceiling before and after, and the open-loop
sweep; typed results (bench.results) out. bench.judge judges them, bench.report writes them up."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench import perf
from bench.judge import GOAL_LEVEL
from bench.launch import ROOT, ServerProcess, poll_until, reap, spawn_server, wait_for_server
from bench.perf import PerfRun
from bench.results import PROTOCOLS, SERVERS, SWEPT, ModelResults, Run, SweepPoint, SweepSide, median_run

SHAPES = {"mlp": ("x", (1, 256)), "cnn": ("image", (1, 96, 96, 3)), "dense": ("x", (1, 512)),
          "attention": ("tokens", (1, 32, 64)), "convnet": ("image", (1, 64, 64, 3))}
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
BATCH_ROWS = "mirrorserve_batch_rows"
"""The server's histogram of rows per executed batch (server.metrics)."""


def run_python(args: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """`python ARGS` in the repository, `env` over ENV; its stdout, or RuntimeError with its stderr."""
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def run_json(args: list[str], timeout: float, env: dict[str, str] | None = None) -> Any:
    """The JSON a Python helper prints last."""
    return json.loads(run_python(args, timeout, env).strip().splitlines()[-1])


def build_models(models: list[str], out: Path, env: dict[str, str] | None = None) -> dict[str, Path]:
    """bench.models' SavedModels under `out` (built once, kept), in a process of their own: the
    caller stays without TensorFlow."""
    found = run_json(["-c", "import json, sys; from pathlib import Path; from bench.models import build; "
                            "print(json.dumps({m: str(build(m, Path(sys.argv[1]))) for m in sys.argv[2:]}))",
                      str(out), *models], timeout=600, env=env)
    return {name: Path(path) for name, path in found.items()}


@dataclasses.dataclass
class Server:
    """A server under comparison: where it serves (host:GRPC_PORT[,REST_PORT]), its pid, and how to stop it."""

    target: str
    pid: int
    stop: Callable[[], object]


class _PortFileServer:
    """bench.fixed_server or bench.reference_batcher: PORT_FILE first, the port written there once it serves."""

    def __init__(self, module: str, args: list[str], work: Path, label: str) -> None:
        self.port_file = work / f"{label}.port"
        self.port_file.unlink(missing_ok=True)  # a repeat must not read the last run's port
        self.log = work / f"{label}.log"
        with self.log.open("wb") as log:
            self.handle = subprocess.Popen([sys.executable, "-m", module, str(self.port_file), *args], cwd=ROOT,
                                           env=ENV, stdout=log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 180) -> Server:
        def served() -> Server | None:
            text = self.port_file.read_text().strip() if self.port_file.exists() else ""
            return Server(f"127.0.0.1:{text}", self.handle.pid, self.stop) if text else None

        return poll_until(self.handle, served, self.log, timeout, repr(self.handle.args))

    def stop(self) -> None:
        self.handle.terminate()
        reap(self.handle)


def _ours(server: ServerProcess) -> Server:
    return Server(f"127.0.0.1:{server.port},{server.rest_port}", server.process.pid, server.stop)


def start_servers(base: Path, response: Path, work: Path, model: str, default_flags: list[str]) -> dict[str, Server]:
    """The servers under comparison (SERVERS), launched together, each returned once it serves."""
    flags = ["--model-base-path", str(base), "--model-name", base.name, "--drain-delay-s", "0"]
    started: list[Callable[[], object]] = []
    try:
        fixed = _PortFileServer("bench.fixed_server", [str(response)], work, f"{model}-fixed")
        started.append(fixed.stop)
        spawned = {}
        for label, extra in (("off", ["--max-batch-size", "1"]), ("default", default_flags)):
            log = work / f"{model}-{label}.log"
            spawned[label] = (spawn_server([*flags, *extra], log, ENV), log)
            started.append(spawned[label][0].kill)
        reference = _PortFileServer("bench.reference_batcher", [str(base)], work, f"{model}-reference")
        started.append(reference.stop)
        servers = {"fixed": fixed.wait()}
        for label, (process, log) in spawned.items():
            servers[label] = _ours(wait_for_server(process, log, timeout=180))
        servers["reference"] = reference.wait()
        return {label: servers[label] for label in SERVERS}
    except BaseException:
        for stop in started:
            stop()
        raise


def measure(target: str, model: str, input_file: Path, opts: argparse.Namespace, load: list[str],
            server_pid: int | None = None, protocol: str = "tfserving") -> Run:
    """One client bench run; `load` is ["--concurrency", C] (closed loop) or ["--rate", R] (open loop)."""
    name = SHAPES[model][0]
    cpu_of = [] if server_pid is None else ["--cpu-of", str(server_pid)]
    host, _, ports = target.rpartition(":")
    grpc_port, _, rest_port = ports.partition(",")
    from client.cli import bench_runs, build_parser  # imports the generated protos: once, not once a run

    before = batch_totals(host, rest_port)
    found = bench_runs(build_parser().parse_args([
        "bench", "--target", f"{host}:{grpc_port}", "--rest-target", f"{host}:{rest_port}",
        "--model", model, "--no-metadata", "--input", f"{name}={input_file}", *load, "--protocol", protocol,
        "--warmup-s", str(opts.warmup_s), "--seconds", str(opts.seconds), *cpu_of]))
    if isinstance(found, int):
        raise RuntimeError(f"client bench {load} on {target} failed (exit code {found})")
    (result,) = found
    after = batch_totals(host, rest_port)
    rows_per_batch = None
    if before is not None and after is not None and after[1] > before[1]:
        rows_per_batch = (after[0] - before[0]) / (after[1] - before[1])
    return Run(**dataclasses.asdict(result), rows_per_batch=rows_per_batch)


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


def run_model(model: str, opts: argparse.Namespace, out: Path, work: Path) -> ModelResults:
    base = build_models([model], out / "models")[model]
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
    runs: dict[str, list[list[Run]]] = {label: [[] for _ in levels] for label, _, _ in turns}
    sweep: list[SweepPoint] = []
    try:
        for i, level in enumerate(levels):
            for _ in range(opts.repeat):
                for label, name, protocol in turns:
                    run = measure(servers[name].target, model, input_file, opts, ["--concurrency", str(level)],
                                  servers[name].pid, protocol)
                    runs[label][i].append(run)
                    print(f"{model} {label}: C={level} {run.req_per_s:,.0f} req/s p50 {run.p50_ms:.2f} ms",
                          file=sys.stderr, flush=True)
        closed = {label: [median_run(r) for r in label_runs] for label, label_runs in runs.items()}
        # capacity: the default server at 64 clients (or the most clients measured)
        capacity_clients = GOAL_LEVEL if GOAL_LEVEL in levels else max(levels)
        capacity = closed["default"][levels.index(capacity_clients)].req_per_s
        for fraction in fractions:
            rounds: dict[str, list[Run]] = {label: [] for label in SWEPT}
            for _ in range(opts.repeat):
                for label in SWEPT:
                    run = measure(servers[label].target, model, input_file, opts,
                                  ["--rate", f"{fraction * capacity:.1f}"], servers[label].pid)
                    rounds[label].append(run)
                    print(f"{model} {label}: {fraction:.0%} = {run.rate:,.0f} req/s: p50 {run.p50_ms:.2f} ms "
                          f"p99 {run.p99_ms:.2f} ms {run.codes}", file=sys.stderr, flush=True)
            sweep.append(SweepPoint(fraction, rounds["default"][0].rate,
                                    {label: SweepSide.of(r) for label, r in rounds.items()}))
        perf = perf_table(servers, model, levels, opts, work)
    finally:
        for each in servers.values():
            each.stop()
    # the machine's speed drifts: the ratios use the better ceiling
    after = in_process_ceiling(model, base, input_file, response, ceiling_s)
    rows_before, rows_after = before["rows_per_s"], after["rows_per_s"]
    return ModelResults(
        closed=closed, inprocess={b: max(rows_before[b], rows_after[b]) for b in rows_before},
        inprocess_runs=[rows_before, rows_after],
        inprocess_cpu_us_per_row={b: min(before["cpu_us_per_row"][b], after["cpu_us_per_row"][b])
                                  for b in before["cpu_us_per_row"]},
        inprocess_1_row_ms=min(before["one_row_ms"], after["one_row_ms"]),
        inprocess_1_row_ms_runs=[before["one_row_ms"], after["one_row_ms"]],
        capacity_clients=capacity_clients, capacity_req_per_s=capacity, sweep=sweep, perf=perf)


def perf_table(servers: dict[str, Server], model: str, levels: list[int], opts: argparse.Namespace,
               work: Path) -> dict[str, list[PerfRun]]:
    """perf_analyzer against each server at each concurrency, in turns (bench.perf); {} when it is
    not installed (`make bench` installs it)."""
    path = perf.binary()
    if path is None:
        print("perf_analyzer is not installed: no perf_analyzer table (make bench installs it)", file=sys.stderr)
        return {}
    name, shape = SHAPES[model]
    turns = [(label, label, "tfserving") for label in SERVERS] + [(perf.TRITON, "default", perf.TRITON)]
    table: dict[str, list[PerfRun]] = {label: [] for label, _, _ in turns}
    for level in levels:
        for label, server, kind in turns:
            target = servers[server].target.split(",")[0]
            run = perf.perf_run(path, target, model, name, shape, level, opts.seconds, kind, work / "perf.csv")
            table[label].append(run)
            print(f"{model} perf_analyzer {label}: C={level} {run.req_per_s:,.0f} req/s p50 {run.p50_ms:.2f} ms",
                  file=sys.stderr, flush=True)
    return table
