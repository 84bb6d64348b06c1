"""How one model's requests are batched: the knobs in TF Serving's and Triton's words, and where
they come from. Pure: no TensorFlow, no asyncio.

The policy, in three sentences (the batcher keeps them; the README says them to users):
1. A batch goes as soon as it holds `max_batch_size` rows; otherwise, with a batch timeout T, once
   its oldest row has waited T (TF Serving's `batch_timeout_micros`, Triton's max queue delay),
   and with T = 0 as soon as a batch slot is free.
2. With the default timeout, `auto`, a batch that finds the model free goes at once unless at
   least one more row is expected within a batch's fixed cost (the part of a batch's time that
   does not grow with its rows, fitted from recent batches) times 1 / (1 - the event loop's busy
   share since the batch before last was taken); then it waits at most that long (and no longer
   than a full batch takes to arrive), and goes as soon as it holds as many rows as were present
   at once during the previous batch. A batch beside a running one (with more than one in flight)
   waits for that one to end, at most one average batch time after its oldest row arrived.
3. At most `max_inflight_batches` batches execute at once (TF Serving's `num_batch_threads`,
   Triton's instance count), at most `max_queued_rows` rows wait (beyond it: RESOURCE_EXHAUSTED),
   and with `allowed_batch_sizes` a batch is padded up to the next allowed size by repeating its
   first row, the padding's outputs dropped.

Why `auto` waits as it does: every batch has a fixed cost (a hand-off to the model worker, a call
into TensorFlow, layers whose time does not grow with rows) that more rows share; merging rows
into one batch saves that and nothing more. So a wait is worth it only while rows are expected
within that fixed cost, and never longer than it: a wait of at most what it can save (the
ski-rental bound) at worst doubles that part of a row's time. A model whose time grows with every
row (compute-bound) has little fixed cost, so its batches do not wait for rows; they still take
every row queued while the model was busy.
The stretch by the event loop's busy share: the loop, which parses and answers every request,
pays part of each batch's fixed cost (handing the batch over, reading its answer). While the loop
is busy a share b of the time, every request queued behind it waits each unit of its work
1 / (1 - b) times over (a queue's residence time), so on a saturated server merging saves that
much more. On an idle loop the stretch is 1; a busy share of 1 leaves the bound at the time a full
batch takes to arrive, since waiting longer could add no row.
And once as many rows are queued as were present at once during the previous batch, every caller
of a closed loop (each waiting for its answer before it sends again) is in, and no row can come
before this batch answers some. Its two constants, AUTO_WAIT_BATCHES (the longest wait, in fixed
batch costs, before the stretch) and SMOOTHING (how fast the averages follow), are about batch
costs and arrivals in general, not about any one model; the stretch adds none.

Where the values come from, later over earlier, field by field: the flags; TF Serving's
`--batching_parameters_file`; the model's own `batching_parameters` in the model config file.
A source that sets `max_batch_size` or `allowed_batch_sizes` sets both (allowed sizes default to
none), so an inherited size list can never disagree with a model's own maximum.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format

from protos.tensorflow_serving import session_bundle_config_pb2
from server.config import Settings, batch_sizes_problem

AUTO_WAIT_BATCHES = 1.0
"""Auto: the longest wait, in fixed batch costs (before the stretch by the event loop's busy
share; in average batch times beside a running batch). One, because waiting longer than what a
merged batch can save could cost more than it earns, while beside a running batch, its end brings
every row that a longer wait could gather."""
SMOOTHING = 0.2
"""Weight of the newest figure in the averages of batch time and arrival gap: about the last five
count, so a single slow batch (a collection pause, a cold cache) or one burst does not set the
next waits, while a change of load shows within a few batches."""


class BatchCost:
    """A batch's time as fixed + per_row * rows, fitted by least squares over recent batches
    (moving averages of rows, seconds, rows², rows·seconds and seconds², the newest weighing
    `weight`, SMOOTHING by default; the first batch sets them). The fixed part is what merging two
    batches into one saves, so it is what waiting for more rows can earn. While every recent batch
    had the same rows, nothing tells the parts apart and the whole time counts as fixed. The
    latency target (server.core.latency_target) fits the same way, more slowly."""

    def __init__(self, weight: float = SMOOTHING) -> None:
        self.seconds = 0.0
        """Average batch time; 0 until a batch has been timed."""
        self.count = 0
        """Batches timed."""
        self._weight = weight
        self._rows = 0.0
        self._rows2 = 0.0
        self._rows_seconds = 0.0
        self._seconds2 = 0.0

    def add(self, rows: int, seconds: float) -> None:
        weight = self._weight if self.count else 1.0
        self.count += 1
        self.seconds += weight * (seconds - self.seconds)
        self._rows += weight * (rows - self._rows)
        self._rows2 += weight * (rows * rows - self._rows2)
        self._rows_seconds += weight * (rows * seconds - self._rows_seconds)
        self._seconds2 += weight * (seconds * seconds - self._seconds2)

    @property
    def per_row_seconds(self) -> float:
        variance = self._rows2 - self._rows * self._rows
        if variance <= 1e-9:
            return 0.0
        return max(0.0, (self._rows_seconds - self._rows * self.seconds) / variance)

    @property
    def fixed_seconds(self) -> float:
        return max(0.0, self.seconds - self.per_row_seconds * self._rows)

    def spread(self) -> float:
        """Root mean square of the residuals around the fit (seconds), from the moving moments."""
        a, b = self.fixed_seconds, self.per_row_seconds
        mean_square = (self._seconds2 - 2 * a * self.seconds - 2 * b * self._rows_seconds + a * a
                       + 2 * a * b * self._rows + b * b * self._rows2)
        return math.sqrt(max(0.0, mean_square))


def busy_share(wall_seconds: float, loop_cpu_seconds: float) -> float:
    """The event loop's busy share over a span: its CPU time over the wall time (0 for no span)."""
    return loop_cpu_seconds / wall_seconds if wall_seconds > 0 else 0.0


def auto_bound(fixed_seconds: float, busy: float, max_batch_rows: int, row_gap: float) -> float:
    """The longest auto wait of a batch that finds the model free (rule 2): what merging saves, a
    batch's fixed cost, stretched by 1 / (1 - the event loop's busy share). The loop pays a share
    of every batch's fixed cost, and while it is busy every request queued behind it waits that
    share 1 / (1 - busy) times over (a queue's residence time), so saving it is worth that much
    more. Never longer than a full batch takes to arrive at the measured rate (`row_gap` seconds
    between rows): waiting longer could add no row."""
    fixed = AUTO_WAIT_BATCHES * fixed_seconds
    fill = max_batch_rows * row_gap
    return min(fixed / (1.0 - busy), fill) if busy < 1.0 else fill


def dispatch_at(enqueued_at: float, timeout_s: float | None, executing: int, batch_seconds: float,
                bound: Callable[[], float], row_gap: float, rows_here: int, last_present: int,
                free_since: float) -> float:
    """When a batch whose oldest row arrived at `enqueued_at` goes, unless it fills up before
    (rules 1 and 2), all times on the batcher's clock: with a timeout, that long after its oldest
    row; beside `executing` running batches, at most one average batch time (`batch_seconds`)
    after it; otherwise at once, unless another row is expected within `bound()` (rows arrive
    `row_gap` apart) and fewer than `last_present` rows (present at once during the previous
    batch) are here, in which case at most `bound()` after the model fell free (`free_since`).
    `bound` is called only when needed: it reads the clocks."""
    if timeout_s is not None:
        return enqueued_at + timeout_s
    if executing:
        return enqueued_at + AUTO_WAIT_BATCHES * batch_seconds
    wait = bound()
    if row_gap >= wait or rows_here >= last_present:
        return enqueued_at
    return max(enqueued_at, free_since) + wait


@dataclass(frozen=True)
class BatchingPolicy:
    max_batch_size: int
    """Rows of one batch, all replicas together."""
    batch_timeout_s: float | None
    """Longest wait after a batch's oldest row; 0 = never wait; None = auto (see the module)."""
    max_inflight_batches: int
    """Batches executing at once."""
    max_queued_rows: int
    """Rows allowed to wait for a batch."""
    allowed_batch_sizes: tuple[int, ...] = ()
    """Sizes a batch is padded up to; empty: no padding."""
    batching: bool = True
    """False: no batching, as TF Serving without --enable_batching: each request runs alone and
    whole, whatever its rows, split over the replicas as one batch (--no-batching, or a model's
    `max_batch_size { value: 0 }`). The fields above then only bound the queue and the warm-up."""
    target_latency_s: float | None = None
    """The latency target (server.core.latency_target): the batch size (up to max_batch_size) and
    when a batch goes follow it instead of the timeout, and requests that would miss it are shed
    when the model cannot keep up. None: no target, the timeout's rules."""

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        if self.max_batch_size < 1:
            return f"max_batch_size must be >= 1, got {self.max_batch_size}"
        if self.batch_timeout_s is not None and not self.batch_timeout_s >= 0:
            return f"the batch timeout must be >= 0, got {self.batch_timeout_s}"
        if self.max_inflight_batches < 1:
            return f"batches in flight must be >= 1, got {self.max_inflight_batches}"
        if self.max_queued_rows < 1:
            return f"max_queued_rows must be >= 1, got {self.max_queued_rows}"
        if self.target_latency_s is not None and not self.target_latency_s > 0:
            return f"the latency target must be > 0, got {self.target_latency_s * 1000:g} ms"
        return batch_sizes_problem(self.allowed_batch_sizes, self.max_batch_size)

    def warm_up_sizes(self) -> tuple[int, ...]:
        """The batch sizes worth running once at load: the allowed sizes, which are the only ones
        the model will see, else every power of two up to the maximum and the maximum itself."""
        if self.allowed_batch_sizes:
            return self.allowed_batch_sizes
        top = self.max_batch_size
        return tuple(sorted({min(2**i, top) for i in range(top.bit_length() + 1)} | {top}))

    def describe(self) -> str:
        if not self.batching:
            return (f"off (each request runs alone) inflight={self.max_inflight_batches} "
                    f"max_queued_rows={self.max_queued_rows}")
        timeout = "auto" if self.batch_timeout_s is None else f"{self.batch_timeout_s * 1e3:g}ms"
        sizes = ",".join(map(str, self.allowed_batch_sizes)) or "any"
        target = "" if self.target_latency_s is None else f" target_latency={self.target_latency_s * 1e3:g}ms"
        return (f"max_batch_size={self.max_batch_size} batch_timeout={timeout} "
                f"inflight={self.max_inflight_batches} max_queued_rows={self.max_queued_rows} "
                f"allowed_batch_sizes={sizes}{target}")


def padded_rows(allowed_batch_sizes: tuple[int, ...], rows: int) -> int:
    """The rows a batch of `rows` runs as: the next allowed size, or `rows` itself."""
    return next((size for size in allowed_batch_sizes if size >= rows), rows)


def apply(base: BatchingPolicy, params: session_bundle_config_pb2.BatchingParameters) -> BatchingPolicy:
    """`base` with the fields that TF Serving's BatchingParameters sets; ValueError names a field
    that cannot be served. Our extensions: `batch_timeout_micros: -1` asks for the auto wait, and
    `max_batch_size: 0` for no batching (each request runs alone), and `target_latency_ms` sets a
    latency target."""
    if params.pad_variable_length_inputs:
        raise ValueError("pad_variable_length_inputs is not supported: the requests of one batch share "
                         "their non-batch dimensions here")
    if params.HasField("max_batch_size") and params.max_batch_size.value == 0:
        if params.allowed_batch_sizes:
            raise ValueError("max_batch_size 0 (no batching) takes no allowed_batch_sizes")
        return dataclasses.replace(base, batching=False)
    changes: dict[str, object] = {}
    if params.HasField("max_batch_size") or params.allowed_batch_sizes:
        sizes = tuple(params.allowed_batch_sizes)
        if params.HasField("max_batch_size"):
            changes["max_batch_size"] = params.max_batch_size.value
        else:
            changes["max_batch_size"] = sizes[-1]
        changes["allowed_batch_sizes"] = sizes
    elif params.HasField("max_execution_batch_size"):
        # Alone, it is the largest batch that executes: this server's max_batch_size (a larger
        # request is split, as TF Serving does with enable_large_batch_splitting).
        changes["max_batch_size"] = params.max_execution_batch_size.value
        changes["allowed_batch_sizes"] = ()
    top = int(changes.get("max_batch_size", base.max_batch_size))  # type: ignore[call-overload]
    if params.HasField("max_execution_batch_size") and params.max_execution_batch_size.value != top:
        raise ValueError(f"max_execution_batch_size {params.max_execution_batch_size.value} differs from "
                         f"max_batch_size {top}; here a batch executes whole, so they must be equal")
    if params.HasField("batch_timeout_micros"):
        micros = params.batch_timeout_micros.value
        if micros < -1:
            raise ValueError(f"batch_timeout_micros must be >= 0 (or -1 for auto), got {micros}")
        changes["batch_timeout_s"] = None if micros == -1 else micros / 1e6
    if params.HasField("num_batch_threads"):
        changes["max_inflight_batches"] = params.num_batch_threads.value
    if params.HasField("max_enqueued_batches"):
        changes["max_queued_rows"] = params.max_enqueued_batches.value * top
    if params.HasField("target_latency_ms"):
        millis = params.target_latency_ms.value
        if not millis > 0:
            raise ValueError(f"target_latency_ms must be > 0, got {millis:g}")
        changes["target_latency_s"] = millis / 1000
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def parse_batching_parameters(text: str, where: str) -> session_bundle_config_pb2.BatchingParameters:
    """TF Serving's batching parameters text format; ValueError names the file and line."""
    params = session_bundle_config_pb2.BatchingParameters()
    try:
        text_format.Parse(text, params)
    except text_format.ParseError as exc:
        raise ValueError(f"{where}:{exc}") from None
    return params


def read_batching_parameters_file(base: BatchingPolicy, path: str | os.PathLike[str]) -> BatchingPolicy:
    """The server-wide policy: the flags' `base` with --batching_parameters_file over it."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read batching parameters file {path}: {exc.strerror or exc}") from None
    params = parse_batching_parameters(text, str(path))
    try:
        return apply(base, params)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def server_policy(settings: Settings) -> BatchingPolicy:
    """Every model's policy unless its config entry says otherwise: the flags, then the file."""
    base = BatchingPolicy(
        max_batch_size=settings.max_batch_size,
        batch_timeout_s=settings.batch_timeout_s,
        max_inflight_batches=settings.max_inflight_batches,
        max_queued_rows=settings.max_queued_rows,
        allowed_batch_sizes=settings.allowed_batch_sizes,
        batching=settings.batching,
        target_latency_s=None if settings.target_latency_ms is None else settings.target_latency_ms / 1000,
    )
    if settings.batching_parameters_file is None:
        return base
    return read_batching_parameters_file(base, settings.batching_parameters_file)
