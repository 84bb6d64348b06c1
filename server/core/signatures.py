"""What a signature accepts and returns, and checking a request against it. Pure: no TensorFlow.

A signature whose every input and output has an unknown dimension 0 is batched: that dimension is
the batch (row) dimension, which lets requests be merged into one execution and split back apart.
Any other signature (an input of [1, -1, -1, 3], as the Object Detection API exports; a scalar; no
inputs) is served unbatched, as TF Serving serves it without batching: each request is checked
against the exact shapes, runs alone and whole on one replica, and gets the outputs as they come.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from server.dtypes import tf_name
from server.errors import InvalidInput

DEFAULT_SIGNATURE = "serving_default"


class BatchKey(NamedTuple):
    """Requests share a batch only when signature and every non-batch dimension agree; those of an
    unbatched signature never do (`whole`: each runs alone)."""

    signature: str
    trailing_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    whole: bool = False


@dataclass(frozen=True)
class TensorSpec:
    dtype: np.dtype
    shape: tuple[int | None, ...] | None
    """None for unknown rank; None in a dimension for unknown size."""

    def describe(self) -> str:
        dims = "?" if self.shape is None else str([-1 if d is None else d for d in self.shape])
        return f"{tf_name(self.dtype)} {dims}"


def _shape_text(shape: Iterable[int]) -> str:
    return str(list(shape))


MAX_CACHED_LAYOUTS = 256


@dataclass(frozen=True)
class ExampleFeature:
    """One feature a signature's tf.io.parse_example reads from each serialized tf.Example (found in
    its graph at load), as TensorFlow checks it: a feature the example has must be of `kind`; a
    dense feature must hold as many values as its shape; a required one must be there."""

    kind: str
    """The tf.train.Feature list it must be: "bytes_list", "float_list" or "int64_list"."""
    shape: tuple[int, ...] | None
    """A dense feature's shape per example (-1 first for a variable-length one); None for a sparse
    or ragged feature, which may hold any number of values."""
    required: bool
    """A dense feature without a default: an example without it fails the model."""


GENERATED_ROWS = "zeros, empty strings or a tf.Example of zeros, unknown dimensions 1"
"""What Signature.example's rows hold, as a load's error message says it."""


@dataclass(frozen=True)
class Signature:
    name: str
    inputs: Mapping[str, TensorSpec]
    outputs: Mapping[str, TensorSpec]
    features: Mapping[str, ExampleFeature] | None = None
    """For a signature that parses serialized tf.Examples: the features it reads, so that each
    example of a Classify or Regress request is checked before it can share a batch; None when the
    graph holds no parse op this server can read (the model then checks the examples itself)."""
    warm_up_example: bytes | None = None
    """With `features`: a serialized tf.Example holding every required feature (zeros), which the
    warm-up runs in place of empty strings that its parse would refuse."""
    _layouts: dict[tuple[object, ...], BatchKey] = field(default_factory=dict, compare=False, repr=False)
    """Input layouts (names, dtypes, non-batch dimensions) already validated, with their batch key:
    a request path costs ~4x what a micro-benchmark shows on a loaded server, so the repeat checks
    are skipped."""

    def example(self, rows: int) -> dict[str, np.ndarray]:
        """`rows` rows of zeros (empty strings, or the warm-up example) for every input, unknown
        dimensions 1: what warm-up runs, so tracing and first-use set-up never land on a real request.
        For an unbatched signature, one request of its own shapes (`rows` does not apply)."""
        batch = {}
        text = self.warm_up_example or b""
        batched = self.batched
        for name, spec in self.inputs.items():
            if batched and spec.shape is not None:
                shape = (rows, *(1 if d is None else d for d in spec.shape[1:]))
            else:
                shape = (1,) if spec.shape is None else tuple(1 if d is None else d for d in spec.shape)
            if spec.dtype.kind == "O":
                batch[name] = np.empty(shape, dtype=object)
                batch[name].fill(text)  # np.full would make it a numpy string first, dropping trailing NULs
            else:
                batch[name] = np.zeros(shape, spec.dtype)
        return batch

    @property
    def batched(self) -> bool:
        """Whether requests to it are merged by rows (batching_problem says why not)."""
        return self.batching_problem() is None

    def admit(self, inputs: Mapping[str, np.ndarray]) -> tuple[int, BatchKey]:
        """validate() and batch_key() in one; a layout seen before only has its rows checked. An
        unbatched signature's request counts as one row."""
        if not self.batched:
            self.validate_whole(inputs)
            return 1, BatchKey(self.name, tuple((n, tuple(inputs[n].shape)) for n in sorted(self.inputs)), True)
        layout = tuple((n, a.dtype, a.ndim, a.shape[1:]) for n, a in inputs.items())
        key = self._layouts.get(layout)
        if key is None:
            rows = self.validate(inputs)
            key = self.batch_key(inputs)
            if len(self._layouts) < MAX_CACHED_LAYOUTS:
                self._layouts[layout] = key
            return rows, key
        counts = {a.shape[0] for a in inputs.values()}
        if len(counts) != 1 or 0 in counts:
            self.validate(inputs)  # raises with the full explanation
        return counts.pop(), key

    def batching_problem(self) -> str | None:
        """Why requests to this signature cannot be batched by rows, or None if they can."""
        if not self.inputs:
            return "it has no inputs, so a request has no rows"
        for kind, specs in (("input", self.inputs), ("output", self.outputs)):
            for name, spec in specs.items():
                if spec.shape is None or len(spec.shape) == 0 or spec.shape[0] is not None:
                    return f"{kind} '{name}' has shape {spec.describe()}; dimension 0 must be the batch (-1)"
        return None

    def validate_whole(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Check names, dtypes and the whole shape of a request to an unbatched signature: every
        dimension the signature knows, dimension 0 included, and the rank."""
        self._check_names(inputs)
        for name, spec in self.inputs.items():
            array = inputs[name]
            self._check_dtype(name, spec, array)
            if spec.shape is None:
                continue
            if len(array.shape) != len(spec.shape) or any(
                    w is not None and w != g for w, g in zip(spec.shape, array.shape, strict=False)):
                raise InvalidInput(f"input '{name}' must have shape {spec.describe().split(' ', 1)[1]}, got "
                                   f"{_shape_text(array.shape)} (signature '{self.name}' is served unbatched: "
                                   f"its shapes are taken as they are)")

    def _check_names(self, inputs: Mapping[str, np.ndarray]) -> None:
        missing = sorted(set(self.inputs) - set(inputs))
        if missing:
            raise InvalidInput(
                f"missing input {', '.join(repr(m) for m in missing)}; "
                f"signature '{self.name}' takes: {self._takes()}"
            )
        unexpected = sorted(set(inputs) - set(self.inputs))
        if unexpected:
            raise InvalidInput(
                f"unexpected input {', '.join(repr(u) for u in unexpected)}; "
                f"signature '{self.name}' takes: {self._takes()}"
            )

    @staticmethod
    def _check_dtype(name: str, spec: TensorSpec, array: np.ndarray) -> None:
        if array.dtype != spec.dtype and not (spec.dtype == object and array.dtype.kind in "OSU"):
            raise InvalidInput(f"input '{name}' must be {tf_name(spec.dtype)}, got {tf_name(array.dtype)}")

    def _takes(self) -> str:
        return ", ".join(f"{n} ({s.describe()})" for n, s in sorted(self.inputs.items()))

    def validate(self, inputs: Mapping[str, np.ndarray]) -> int:
        """Check names, dtypes and shapes of a request to a batched signature; return its row count."""
        self._check_names(inputs)
        rows: dict[str, int] = {}
        for name, spec in self.inputs.items():
            array = inputs[name]
            self._check_dtype(name, spec, array)
            assert spec.shape is not None  # guaranteed for a batched signature (batching_problem)
            trailing = zip(spec.shape[1:], array.shape[1:], strict=False)
            if len(array.shape) != len(spec.shape) or any(w is not None and w != g for w, g in trailing):
                raise InvalidInput(
                    f"input '{name}' must have shape {spec.describe().split(' ', 1)[1]}, "
                    f"got {_shape_text(array.shape)}"
                )
            rows[name] = array.shape[0]
        counts = set(rows.values())
        if len(counts) > 1:
            detail = ", ".join(f"'{n}' has {r}" for n, r in sorted(rows.items()))
            raise InvalidInput(f"inputs disagree on the number of rows (dimension 0): {detail}")
        (count,) = counts
        if count == 0:
            raise InvalidInput("the request has zero rows (dimension 0 is 0); send at least one")
        return count

    def select_outputs(self, output_filter: Iterable[str]) -> tuple[str, ...]:
        """The output names a request asked for (all when the filter is empty), in signature order."""
        if not output_filter:
            return tuple(self.outputs)
        wanted = set(output_filter)
        unknown = sorted(wanted - set(self.outputs))
        if unknown:
            raise InvalidInput(
                f"output_filter names unknown output {', '.join(repr(u) for u in unknown)}; "
                f"signature '{self.name}' returns: {', '.join(sorted(self.outputs))}"
            )
        return tuple(n for n in self.outputs if not wanted or n in wanted)

    def batch_key(self, inputs: Mapping[str, np.ndarray]) -> BatchKey:
        return BatchKey(self.name, tuple((n, tuple(inputs[n].shape[1:])) for n in sorted(self.inputs)))


@dataclass(frozen=True)
class TensorInfo:
    """One input or output as the SavedModel's SignatureDef describes it (TensorFlow's TensorInfo),
    in plain types: the worker reads it, the serving process encodes it for GetModelMetadata."""

    name: str
    """The graph tensor's name, e.g. 'serving_default_x:0'."""
    dtype: int
    """TensorFlow's DataType enum number."""
    dims: tuple[tuple[int, str], ...] | None
    """(size, name) per dimension, size -1 when unknown; None for unknown rank."""


@dataclass(frozen=True)
class SignatureDefinition:
    """A SignatureDef in plain types: what GetModelMetadata reports, exactly as the SavedModel has it."""

    method_name: str
    inputs: Mapping[str, TensorInfo]
    outputs: Mapping[str, TensorInfo]


@dataclass(frozen=True)
class ModelInfo:
    """The served model as the request path sees it."""

    name: str
    version: int
    signatures: Mapping[str, Signature]
    unbatched: Mapping[str, str]
    """Signatures that cannot be batched by rows, with the reason: each request to them runs alone,
    whole, on one replica."""
