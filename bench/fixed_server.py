"""The wire ceiling: a grpc.aio server answering every Predict with one precomputed response (and
GetModelMetadata with the model's, written beside it by bench.inprocess, for clients that read it
first).

It does what any Python gRPC server must (accept the call, hand it to the event loop, send a
response) and nothing else: no parsing, no model. Nothing a real server does can be faster.
It runs on the same event loop as this server's default (uvloop), which is also the faster one:
the ceiling must be the best a Python gRPC server can do. A third argument picks another loop.

With --processes N it is N such processes on one port (SO_REUSEPORT, as --frontends N is), so
the ceiling moves with the front-end count: the first binds, the others join the port it got, and
PORT_FILE is written once all of them serve. SIGTERM to the first stops them all.

usage: python -m bench.fixed_server PORT_FILE RESPONSE_FILE [uvloop|asyncio] [--processes N]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from bench.metadata import metadata_file
from server import event_loop

REUSE_PORT = [("grpc.so_reuseport", 1)]


def _join(port_file: Path, response_file: Path, loop: str, port: int, index: int) -> subprocess.Popen[bytes]:
    """Start one more process on `port`; it writes its own port file (PORT_FILE.INDEX) when it serves."""
    return subprocess.Popen([sys.executable, "-m", "bench.fixed_server", f"{port_file}.{index}", str(response_file),
                             loop, "--join", str(port)])


def _wait_for(files: list[Path], joined: list[subprocess.Popen[bytes]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        if any(p.poll() is not None for p in joined) or time.monotonic() > deadline:
            raise RuntimeError("a joining fixed-server process did not start")
        time.sleep(0.05)


async def serve(port_file: Path, response_file: Path, loop: str, processes: int, join: int) -> None:
    response, metadata = response_file.read_bytes(), metadata_file(response_file).read_bytes()

    async def predict(request: bytes, context: Any) -> bytes:
        return response

    async def get_model_metadata(request: bytes, context: Any) -> bytes:
        return metadata

    server = grpc.aio.server(options=REUSE_PORT)
    handler = grpc.method_handlers_generic_handler("tensorflow.serving.PredictionService", {
        "Predict": grpc.unary_unary_rpc_method_handler(predict),
        "GetModelMetadata": grpc.unary_unary_rpc_method_handler(get_model_metadata)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"127.0.0.1:{join}")
    await server.start()
    joined = [_join(port_file, response_file, loop, port, i) for i in range(1, processes)]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await asyncio.to_thread(_wait_for, [Path(f"{port_file}.{i}") for i in range(1, processes)], joined)
        port_file.write_text(str(port))
        await stop.wait()
    finally:
        for process in joined:
            process.terminate()
        for process in joined:
            process.wait()
        await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port_file", type=Path)
    parser.add_argument("response_file", type=Path)
    parser.add_argument("loop", nargs="?", default=event_loop.NAMES[0])  # the server's default
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--join", type=int, default=0, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    event_loop.run(serve(opts.port_file, opts.response_file, opts.loop, opts.processes, opts.join), opts.loop)


if __name__ == "__main__":
    main()
