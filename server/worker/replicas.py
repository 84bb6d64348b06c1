"""The tf.distribute side: which devices are replicas, and running one batch across all of them.

One MirroredStrategy serves every replica count, 1 included. A batch is split by rows into
contiguous, near-equal chunks (uneven splits are fine), the chunks become one per-replica value,
`strategy.run` executes the signature on every replica inside one `tf.function`, and
`strategy.experimental_local_results` hands back a tuple with one result per replica in every
case (never the `.values`-only-when-several-replicas trap). The outer function has an input
signature with an unknown batch dimension, so it is traced once per signature and count of
replicas in use (below), not once per combination of chunk sizes.

Empty chunks are not fine: convolution and batch-norm kernels may refuse a zero-row tensor
(oneDNN's, chosen per CPU, did for a small convnet and for MobileNetV2; GPU kernels are not known
to be safe either). So a batch with fewer rows than replicas runs on as many replicas as it has
rows (assembly.shard_bounds), one row each. Every replica still takes part in `strategy.run`; one
past those in use is handed nothing the model sees and returns zero-row outputs without running
it. That takes one program per count of replicas in use, 1 to all, each traced once at load and
run in the warm-up. The other way, giving each idle replica a copy of a real row to run and
dropping its answer, needs one program but costs a row's work per idle replica: on the logical
CPU devices of a 2-core machine, which share the cores, a 1-row batch of the bench's cnn took 1.6x
as long on 2 replicas and 2.5x on 4 (docs/performance.md has the figures).

With one replica on a CPU, the program runs on TensorFlow's single-threaded executor: its ops run
one after another on the thread that calls it, instead of each being handed to the inter-op
threads and its result handed back (kernels still split their own work over the intra-op
threads). A small batch then pays no wake-up of another thread per op, and a big one loses
nothing (docs/performance.md has the figures). That executor refuses some graphs (old-style
control flow, asynchronous kernels), so a program falls back to the default executor when its
first warm-up call fails on the single-threaded one. With several replicas the default executor
runs them side by side, so it stays.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from server.core.assembly import Tensors, check_rows, concat_rows, shard_bounds
from server.core.signatures import GENERATED_ROWS, Signature
from server.core.version_folders import WARMUP_FILE
from server.dtypes import dtype_enum
from server.errors import ModelError, ModelFailure

log = logging.getLogger(__name__)
SINGLE_THREADED = "SINGLE_THREADED_EXECUTOR"
DEFAULT_EXECUTOR = ""
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

    With GPUs: the first `replicas` GPUs (default all); with one GPU and more replicas, that many
    logical GPUs carved out of it, each with an equal share of its memory (split_memory_mb). Without
    GPUs: `replicas` logical CPU devices (default 1) carved out of the one physical CPU.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        count = replicas or len(gpus)
        if count > len(gpus) and len(gpus) == 1:
            share = split_memory_mb(gpu_memory_mb(), count)
            tf.config.set_logical_device_configuration(
                gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=share) for _ in range(count)])
            log.info("one GPU split into %d logical GPUs of %d MB each", count, share)
            return [d.name for d in tf.config.list_logical_devices("GPU")][:count]
        if count > len(gpus):
            raise ValueError(f"--replicas {count} asks for more replicas than the {len(gpus)} GPUs here "
                             f"(one GPU alone can be split)")
        return [f"/device:GPU:{i}" for i in range(count)]
    count = replicas or 1
    cpu = tf.config.list_physical_devices("CPU")[0]
    if count > 1:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
        )
    return [d.name for d in tf.config.list_logical_devices("CPU")][:count]


SPLIT_SHARE = 0.9
"""Of a split GPU's memory, the part shared out among its logical GPUs (the rest is left to CUDA's
own context and libraries, which TensorFlow's limit does not count)."""
UNKNOWN_GPU_MEMORY_MB = 8192
"""What a GPU is taken to hold when nvidia-smi cannot say."""


def split_memory_mb(total_mb: int, count: int) -> int:
    """Each logical GPU's memory limit when one GPU of `total_mb` is split `count` ways."""
    return max(256, int(total_mb * SPLIT_SHARE) // count)


def gpu_memory_mb() -> int:
    """GPU 0's memory as nvidia-smi reports it (TensorFlow cannot say before its runtime starts,
    and a split must be set before)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=10, check=True)
        return int(done.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        log.warning("nvidia-smi could not tell the GPU's memory; taking it to be %d MB", UNKNOWN_GPU_MEMORY_MB)
        return UNKNOWN_GPU_MEMORY_MB


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
        self.batched = signature.batched
        """False: each request runs alone and whole on the first replica, its shapes as they are."""
        specs = {
            name: tf.TensorSpec(None if spec.shape is None else [None, *spec.shape[1:]] if self.batched
                                else list(spec.shape), tf.as_dtype(dtype_enum(spec.dtype)), name=name)
            for name, spec in signature.inputs.items()
        }
        idle = {name: (tf.as_dtype(dtype_enum(spec.dtype)), [0, *(d or 1 for d in (spec.shape or (0,))[1:])])
                for name, spec in signature.outputs.items()}
        """What a replica left without rows returns, made without running the model: each output's
        dtype, and a zero-row shape."""

        def trace(executor: str, in_use: int) -> Any:
            """The program for batches run on the first `in_use` replicas, traced for `executor`
            (the calls nested in it take the executor type in force while tracing). Every replica
            takes part in `strategy.run`; those past `in_use` are handed an empty slice of the
            first chunk, which never reaches the model, and return zero-row outputs. Calling the
            traced program directly skips tf.function's per-call dispatch (about 0.3 ms a batch
            here); the input signature makes it the only program for that count and executor."""

            def per_replica(chunk: dict[str, tf.Tensor]) -> Any:
                if in_use < self.replicas:
                    # A constant: MirroredStrategy traces each replica's part apart.
                    replica = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
                    if replica is None:
                        raise RuntimeError("the replica id is unknown while tracing: idle replicas cannot be told")
                    if replica >= in_use:
                        return {name: tf.zeros(shape, dtype) for name, (dtype, shape) in idle.items()}
                return function(**chunk)

            @tf.function(input_signature=[[specs] * in_use])
            def run_some(chunks: list[dict[str, tf.Tensor]]) -> Any:
                on_trace()  # Python side effect: runs only while tracing
                # Idle replicas get an empty tensor of each input's rank (a scalar stays a scalar).
                nothing = {name: tf.zeros(tf.zeros_like(tf.shape(tensor)), tensor.dtype)
                           for name, tensor in chunks[0].items()}
                distributed = strategy.experimental_distribute_values_from_function(
                    lambda ctx: chunks[ctx.replica_id_in_sync_group] if ctx.replica_id_in_sync_group < in_use
                    else nothing
                )
                return strategy.experimental_local_results(strategy.run(per_replica, args=(distributed,)))[:in_use]

            with tf.experimental.function_executor_type(executor):
                return run_some.get_concrete_function()

        self._trace = trace
        devices = strategy.extended.worker_devices
        self.executor = SINGLE_THREADED if len(devices) == 1 and "CPU" in devices[0].upper() else DEFAULT_EXECUTOR
        """The executor type the programs run on; the default one if the single-threaded one refused them."""
        self._programs = self._trace_all()

    def _trace_all(self) -> list[Any]:
        """One program per count of replicas in use, 1 to all (1 only, unbatched), for the current executor."""
        counts = range(1, self.replicas + 1) if self.batched else [1]
        return [self._trace(self.executor, in_use) for in_use in counts]

    def __call__(self, batch: Tensors) -> Tensors:
        """Run one batch (blocking); outputs have the batch's rows in the same order."""
        return self.run(batch)[0]

    def run(self, batch: Tensors) -> tuple[Tensors, tuple[int, ...]]:
        """Run one batch (blocking): its outputs, rows in the same order, and how many of its rows
        each replica ran (what mirrorserve_replica_rows_total counts; 0 for a replica not in use)."""
        idle = (0,) * (self.replicas - 1)
        if not self.batched:
            return self.run_chunks([batch])[0], (1, *idle)  # one request: one "row" on replica 0
        rows = next(iter(batch.values())).shape[0]
        bounds = shard_bounds(rows, self.replicas)
        outputs = self.run_chunks([{name: array[lo:hi] for name, array in batch.items()} for lo, hi in bounds])
        sizes = [hi - lo for lo, hi in bounds]
        return concat_rows(outputs), (*sizes, *[0] * (self.replicas - len(sizes)))

    def run_chunks(self, chunks: Sequence[Tensors]) -> list[Tensors]:
        """Run one chunk on each of the first len(chunks) replicas, at once (blocking): each
        chunk's outputs, checked to have its rows."""
        if not 1 <= len(chunks) <= len(self._programs):
            raise ModelFailure(f"a batch cannot run as {len(chunks)} chunks on {len(self._programs)} replicas")
        try:
            with tf.experimental.function_executor_type(self.executor):
                results = self._programs[len(chunks) - 1](list(chunks))
        except tf.errors.OpError as exc:
            raise ModelError.from_tensorflow(exc.message, int(exc.error_code)) from exc
        outputs = []
        for replica, (chunk, result) in enumerate(zip(chunks, results, strict=True)):
            arrays = {name: tensor.numpy() for name, tensor in result.items()}
            if self.batched:
                check_rows(arrays, next(iter(chunk.values())).shape[0], f"replica {replica}")
            outputs.append(arrays)
        return outputs

    def warm_up(self, sizes: Sequence[int], measure_cost: bool = False) -> tuple[float, float]:
        """Run each batch size once (BatchingPolicy.warm_up_sizes) on generated rows (Signature.example),
        so neither tracing nor the kernels' first-use set-up for a new shape lands on a real request;
        and each size below the replica count, so every program (one per count of replicas in use)
        has run. WarmUpFailed if the model refuses them: the loader decides whether that fails the load.
        With `measure_cost`, returns the run time as (a, b), a + b·rows, from a second, timed run of
        the smallest and the largest size: what a latency target (server.core.latency_target)
        starts from; else (0, 0), with no extra run."""
        every = sorted({*sizes, *range(1, self.replicas)}) if self.batched else [1]
        for rows in every:
            try:
                self(self.signature.example(rows))
            except Exception as exc:
                if self.executor == DEFAULT_EXECUTOR:
                    raise self._refused(rows, exc) from exc
                self._switch_to_default_executor(rows)
        if not measure_cost:
            return 0.0, 0.0
        timed = {}
        for rows in sorted({every[0], every[-1]}):
            example = self.signature.example(rows)
            started = time.perf_counter()
            self(example)
            timed[rows] = time.perf_counter() - started
        low, high = min(timed), max(timed)
        per_row = (timed[high] - timed[low]) / (high - low) if high > low else 0.0
        per_row = max(per_row, 0.0)
        return max(timed[low] - per_row * low, 0.0), per_row

    def _switch_to_default_executor(self, rows: int) -> None:
        """After a failed call on the single-threaded executor, switch to the default one, which
        runs every graph; WarmUpFailed if the batch fails there too (the model's failure, then)."""
        self.executor = DEFAULT_EXECUTOR
        self._programs = self._trace_all()
        try:
            self(self.signature.example(rows))
        except Exception as exc:
            raise self._refused(rows, exc) from exc
        log.info("signature '%s' runs on TensorFlow's default executor: the single-threaded one refused it",
                 self.signature.name)

    def _refused(self, rows: int, exc: Exception) -> WarmUpFailed:
        detail = str(exc) if isinstance(exc, ModelError) else f"{type(exc).__name__}: {exc}"
        if len(detail) > MAX_DETAIL_CHARS:
            detail = detail[:MAX_DETAIL_CHARS] + " ..."
        return WarmUpFailed(f"signature '{self.signature.name}' failed its warm-up on {rows} generated rows "
                            f"({GENERATED_ROWS}): {detail.strip()}")


MAX_DETAIL_CHARS = 1200
"""Of the error in a failed warm-up's message (the model's own is already cut to its first line;
the load's message keeps room for what to do about it)."""


class WarmUpFailed(Exception):
    """A signature failed on the generated warm-up rows; its __cause__ is the model's own error."""

    WAYS_THROUGH = (f"a model that refuses such rows is served with a warmup file ({WARMUP_FILE}) of real "
                    f"requests, or with --no-strict-warm-up")
