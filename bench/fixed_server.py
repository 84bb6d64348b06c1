"""The wire ceiling: a grpc.aio server answering every Predict with one precomputed response (and
GetModelMetadata with the model's, written beside it by bench.inprocess, for clients that read it
first).

It does what any Python gRPC server must (accept the call, hand it to the event loop, send a
response) and nothing else: no parsing, no model. Nothing a real server does can be faster.
It runs on the same event loop as this server's default (uvloop), which is also the faster one:
the ceiling must be the best a Python gRPC server can do. A third argument picks another loop.
usage: python -m bench.fixed_server PORT_FILE RESPONSE_FILE [uvloop|asyncio]
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import grpc

from bench.metadata import metadata_file
from server import event_loop


async def serve(port_file: Path, response: bytes, metadata: bytes) -> None:
    async def predict(request: bytes, context: Any) -> bytes:
        return response

    async def get_model_metadata(request: bytes, context: Any) -> bytes:
        return metadata

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler("tensorflow.serving.PredictionService", {
        "Predict": grpc.unary_unary_rpc_method_handler(predict),
        "GetModelMetadata": grpc.unary_unary_rpc_method_handler(get_model_metadata)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_file.write_text(str(port))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


if __name__ == "__main__":
    loop = sys.argv[3] if len(sys.argv) > 3 else event_loop.NAMES[0]  # the server's default
    response_file = Path(sys.argv[2])
    event_loop.run(serve(Path(sys.argv[1]), response_file.read_bytes(), metadata_file(response_file).read_bytes()),
                   loop)
