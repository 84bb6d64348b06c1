"""The minimal 64 / 2 ms batcher: the reference that `make bench`'s goals compare this server against.

What a user could write in an afternoon to batch TF Serving Predict calls for one SavedModel: a
grpc.aio server with one generic handler that parses each request and puts its input on a queue,
and one batch loop that takes the first queued request, waits up to 2 ms (or until 64 rows) for
more, concatenates them, calls the model on one worker thread, splits the rows back and answers
each caller. It runs on the same event loop as this server (server.event_loop's default).

It deliberately leaves out everything else this server does: no model worker process (the model
runs in the server's own process, sharing its GIL), no adaptive wait (always up to 2 ms, even
when one caller is waiting alone), a single batch executing at a time, no request validation
beyond parsing, no deadlines, overload protection, metrics, health, versions or other signatures.
A request is one input tensor whose first dimension is its rows.

usage: python -m bench.reference_batcher PORT_FILE MODEL_BASE [max_rows (64)] [wait_ms (2)]
Serves the highest numeric version under MODEL_BASE on 127.0.0.1 (a free port, written to
PORT_FILE once it serves) until SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tensorflow as tf

from bench.metadata import metadata_response
from protos.tensorflow_serving import predict_pb2
from server import event_loop
from server.api.tensor_codec import to_ndarray, to_tensor_proto

MAX_TENSOR_BYTES = 1 << 30


@dataclass
class Pending:
    rows: np.ndarray
    answer: asyncio.Future[bytes] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Batcher:
    def __init__(self, model_base: Path, max_rows: int, wait_s: float) -> None:
        version = max((p for p in model_base.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        self.name, self.version = model_base.name, int(version.name)
        self.signature = tf.saved_model.load(str(version)).signatures["serving_default"]
        self.metadata = metadata_response(version, self.name, self.version)
        (self.input_name,) = self.signature.structured_input_signature[1]
        self.max_rows, self.wait_s = max_rows, wait_s
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    def warm_up(self) -> None:
        spec = self.signature.structured_input_signature[1][self.input_name]
        shape = [1 if d is None else d for d in spec.shape.as_list()]
        self.run_model(np.zeros(shape, spec.dtype.as_numpy_dtype))

    def run_model(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        return {name: value.numpy() for name, value in self.signature(**{self.input_name: batch}).items()}

    async def get_model_metadata(self, request_bytes: bytes, context: Any) -> bytes:
        """The model's metadata, for clients that read it first (perf_analyzer's tfserving kind)."""
        return self.metadata

    async def predict(self, request_bytes: bytes, context: Any) -> bytes:
        request = predict_pb2.PredictRequest.FromString(request_bytes)
        if list(request.inputs) != [self.input_name]:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"expected one input, '{self.input_name}'")
        pending = Pending(to_ndarray(request.inputs[self.input_name], name=self.input_name,
                                     max_bytes=MAX_TENSOR_BYTES))
        self.queue.put_nowait(pending)
        return await pending.answer

    async def next_batch(self, held: Pending | None) -> tuple[list[Pending], Pending | None]:
        """The requests of the next batch, and one that did not fit, held for the batch after."""
        batch = [held if held is not None else await self.queue.get()]
        rows = len(batch[0].rows)
        deadline = asyncio.get_running_loop().time() + self.wait_s  # the loop's clock is monotonic
        while rows < self.max_rows:
            if self.queue.empty():
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    async with asyncio.timeout(remaining):
                        item = await self.queue.get()
                except TimeoutError:
                    break
            else:
                item = self.queue.get_nowait()
            if rows + len(item.rows) > self.max_rows:
                return batch, item
            batch.append(item)
            rows += len(item.rows)
        return batch, None

    async def batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        held: Pending | None = None
        while True:
            batch, held = await self.next_batch(held)
            try:
                inputs = np.concatenate([p.rows for p in batch]) if len(batch) > 1 else batch[0].rows
                outputs = await loop.run_in_executor(self.worker, self.run_model, inputs)
            except Exception as exc:  # the model refused the input: each caller gets the error
                for p in batch:
                    if not p.answer.done():
                        p.answer.set_exception(exc)
                continue
            start = 0
            for p in batch:
                end = start + len(p.rows)
                response = predict_pb2.PredictResponse()
                response.model_spec.name, response.model_spec.signature_name = self.name, "serving_default"
                response.model_spec.version.value = self.version
                for name, value in outputs.items():
                    response.outputs[name].CopyFrom(to_tensor_proto(value[start:end]))
                if not p.answer.done():  # the caller may have gone
                    p.answer.set_result(response.SerializeToString())
                start = end


async def serve(port_file: Path, model_base: Path, max_rows: int, wait_ms: float) -> None:
    batcher = Batcher(model_base, max_rows, wait_ms / 1000)
    batcher.warm_up()
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler("tensorflow.serving.PredictionService", {
        "Predict": grpc.unary_unary_rpc_method_handler(batcher.predict),
        "GetModelMetadata": grpc.unary_unary_rpc_method_handler(batcher.get_model_metadata)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    batching = asyncio.create_task(batcher.batch_loop())
    port_file.write_text(str(port))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)
    batching.cancel()
    batcher.worker.shutdown(wait=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    event_loop.run(serve(Path(args[0]), Path(args[1]), int(args[2]) if len(args) > 2 else 64,
                         float(args[3]) if len(args) > 3 else 2.0), event_loop.NAMES[0])
