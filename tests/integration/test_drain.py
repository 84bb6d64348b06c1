"""SIGTERM under continuous concurrent load, over gRPC and REST together: every request the server
accepted completes OK, later ones fail fast with UNAVAILABLE (503 over REST), the process exits 0
within the grace period, and the server's own count of accepted requests equals the OKs the clients saw."""

from __future__ import annotations

import asyncio
import datetime
import re
import signal
import time
from pathlib import Path

import aiohttp
import grpc
import numpy as np

from client.api import build_predict_request
from protos.tensorflow_serving import prediction_service_pb2_grpc
from tests.integration.conftest import start_server

GRACE_S = 12.0
DRAIN_DELAY_S = 1.5
WORKERS = 16


REST_WORKERS = 4


async def load(target: str, rest_url: str, stop_at: list[float]) -> list[tuple[float, float, str]]:
    """Closed-loop workers, gRPC and REST; each result is (sent, answered, status code name), REST
    statuses named as their gRPC codes (a refused connection after exit counts as UNAVAILABLE)."""
    results: list[tuple[float, float, str]] = []
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    request = build_predict_request("demo", {"x": x})
    codes = {200: "OK", 503: "UNAVAILABLE"}
    async with grpc.aio.insecure_channel(target) as channel, aiohttp.ClientSession() as session:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)

        async def rest_worker() -> None:
            while not stop_at or time.monotonic() < stop_at[0]:
                sent = time.monotonic()
                try:
                    async with session.post(f"{rest_url}/v1/models/demo:predict",
                                            json={"instances": x.tolist()}) as response:
                        await response.read()
                        code = codes.get(response.status, f"HTTP_{response.status}")
                except aiohttp.ClientConnectorError:  # refused: the listener is closed
                    code = "UNAVAILABLE"
                except aiohttp.ClientConnectionError:  # in transit when the server closed the connection
                    code = "CANCELLED"
                results.append((sent, time.monotonic(), code))
                if code != "OK":
                    await asyncio.sleep(0.01)

        async def worker() -> None:
            while not stop_at or time.monotonic() < stop_at[0]:
                sent = time.monotonic()
                try:
                    await stub.Predict(request, timeout=GRACE_S)
                    code = "OK"
                except grpc.aio.AioRpcError as exc:
                    code = exc.code().name

                results.append((sent, time.monotonic(), code))
                if code != "OK":
                    await asyncio.sleep(0.01)

        await asyncio.gather(*(worker() for _ in range(WORKERS)), *(rest_worker() for _ in range(REST_WORKERS)))
    return results


def test_sigterm_drains_without_losing_accepted_requests(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    server = start_server(
        ["--model-base-path", str(model_dirs["demo"]), "--model-name", "demo", "--replicas", "2",
         "--batch-timeout-ms", "20", "--max-batch-size", "8",
         "--drain-delay-s", str(DRAIN_DELAY_S), "--grace-period-s", str(GRACE_S)],
        tmp_path / "server.log",
    )
    timeline: dict[str, float] = {}  # monotonic times, and the wall clock's offset from it

    async def scenario() -> list[tuple[float, float, str]]:
        stop_at: list[float] = []
        load_task = asyncio.create_task(load(server.target, server.rest_url, stop_at))
        await asyncio.sleep(2.0)
        timeline["sigterm"] = time.monotonic()
        timeline["wall_minus_monotonic"] = time.time() - timeline["sigterm"]
        server.process.send_signal(signal.SIGTERM)
        while server.process.poll() is None and time.monotonic() - timeline["sigterm"] < GRACE_S + 5:
            await asyncio.sleep(0.01)
        timeline["exited"] = time.monotonic()
        stop_at.append(time.monotonic() + 0.5)  # a little traffic after exit: refused connections
        return await load_task

    try:
        results = asyncio.run(scenario())
    finally:
        server.stop()
    codes: dict[str, int] = {}
    for _, _, code in results:
        codes[code] = codes.get(code, 0) + 1
    ok_after_sigterm = sum(1 for sent, _, code in results if code == "OK" and sent > timeline["sigterm"])
    refused = [(sent, done) for sent, done, code in results if code == "UNAVAILABLE"]
    exit_s = timeline["exited"] - timeline["sigterm"]
    match = re.search(r"drained: accepted=(\d+) answered=(\d+)", server.log())
    print(f"codes={codes} ok_after_sigterm={ok_after_sigterm} exit_after={exit_s:.2f}s "
          f"server_log={match.group(0) if match else None}")

    assert server.process.returncode == 0, server.log()[-3000:]
    assert exit_s < GRACE_S, exit_s
    refusal_point = timeline["sigterm"] + DRAIN_DELAY_S
    # grpc itself cancels the calls in transit at the instant it closes (after ours are done), and
    # HTTP connections close the same way: at most one per worker, only calls sent after the
    # refusal point. That point by the server's clock: DRAIN_DELAY_S after it handled the signal,
    # which under load is some milliseconds after it was sent (its log line, to the millisecond).
    refusing = re.search(r"^(\S+ \S+) INFO server: refusing new RPCs", server.log(), re.M)
    assert refusing, server.log()[-3000:]
    logged = datetime.datetime.strptime(refusing.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    refusal_point = max(refusal_point, logged - timeline["wall_minus_monotonic"] - 0.001)
    cancelled = [sent for sent, _, code in results if code == "CANCELLED"]
    assert len(cancelled) <= WORKERS + REST_WORKERS and all(sent > refusal_point for sent in cancelled), (
        refusal_point, timeline, cancelled)
    assert set(codes) <= {"OK", "UNAVAILABLE", "CANCELLED"}, codes
    assert ok_after_sigterm > 0, "nothing was accepted during the drain delay"
    assert refused, "no request was refused after the refusal point"
    assert max(done - sent for sent, done in refused) < 1.0, "refusals were not fast"
    assert match, server.log()[-3000:]
    accepted, answered = int(match.group(1)), int(match.group(2))
    assert accepted == answered == codes["OK"], (accepted, answered, codes)
