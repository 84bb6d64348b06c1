"""Front-end processes (--frontends N) side by side, on one model: req/s, p50, p99, the front-ends'
CPU per request and rows per model run, at each concurrency, measured in turns.

One server per N is started (all at once; an idle one costs no CPU), then perf_analyzer (Triton's
C++ client, its Triton kind, over gRPC and over v2 REST) drives each in turn with
TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT=1 (over HTTP each caller has its own connection anyway),
so each of its callers has a connection of its own and the kernel can spread them over the
front-ends (SO_REUSEPORT spreads connections, not calls). The front-ends' CPU is read from /proc
over each run: every process of the server but the model worker (the one that has TensorFlow
mapped) and multiprocessing's resource tracker. Rows per run come from mirrorserve_batch_rows.

Beside them, the wire ceiling moves with N: the fixed-response server (bench.fixed_server) at N
processes on one port, driven over gRPC with perf_analyzer's TF Serving kind (the only API it
answers), so a row shows what N Python gRPC processes can answer on this machine at all.

usage: python -m bench.frontends [--model mlp] [--frontends 1,2,4] [--concurrency 1,64]
       [--protocols grpc,http] [--repeat 3] [--seconds 3] [--server-flags FLAGS]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.launch import ROOT, ServerProcess
from bench.perf import TRITON, binary, perf_run
from bench.run import SHAPES, Server, _PortFileServer, batch_totals, build_models, in_process_ceiling
from bench.versus import start

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def front_end_pids(pid: int) -> list[int]:
    """The server's front-end processes: the primary and its children but the model worker and
    multiprocessing's resource tracker."""
    pids = [pid]
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            maps = Path(f"/proc/{child}/maps").read_text()
        except OSError:
            continue
        if b"resource_tracker" in cmdline or "libtensorflow" in maps:
            continue
        pids.append(child)
    return pids


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


@dataclass
class Measured:
    req_per_s: float
    p50_ms: float
    p99_ms: float
    cores: float
    """Front-end CPU over the run's wall time."""
    cpu_us: float
    """Front-end CPU per request."""
    rows_per_run: float | None


@dataclass
class Target:
    """What one row drives: where, with which perf_analyzer kind and -i, whose CPU is counted, and
    where its rows per run are read (None: a server without /metrics)."""

    address: str
    kind: str
    protocol: str
    pid: int
    rest_port: int | None


def ours(server: ServerProcess, protocol: str) -> Target:
    port = server.port if protocol == "grpc" else server.rest_port
    return Target(f"127.0.0.1:{port}", TRITON, protocol, server.process.pid, server.rest_port)


def wire_ceiling(server: Server) -> Target:
    return Target(server.target, "tfserving", "grpc", server.pid, None)


def measure(target: Target, model: str, level: int, seconds: float, work: Path) -> Measured:
    name, shape = SHAPES[model]
    pids = front_end_pids(target.pid)

    def rows_so_far() -> tuple[float, float] | None:
        return None if target.rest_port is None else batch_totals("127.0.0.1", str(target.rest_port))

    before_rows = rows_so_far()
    cpu_before, started = cpu_seconds(pids), time.perf_counter()
    os.environ["TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT"] = "1"  # a connection per caller
    path = binary()
    assert path is not None, "perf_analyzer is not installed (make bench installs it)"
    run = perf_run(path, target.address, model, name, shape, level, seconds, target.kind, work / "perf.csv",
                   target.protocol)
    cpu, wall = cpu_seconds(pids) - cpu_before, time.perf_counter() - started
    after_rows = rows_so_far()
    rows = None
    if before_rows and after_rows and after_rows[1] > before_rows[1]:
        rows = (after_rows[0] - before_rows[0]) / (after_rows[1] - before_rows[1])
    # perf_analyzer runs a few windows and starts up: CPU over the whole wall time, per request at its rate
    return Measured(run.req_per_s, run.p50_ms, run.p99_ms, cpu / wall, cpu * 1e6 / max(run.req_per_s * wall, 1.0),
                    rows)


def fixed_servers(model: str, base: Path, counts: list[int], work: Path) -> dict[int, Server]:
    """The fixed-response server at each N, replaying the model's answer to one random row."""
    input_file, response = work / "input.npy", work / "response.pb"
    np.save(input_file, np.random.default_rng(0).standard_normal(SHAPES[model][1]).astype(np.float32))
    in_process_ceiling(model, base, input_file, response, 0.1)  # writes the response (and its metadata)
    starting = {n: _PortFileServer("bench.fixed_server", [str(response), "--processes", str(n)], work, f"fixed-{n}")
                for n in counts}
    try:
        return {n: server.wait() for n, server in starting.items()}
    except BaseException:
        for server in starting.values():
            server.stop()
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=sorted(SHAPES))
    parser.add_argument("--frontends", default="1,2,4")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--server-flags", default="")
    parser.add_argument("--protocols", default="grpc,http", help="perf_analyzer's -i: grpc, http (v2 REST), or both")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "frontends")
    opts = parser.parse_args(argv)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    base = build_models([opts.model], opts.out / "models")[opts.model]
    counts = [int(n) for n in opts.frontends.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        servers: dict[int, ServerProcess] = {}
        fixed: dict[int, Server] = {}
        try:
            servers.update({n: start(ROOT, base, [*shlex.split(opts.server_flags), "--frontends", str(n)],
                                     work / f"server-{n}.log") for n in counts})
            if "grpc" in opts.protocols.split(","):
                fixed.update(fixed_servers(opts.model, base, counts, work))
            say(f"# {opts.model}, perf_analyzer (a connection per caller), medians of {opts.repeat}")
            say("| protocol | callers | frontends | req/s | p50 ms | p99 ms | front-end cores | front-end µs/req "
                "| rows/run |")
            say("|---|---|---|---|---|---|---|---|---|")
            levels = [(protocol, int(c)) for protocol in opts.protocols.split(",") for c in opts.concurrency.split(",")]
            if fixed:
                levels += [("fixed", int(c)) for c in opts.concurrency.split(",")]
            for protocol, level in levels:
                runs: dict[int, list[Measured]] = {n: [] for n in counts}
                for turn in range(opts.repeat):
                    for n in counts if turn % 2 == 0 else list(reversed(counts)):
                        target = wire_ceiling(fixed[n]) if protocol == "fixed" else ours(servers[n], protocol)
                        runs[n].append(measure(target, opts.model, level, opts.seconds, work))
                base_rate = statistics.median(r.req_per_s for r in runs[counts[0]])
                label = "fixed response, gRPC (TF Serving kind)" if protocol == "fixed" else f"{protocol} (Triton kind)"
                for n in counts:
                    rs = runs[n]
                    rate = statistics.median(r.req_per_s for r in rs)
                    rows = [r.rows_per_run for r in rs if r.rows_per_run is not None]
                    rows_text = f"{statistics.median(rows):.1f}" if rows else "-"
                    p50, p99 = statistics.median(r.p50_ms for r in rs), statistics.median(r.p99_ms for r in rs)
                    cores, cpu_us = statistics.median(r.cores for r in rs), statistics.median(r.cpu_us for r in rs)
                    say(f"| {label} | {level} | {n} | {rate:,.0f} ({rate / base_rate:.2f}x) | {p50:.3f} | "
                        f"{p99:.3f} | {cores:.2f} | {cpu_us:.0f} | {rows_text} |")
            say("")
            for n, server in servers.items():
                sizes = [rss_mb(pid) for pid in front_end_pids(server.process.pid)]
                say(f"- {n} front-ends: RSS of each, MB: {', '.join(f'{size:.0f}' for size in sizes)}")
        finally:
            for server in servers.values():
                server.stop()
            for fixed_server in fixed.values():
                fixed_server.stop()
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"frontends-{opts.model}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
