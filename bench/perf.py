"""perf_analyzer, Triton's C++ load generator, as the bench's second client: the same servers,
models and concurrencies as `python -m client bench`, seen by the tool Triton users measure with.

Each server is driven through TF Serving's Predict (`--service-kind tfserving`, which reads
GetModelMetadata first: the reference batcher and the fixed server answer it too); this server also
through Triton's own kind over gRPC, whose figures include the server's split of a request's time
(queue, compute input, infer, output) read from its ModelStatistics. perf_analyzer averages its
last three windows of --seconds each; its client costs less CPU per request than the Python one,
which matters on a machine the client shares with the servers (docs/performance.md).
"""

from __future__ import annotations

import csv
import os
import resource
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.launch import ROOT

TRITON = "triton"
"""The label of this server driven with perf_analyzer's own (Triton) kind."""
SERVER_COLUMNS = {"queue": "Server Queue", "compute_input": "Server Compute Input",
                  "compute_infer": "Server Compute Infer", "compute_output": "Server Compute Output"}


def binary() -> str | None:
    """Where `make` installed perf_analyzer (PERF_ANALYZER, else .venv/perf_analyzer), or None."""
    path = os.environ.get("PERF_ANALYZER") or str(ROOT / ".venv" / "perf_analyzer" / "perf_analyzer")
    return path if Path(path).is_file() else None


@dataclass(frozen=True)
class PerfRun:
    req_per_s: float
    p50_ms: float
    p99_ms: float
    client_cpu_us: float
    """perf_analyzer's CPU per request: its whole run's CPU over (req/s x its wall time), so its
    start and unmeasured windows included (an estimate, a little high)."""
    server_us: dict[str, float] | None = None
    """The server's average split of a request (µs), from ModelStatistics: Triton kind only."""

    def to_json(self) -> dict[str, object]:
        return {"req_per_s": self.req_per_s, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
                "client_cpu_us": self.client_cpu_us, "server_us": self.server_us}


def perf_run(path: str, target: str, model: str, input_name: str, shape: tuple[int, ...], concurrency: int,
             seconds: float, kind: str, csv_file: Path, protocol: str = "grpc") -> PerfRun:
    """One perf_analyzer run at a fixed concurrency; `kind` is "tfserving" or TRITON; `protocol`
    (Triton kind only) "grpc" or "http" (v2 REST, a connection per caller)."""
    if kind == TRITON:
        args = ["-i", protocol, "-b", "1", "--shape", f"{input_name}:{','.join(map(str, shape[1:]))}"]
    else:
        args = ["--service-kind", "tfserving", "-i", "grpc", "--shape", f"{input_name}:{','.join(map(str, shape))}"]
    command = [path, "-m", model, "-u", target, *args, "--concurrency-range", str(concurrency),
               "--measurement-interval", str(max(100, round(seconds * 1000))), "--stability-percentage", "100",
               "--max-trials", "3", "-f", str(csv_file)]
    cpu_before, started = _children_cpu(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120 + 10 * seconds, check=False)
    cpu_s, wall_s = _children_cpu() - cpu_before, time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({done.returncode}): {' '.join(command)}\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    with csv_file.open() as file:
        (row,) = list(csv.DictReader(file))
    server = {key: float(row[column]) for key, column in SERVER_COLUMNS.items()} \
        if SERVER_COLUMNS["queue"] in row else None
    req_per_s = float(row["Inferences/Second"])
    return PerfRun(req_per_s, float(row["p50 latency"]) / 1000, float(row["p99 latency"]) / 1000,
                   cpu_s * 1e6 / max(req_per_s * wall_s, 1.0), server)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
