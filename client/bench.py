"""`python -m client bench`: a load generator that does not hide queueing.

- Closed loop: C callers, each sending its next request as soon as the last one is answered.
- Open loop: requests start at Poisson arrival times of a given rate, whether or not earlier ones
  were answered, and latency is measured from the *scheduled* start, so a slow server cannot
  slow the arrivals down and hide its own queueing (coordinated omission).

Requests are serialized once and sent as raw bytes, and responses are not decoded, so the
generator spends as little CPU as it can on the machine it shares with the server. Each answer's
own server time (the `mirrorserve-server-seconds` trailer, or REST's `Server-Timing` total) is
kept beside the client's: on a machine the client shares with the server, the client's figure
also holds the client's own delays; a latency target governs the server's. A warm-up
period runs first; only calls that complete inside the measured window count. Over the same
window it reports the CPU it used per request, and, given the server's process ids, the server's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass

import aiohttp
import grpc

from client.cpu import CpuWindow

PREDICT_PATH = "/tensorflow.serving.PredictionService/Predict"
"""The method a payload is sent to: TF Serving's Predict, or (client.v2) the v2 ModelInfer."""

SERVER_TRAILER = "mirrorserve-server-seconds"
"""The server's own time for a call (server.api.request_timing), in its trailing metadata..."""
SERVER_TIMING_TOTAL = re.compile(r"(?:^|,)\s*total;dur=([0-9.]+)")
"""...and in a REST answer's Server-Timing header, in milliseconds."""

Send = Callable[[], Awaitable[tuple[str, float | None]]]
"""Send the payload once; the answer's status code name (OK, or what went wrong), and the server's
own time for it in seconds (None when the server does not tell)."""
Connect = Callable[[], AbstractAsyncContextManager[Send]]
"""Opens one connection (a gRPC channel, or an HTTP session) for a whole run."""


def grpc_connection(target: str, payload: bytes, path: str = PREDICT_PATH, timeout: float = 30.0) -> Connect:
    @contextlib.asynccontextmanager
    async def connect() -> AsyncIterator[Send]:
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.unary_unary(path)

            async def send() -> tuple[str, float | None]:
                pending = call(payload, timeout=timeout)
                try:
                    await pending
                except grpc.aio.AioRpcError as exc:
                    return str(exc.code().name), None
                told = dict(await pending.trailing_metadata() or ())
                value = told.get(SERVER_TRAILER)
                return "OK", float(value) if isinstance(value, str) else None

            yield send

    return connect


def http_connection(url: str, payload: bytes, timeout: float = 30.0) -> Connect:
    """POSTs of a JSON payload; 200 is OK, any other status is HTTP_<status>."""

    @contextlib.asynccontextmanager
    async def connect() -> AsyncIterator[Send]:
        headers = {"Content-Type": "application/json"}
        limits = aiohttp.ClientTimeout(total=timeout)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=limits) as session:

            async def send() -> tuple[str, float | None]:
                try:
                    async with session.post(url, data=payload, headers=headers) as response:
                        await response.read()
                        if response.status != 200:
                            return f"HTTP_{response.status}", None
                        found = SERVER_TIMING_TOTAL.search(response.headers.get("Server-Timing", ""))
                        return "OK", float(found.group(1)) / 1e3 if found else None
                except (aiohttp.ClientError, TimeoutError) as exc:
                    return type(exc).__name__, None

            yield send

    return connect


@dataclass(frozen=True)
class BenchResult:
    mode: str
    """closed or open."""
    concurrency: int
    rate: float
    rows: int
    seconds: float
    requests: int
    codes: dict[str, int]
    req_per_s: float
    """OK answers per second."""
    rows_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    client_cpu_us: float | None = None
    """CPU microseconds this load generator used per request in the measured window."""
    server_cpu_us: float | None = None
    """Same, for the watched server processes themselves (None when none were given)..."""
    server_children_cpu_us: float | None = None
    """...and for their children (this server's model worker)."""
    offered: int | None = None
    """Open loop: requests scheduled inside the measured window. Those still unanswered at its end are
    in none of the other figures: `offered - requests` well above 0 means the server fell behind."""
    server_p50_ms: float | None = None
    """The OK answers' own server time (their trailers / Server-Timing), None when none told it."""
    server_p99_ms: float | None = None
    within_ms: float | None = None
    """--within-ms: the bound the next two count against (a latency target)..."""
    within_per_s: float | None = None
    """...OK answers a second whose client-side latency was within it..."""
    server_within_per_s: float | None = None
    """...and those whose server time was (goodput, as a latency target counts it)."""


def _percentile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Sample = tuple[float, str, float | None]
"""A call completed in the measured window: its latency (seconds), status code name, server time."""


def summarize(mode: str, concurrency: int, rate: float, rows: int, seconds: float,
              samples: list[Sample], cpu: CpuWindow | None = None,
              offered: int | None = None, within_ms: float | None = None) -> BenchResult:
    """samples: the calls completed in the window; cpu: what the processes used over that window,
    shared out over those calls; within_ms: a bound to count OK answers against."""
    codes = Counter(code for _, code, _ in samples)
    ok = sorted(lat for lat, code, _ in samples if code == "OK")
    ms = [x * 1e3 for x in ok]
    told = sorted(server * 1e3 for _, code, server in samples if code == "OK" and server is not None)
    within = server_within = None
    if within_ms is not None:
        within = sum(1 for x in ms if x <= within_ms) / seconds
        server_within = sum(1 for x in told if x <= within_ms) / seconds if told else None

    def per_request(seconds_used: float | None) -> float | None:
        return None if seconds_used is None or not samples else seconds_used / len(samples) * 1e6

    return BenchResult(
        mode=mode, concurrency=concurrency, rate=rate, rows=rows, seconds=seconds, requests=len(samples),
        codes=dict(codes), req_per_s=len(ok) / seconds, rows_per_s=len(ok) * rows / seconds,
        p50_ms=_percentile(ms, 0.5), p90_ms=_percentile(ms, 0.9), p99_ms=_percentile(ms, 0.99),
        p999_ms=_percentile(ms, 0.999), max_ms=ms[-1] if ms else float("nan"),
        client_cpu_us=per_request(cpu.own_s if cpu else None),
        server_cpu_us=per_request(cpu.watched_s if cpu else None),
        server_children_cpu_us=per_request(cpu.children_s if cpu else None), offered=offered,
        server_p50_ms=_percentile(told, 0.5) if told else None, server_p99_ms=_percentile(told, 0.99) if told else None,
        within_ms=within_ms, within_per_s=within, server_within_per_s=server_within,
    )


def _open_cpu_window(watched: Sequence[int], warmup_s: float) -> CpuWindow:
    """A CPU window that opens with the measured window (a timer on the running loop); close it
    with _close_cpu_window."""
    window = CpuWindow(watched)
    asyncio.get_running_loop().call_later(warmup_s, window.begin)
    return window


async def _close_cpu_window(window: CpuWindow, end: float) -> None:
    """Close the window when the measured window ends (a run's last answer may come before)."""
    delay = end - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    window.end()


async def closed_loop(connect: Connect, concurrency: int, warmup_s: float, seconds: float, rows: int,
                      cpu_of: Sequence[int] = (), within_ms: float | None = None) -> BenchResult:
    samples: list[Sample] = []
    async with connect() as send:
        start = time.perf_counter() + warmup_s
        end = start + seconds
        cpu = _open_cpu_window(cpu_of, warmup_s)

        async def caller() -> None:
            while True:
                sent = time.perf_counter()
                if sent >= end:
                    return
                code, server = await send()
                done = time.perf_counter()
                if start <= done <= end:
                    samples.append((done - sent, code, server))

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        await _close_cpu_window(cpu, end)
    return summarize("closed", concurrency, 0.0, rows, seconds, samples, cpu, within_ms=within_ms)


async def open_loop(connect: Connect, rate: float, warmup_s: float, seconds: float, rows: int, seed: int = 0,
                    cpu_of: Sequence[int] = (), within_ms: float | None = None) -> BenchResult:
    samples: list[Sample] = []
    rng = random.Random(seed)
    async with connect() as send:
        origin = time.perf_counter()
        start = origin + warmup_s
        end = start + seconds
        cpu = _open_cpu_window(cpu_of, warmup_s)
        tasks: set[asyncio.Task[None]] = set()
        offered = 0

        async def one(scheduled: float) -> None:
            code, server = await send()
            done = time.perf_counter()
            if start <= done <= end:
                samples.append((done - scheduled, code, server))  # from the scheduled start

        scheduled = origin
        while True:
            scheduled += rng.expovariate(rate)
            if scheduled >= end:
                break
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if scheduled >= start:
                offered += 1
            task = asyncio.create_task(one(scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
        await _close_cpu_window(cpu, end)
    return summarize("open", 0, rate, rows, seconds, samples, cpu, offered, within_ms)


def table(results: Sequence[BenchResult]) -> str:
    header = ("mode", "load", "rows", "req/s", "rows/s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms",
              "server's own p50 / p99 ms", "client CPU µs/req", "server CPU µs/req", "its children's CPU µs/req",
              "codes")
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for r in results:
        load = f"C={r.concurrency}" if r.mode == "closed" else f"{r.rate:g}/s"
        codes = " ".join(f"{k}={v}" for k, v in sorted(r.codes.items()))
        lines.append(" | ".join((r.mode, load, str(r.rows), f"{r.req_per_s:.0f}", f"{r.rows_per_s:.0f}",
                                 f"{r.p50_ms:.2f}", f"{r.p90_ms:.2f}", f"{r.p99_ms:.2f}", f"{r.p999_ms:.2f}",
                                 f"{r.max_ms:.2f}", _own(r), _us(r.client_cpu_us), _us(r.server_cpu_us),
                                 _us(r.server_children_cpu_us), codes)))
    return "\n".join(lines)


def _own(r: BenchResult) -> str:
    if r.server_p50_ms is None or r.server_p99_ms is None:
        return "-"
    return f"{r.server_p50_ms:.2f} / {r.server_p99_ms:.2f}"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def to_json(results: Sequence[BenchResult]) -> str:
    return json.dumps([asdict(r) for r in results])
