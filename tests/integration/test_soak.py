"""Soak: after warm-up, tens of thousands of mixed requests (good ones of every signature and
size, bad ones, expiring and cancelled ones) leave resident memory and open file descriptors flat.

`make test` sends SOAK_REQUESTS=20000 (the default here); `make soak` sends many more."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest

from client.api import build_predict_request
from protos.tensorflow_serving import prediction_service_pb2_grpc
from tests.integration.conftest import start_server
from tests.integration.test_overload import rss_bytes

REQUESTS = int(os.environ.get("SOAK_REQUESTS", "20000"))
CONCURRENCY = 32


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def mixed_requests(rng: random.Random) -> list[tuple[object, float, bool]]:
    """A pool of (request, timeout, cancel_early) covering the paths a server takes."""
    pool: list[tuple[object, float, bool]] = []
    for rows in (1, 2, 3, 7, 16, 40):
        a = np.full((rows, 3), rows, np.float32)
        b = np.arange(rows, dtype=np.int32)
        pool.append((build_predict_request("multi", {"a": a, "b": b}), 10.0, False))
        pool.append((build_predict_request("multi", {"a": a}, signature="total"), 10.0, False))
        words = np.array([b"x" * (i % 5) for i in range(rows)], dtype=object)
        pool.append((build_predict_request("multi", {"s": words}, signature="strlen"), 10.0, False))
    pool.append((build_predict_request("multi", {"a": np.zeros((2, 4), np.float32), "b": np.zeros(2, np.int32)}),
                 10.0, False))  # INVALID_ARGUMENT
    pool.append((build_predict_request("nope", {"a": np.zeros((1, 3), np.float32)}), 10.0, False))  # NOT_FOUND
    pool.append((build_predict_request("multi", {"a": np.ones((3, 3), np.float32), "b": np.ones(3, np.int32)}),
                 0.0005, False))  # mostly DEADLINE_EXCEEDED
    pool.append((build_predict_request("multi", {"a": np.ones((3, 3), np.float32), "b": np.ones(3, np.int32)}),
                 10.0, True))  # cancelled by the client
    rng.shuffle(pool)
    return pool


async def run(target: str, count: int, seed: int) -> Counter[str]:
    rng = random.Random(seed)
    pool = mixed_requests(rng)
    codes: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        next_index = 0

        async def worker() -> None:
            nonlocal next_index
            while next_index < count:
                request, timeout, cancel = pool[next_index % len(pool)]
                next_index += 1
                call = stub.Predict(request, timeout=timeout)
                if cancel:
                    await asyncio.sleep(0)
                    call.cancel()
                try:
                    await call
                    codes["OK"] += 1
                except asyncio.CancelledError:
                    codes["CANCELLED(client)"] += 1
                except grpc.aio.AioRpcError as exc:
                    codes[exc.code().name] += 1

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return codes


@pytest.mark.slow
def test_soak_leaves_memory_and_fds_flat(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    server = start_server(["--model-base-path", str(model_dirs["multi"]), "--model-name", "multi",
                           "--replicas", "2", "--max-batch-size", "32", "--batch-timeout-ms", "2"],
                          tmp_path / "server.log")
    try:
        pid = server.process.pid
        warmup = asyncio.run(run(server.target, max(REQUESTS // 4, 2000), seed=1))
        rss_0, fds_0 = rss_bytes(pid), open_fds(pid)
        started = time.monotonic()
        codes = Counter[str]()
        checkpoints = []
        for part in range(4):
            codes += asyncio.run(run(server.target, REQUESTS // 4, seed=10 + part))
            checkpoints.append((rss_bytes(pid) / 2**20, open_fds(pid)))
        elapsed = time.monotonic() - started
        rss_1, fds_1 = rss_bytes(pid), open_fds(pid)
        alive = server.process.poll() is None
    finally:
        server.stop()
    print(f"\nsoak: warm-up {sum(warmup.values())} requests, then {sum(codes.values())} in {elapsed:.1f}s: "
          f"{dict(codes)}; rss {rss_0 / 2**20:.1f} -> {rss_1 / 2**20:.1f} MiB, fds {fds_0} -> {fds_1}; "
          f"checkpoints (MiB, fds) {[(round(r, 1), f) for r, f in checkpoints]}")
    assert alive
    assert sum(codes.values()) == REQUESTS // 4 * 4
    assert set(codes) <= {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "DEADLINE_EXCEEDED", "CANCELLED",
                          "CANCELLED(client)"}, codes
    assert codes["OK"] > REQUESTS // 2
    assert rss_1 <= rss_0 * 1.05, "resident memory grew"
    assert abs(fds_1 - fds_0) <= max(2, fds_0 * 0.05), "file descriptors leaked"
