"""The tf.distribute side: which devices are replicas, and running one batch across all of them.

One MirroredStrategy serves every replica count, 1 included. A batch is split by rows into
contiguous, near-equal chunks (uneven splits and empty chunks are fine), the chunks become one
per-replica value, `strategy.run` executes the signature on every replica inside one `tf.function`,
and `strategy.experimental_local_results` hands back a tuple with one result per replica in every
case (never the `.values`-only-when-several-replicas trap). The outer function has an input
signature with an unknown batch dimension, so it is traced once per signature, not once per
combination of chunk sizes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from server.codec import dtype_enum
from server.core.assembly import Tensors, check_rows, concat_rows, replica_bounds
from server.core.signatures import Signature
from server.errors import ModelFailure

log = logging.getLogger(__name__)
# TensorFlow's logger prints through a handler of its own; let records reach ours instead.
tf.get_logger().handlers.clear()


def configure_threads(intra_op: int, inter_op: int) -> None:
    """TensorFlow's thread pools (0 keeps TensorFlow's choice); before the runtime starts."""
    if intra_op:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
    if inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)


def configure_devices(replicas: int | None) -> list[str]:
    """Pick the replica devices. Must run before anything initialises the TensorFlow runtime.

    With GPUs: the first `replicas` GPUs (default all). Without: `replicas` logical CPU devices
    (default 1) carved out of the one physical CPU.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        count = replicas or len(gpus)
        if count > len(gpus):
            raise ValueError(f"--replicas {count} asks for more replicas than the {len(gpus)} GPUs here")
        return [f"/device:GPU:{i}" for i in range(count)]
    count = replicas or 1
    cpu = tf.config.list_physical_devices("CPU")[0]
    if count > 1:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
        )
    return [d.name for d in tf.config.list_logical_devices("CPU")][:count]


def make_strategy(devices: list[str]) -> tf.distribute.Strategy:
    return tf.distribute.MirroredStrategy(devices)


class SignatureRunner:
    """Runs one signature of a loaded model over every replica of the strategy."""

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        function: Any,
        signature: Signature,
        *,
        on_trace: Callable[[], None] = lambda: None,
    ) -> None:
        self.signature = signature
        self.replicas = int(strategy.num_replicas_in_sync)
        specs = {
            name: tf.TensorSpec([None, *spec.shape[1:]], tf.as_dtype(dtype_enum(spec.dtype)), name=name)
            for name, spec in signature.inputs.items()
            if spec.shape is not None
        }

        def per_replica(chunk: dict[str, tf.Tensor]) -> Any:
            return function(**chunk)

        @tf.function(input_signature=[[specs] * self.replicas])
        def run_all(chunks: list[dict[str, tf.Tensor]]) -> Any:
            on_trace()  # Python side effect: runs only while tracing
            distributed = strategy.experimental_distribute_values_from_function(
                lambda ctx: chunks[ctx.replica_id_in_sync_group]
            )
            return strategy.experimental_local_results(strategy.run(per_replica, args=(distributed,)))

        # Calling the traced program directly skips tf.function's per-call dispatch (about 0.3 ms
        # a batch here); the input signature makes this the only program there will ever be.
        self._run_all = run_all.get_concrete_function()

    def __call__(self, batch: Tensors) -> Tensors:
        """Run one batch (blocking); outputs have the batch's rows in the same order."""
        rows = next(iter(batch.values())).shape[0]
        bounds = replica_bounds(rows, self.replicas)
        chunks = [{name: array[lo:hi] for name, array in batch.items()} for lo, hi in bounds]
        try:
            results = self._run_all(chunks)
        except tf.errors.OpError as exc:
            raise ModelFailure(f"signature '{self.signature.name}' failed on {rows} rows: {exc.message}") from exc
        outputs = []
        for replica, ((lo, hi), result) in enumerate(zip(bounds, results, strict=True)):
            arrays = {name: tensor.numpy() for name, tensor in result.items()}
            check_rows(arrays, hi - lo, f"replica {replica}")
            outputs.append(arrays)
        return concat_rows(outputs)

    def warm_up(self, sizes: Sequence[int]) -> None:
        """Run each batch size once (BatchingPolicy.warm_up_sizes), so neither tracing nor the
        kernels' first-use set-up for a new shape lands on a real request."""
        for rows in sizes:
            try:
                self(self.signature.example(rows))
            except Exception:
                # Tracing happened even if the model rejects zeros; real requests will tell.
                log.warning("warm-up of signature '%s' on %d rows of zeros failed", self.signature.name, rows,
                            exc_info=True)
                return
