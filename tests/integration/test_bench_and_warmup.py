"""The benchmark in miniature (what `make bench` runs at full length), the load generator's open
loop, and the promises of warm-up: no trace after SERVING, and no slow first request."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.api import build_predict_request
from protos.tensorflow_serving import prediction_service_pb2_grpc
from tests.integration.conftest import ROOT, start_server


def test_latency_target_bench_smoke(tmp_path: Path) -> None:
    """bench.latency_target end to end in seconds: every server answers, every point and goal is
    written; no timing is asserted (the full run, in `make bench`, is what docs/performance.md shows)."""
    done = subprocess.run([sys.executable, "-m", "bench.latency_target", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads((tmp_path / "latency-target.json").read_text())
    points = found["mlp"]["points"]
    assert found["mlp"]["target_ms"] == 10.0 and found["mlp"]["capacity"] > 0
    assert {(p["server"], p["load"]) for p in points} == {
        (server, load) for server in ("target", "max 64 / 2 ms", "max 8 / 0 ms") for load in (0.6, 1.5)}
    assert all(p["codes"].get("OK", 0) > 0 and p["goodput"] >= 0 for p in points), points
    assert len(found["goals"]) == 3
    markdown = (tmp_path / "latency-target.md").read_text()
    assert "| 60% |" in markdown and "| 150% |" in markdown and "best fixed" in markdown


def test_bench_suite_smoke(tmp_path: Path) -> None:
    """A minute, not an hour; no timing is asserted, only that every figure and every goal is produced."""
    done = subprocess.run([sys.executable, "-m", "bench.suite", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    mlp = results["mlp"]
    assert set(mlp["inprocess"]) == {"1", "16", "64"} and all(v > 0 for v in mlp["inprocess"].values())
    before, after = mlp["inprocess_runs"]  # measured before the servers and after; the better counts
    assert mlp["inprocess"] == {b: max(before[b], after[b]) for b in before}
    assert 0 < mlp["inprocess_1_row_ms"] == min(mlp["inprocess_1_row_ms_runs"])
    assert set(mlp["inprocess_cpu_us_per_row"]) == {"1", "16", "64"}
    assert all(v > 0 for v in mlp["inprocess_cpu_us_per_row"].values())
    for label in ("fixed", "off", "default", "reference", "v2", "rest"):
        assert [r["concurrency"] for r in mlp[label]] == [1, 64]
        assert all(r["codes"] == {"OK": r["requests"]} and r["req_per_s"] > 0 for r in mlp[label]), mlp[label]
        assert all(r["client_cpu_us"] > 0 and r["server_cpu_us"] > 0 for r in mlp[label]), mlp[label]
    # rows per batch from each of our servers' /metrics (the others have none); off batches nothing
    assert [r["rows_per_batch"] for r in mlp["off"]] == [1.0, 1.0]
    assert all(r["rows_per_batch"] >= 1.0 for r in mlp["default"]) and "rows_per_batch" not in mlp["fixed"][0]
    # the open-loop sweep: at half the default server's req/s at 64 clients, each server in turn
    assert mlp["capacity_clients"] == 64 and mlp["capacity_req_per_s"] == mlp["default"][1]["req_per_s"]
    (point,) = mlp["sweep"]
    assert point["fraction"] == 0.5 and abs(point["rate"] - mlp["capacity_req_per_s"] / 2) < 0.1
    for label in ("off", "default", "reference"):
        (run,) = point[label]["runs"]
        assert run["mode"] == "open" and run["rate"] == point["rate"] and run["requests"] > 0, run
        assert point[label]["p50_ms_median"] is None or point[label]["p50_ms_median"] > 0
    goals = results["goals"]
    assert sorted(goals) == ["a", "b", "c", "d"] and all(g["status"] in ("PASS", "FAIL") for g in goals.values())
    assert set(goals["a"]["figures"]) == set(goals["c"]["figures"]) == set(goals["d"]["figures"]) == {"mlp"}
    assert len(goals["b"]["figures"]) == 4  # p50 and p99, against batching off and the reference
    reach = goals["a"]["figures"]["mlp"]  # what this machine allowed any server, by the run's figures
    assert 0 < reach["reach_req_per_s"] <= mlp["fixed"][1]["req_per_s"] and reach["reach_ratio"] > 0
    assert "(reach " in goals["a"]["summary"]
    # perf_analyzer beside our client: each server over TF Serving's Predict, ours over Triton's kind too
    perf = mlp["perf_analyzer"]
    assert set(perf) == {"fixed", "off", "default", "reference", "triton"}
    assert all(len(runs) == 2 and all(r["req_per_s"] > 0 and r["p50_ms"] > 0 and r["client_cpu_us"] > 0 for r in runs)
               for runs in perf.values())
    assert all(r["server_us"] is None for label in ("fixed", "reference") for r in perf[label])
    assert all(set(r["server_us"]) == {"queue", "compute_input", "compute_infer", "compute_output"}
               for r in perf["triton"])
    table = (tmp_path / "results.md").read_text()
    print(table)
    assert table.index("## Goals") < table.index("## mlp")
    assert "perf_analyzer (Triton's C++ client" in table
    assert all(f"- {key}) " in table for key in "abcd") and "worst round" in table
    assert "default rows per batch" in table and "| 1 |" in table and "| 64 |" in table and "| 50% |" in table
    assert "default / fixed" in table and "default / reference" in table and "CPU per request" in table
    assert "fixed-response: load generator" in table  # the client's CPU in each server's runs
    assert "CPU per row, every thread of the process" in table
    assert "v2 / Predict CPU" in table and "REST / Predict CPU" in table


def test_client_bench_open_loop(server_for, tmp_path: Path) -> None:
    server = server_for("echo", "--max-batch-size", "8")
    np.save(tmp_path / "x.npy", np.array([[1, 2]], np.int64))
    done = subprocess.run(
        [sys.executable, "-m", "client", "bench", "--target", server.target, "--model", "echo",
         "--rate", "200", "--warmup-s", "0.2", "--seconds", "1", "--json", str(tmp_path / "out.json"),
         "--cpu-of", str(server.process.pid)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "out.json").read_text())
    print(done.stdout.splitlines()[2])
    assert result["mode"] == "open" and result["rate"] == 200
    assert result["codes"] == {"OK": result["requests"]}
    assert 100 < result["requests"] < 300  # Poisson arrivals at 200/s over 1 s
    assert 0 < result["p50_ms"] <= result["p99_ms"] <= result["max_ms"]
    assert result["client_cpu_us"] > 0 and result["server_cpu_us"] > 0  # the server and its model worker


PAUSE_S = 0.02
LAZY_SET_UP_MARGIN_S = 0.010
STEADY_REQUESTS = 150


def test_no_trace_after_serving_and_fast_first_request(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    server = start_server(["--model-base-path", str(model_dirs["demo"]), "--model-name", "demo",
                           "--replicas", "2", "--max-batch-size", "16"], tmp_path / "server.log", ready=False)
    row = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    one_row = build_predict_request("demo", {"x": row})
    try:
        with grpc.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            serving = health_pb2.HealthCheckResponse.SERVING
            # While the model loads, one Predict is refused: it pays the client's and gRPC's
            # first-call costs, so the timed call below measures the server's first model request.
            try:
                stub.Predict(one_row, timeout=10)
                raise AssertionError("the server answered before loading")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            deadline = time.monotonic() + 120
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != serving:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # Every timed request follows the same idle pause: after a pause the model's threads
            # have gone to sleep and caches are cold, which any request after a lull pays. What
            # must not happen is a first request paying more than that (a trace, a lazy set-up).
            time.sleep(PAUSE_S)
            started = time.perf_counter()
            stub.Predict(one_row, timeout=10)
            first = time.perf_counter() - started
            traces_at_start = server.metric("mirrorserve_tf_function_traces_total", model="demo")

            async def mixed() -> None:
                async with grpc.aio.insecure_channel(server.target) as aio_channel:
                    aio_stub = prediction_service_pb2_grpc.PredictionServiceStub(aio_channel)
                    sizes = [*range(1, 17), 40] * 3  # every size up to the budget, and one over it
                    await asyncio.gather(*(aio_stub.Predict(build_predict_request(
                        "demo", {"x": np.repeat(row, n, axis=0)}), timeout=30) for n in sizes))

            asyncio.run(mixed())
            steady = []
            for _ in range(STEADY_REQUESTS):
                time.sleep(PAUSE_S)
                started = time.perf_counter()
                stub.Predict(one_row, timeout=10)
                steady.append(time.perf_counter() - started)
            traces_after = server.metric("mirrorserve_tf_function_traces_total", model="demo")
    finally:
        server.stop()
    p99 = sorted(steady)[int(0.99 * len(steady))]
    print(f"first request after SERVING {first * 1e3:.2f} ms; steady state p50 "
          f"{statistics.median(steady) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms; traces {traces_at_start:.0f} -> "
          f"{traces_after:.0f}")
    assert traces_at_start == traces_after == 2  # at load: one program per count of replicas in use, 1 and 2
    # What warm-up saves is large: with both warm-ups removed the first request took 29.2-29.7 ms
    # against a steady median of 2.8-3.1 ms. What remains is the front-end's first run of its
    # Python (0.3-1 ms) and the machine's noise, which reached the first request as well as the
    # p99 on a busy CI machine (6.4 against 5.8 ms). So the bound is the steady p99 plus a margin
    # of a third of that saving: it passes noise and fails on the lazy set-up.
    assert first <= p99 + LAZY_SET_UP_MARGIN_S
