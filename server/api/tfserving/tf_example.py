"""The serialized tf.Examples of a Classify, Regress or MultiInference request: read, merged with
their context as TF Serving does, and checked one by one before they can share a batch.

TF Serving hands the examples to the model unchecked, and the model's parse op fails the whole
run on the first bad one. Here requests share batches, so a bad example would fail other clients'
requests too (the batcher would then isolate it, at the cost of re-running the batch in halves),
and TensorFlow's message names neither the request nor the example. So each example is parsed
and checked against the features the signature's parse op reads (server.worker.example_features)
with TensorFlow's rules:

- a feature the model reads must be of the kind it reads (bytes_list, float_list, int64_list),
  even when it holds no values;
- a dense feature must hold exactly as many values as its shape (a variable-length one, a
  multiple of the shape's other dimensions); sparse and ragged ones hold any number;
- a dense feature without a default must be there (a Feature with no list set counts as absent);
- features the model does not read are ignored, as TensorFlow ignores them.

Unlike TF Serving, a feature in both the context and an example is refused: TF Serving's merge
(the context's bytes, then the example's) lets the example's value win silently, which hides a
client's mistake. The merged examples are what the model gets: the context's serialized bytes
followed by the example's, TF Serving's own merge.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from protos.tensorflow_serving import serialized_input_pb2
from protos.tf.tensorflow.core.example import example_pb2
from server.api.http.body import BodyDecoder
from server.core.signatures import ExampleFeature
from server.errors import InvalidInput
from server.limits import STRING_ELEMENT_BYTES, check_bytes

WITH_CONTEXT = "example_list_with_context"
INLINE_CHECKS = 2000
"""Examples are checked on the event loop up to this many examples times (features + 1), about
3 ms here (a parse costs some 2 us and a feature's check 1.4 us); larger requests are checked by
the body-decoding helper process, so the loop goes on serving."""

INLINE_JSON_BYTES = 4 * 1024
"""REST classify and regress bodies up to this size are decoded and checked on the event loop
(1.6-2.3 ms here: building examples from JSON costs about 5 us a feature, more than checking
them); larger ones by the helper process."""


async def read(serialized_input: Any, features: Mapping[str, ExampleFeature] | None, max_bytes: int,
               decoder: BodyDecoder, check_count: Callable[[int], None]) -> list[bytes]:
    """The examples of a SerializedInput, checked and merged with their context: what the
    signature's "inputs" gets. `check_count` refuses a number of examples that could never be
    queued, before they cost a check each."""
    examples, context = examples_of(serialized_input, max_bytes, check_count)
    if len(examples) * (len(features or ()) + 1) <= INLINE_CHECKS:
        check(examples, context, features)
    else:
        raw = serialized_input.SerializeToString()
        await decoder.run(False, len(raw), check_serialized, raw, features, max_bytes)
    return merged(examples, context)


def check_serialized(raw_input: bytes, features: Mapping[str, ExampleFeature] | None, max_bytes: int) -> None:
    """`check` on a serialized SerializedInput: what the helper process runs (the loop sends one
    string, not a list of millions)."""
    examples, context = examples_of(serialized_input_pb2.SerializedInput.FromString(raw_input), max_bytes)
    check(examples, context, features)


def examples_of(serialized_input: Any, max_bytes: int, check_count: Callable[[int], None] | None = None
                ) -> tuple[list[bytes], bytes]:
    """(the examples, the context or b"") of a tensorflow.serving.internal.SerializedInput,
    refused when empty, when `check_count` refuses their number (before a Python object is made
    for each), or when the merged examples would pass `max_bytes` (a large context is copied into
    every example)."""
    kind = serialized_input.WhichOneof("kind")
    if kind is None:
        raise InvalidInput("the input is empty: set input.example_list or input.example_list_with_context")
    holder = getattr(serialized_input, kind)
    if not holder.examples:
        raise InvalidInput(f"input.{kind} has no examples; send at least one")
    if check_count is not None:
        check_count(len(holder.examples))
    examples = list(holder.examples)
    context = bytes(holder.context) if kind == WITH_CONTEXT else b""
    check_size(examples, context, max_bytes)
    return examples, context


def check_size(examples: Sequence[bytes], context: bytes, max_bytes: int) -> None:
    count = len(examples)
    merged = sum(len(e) for e in examples) + count * (len(context) + STRING_ELEMENT_BYTES)
    check_bytes("the examples merged with their context", [count], merged, max_bytes)


def parse(raw: bytes, where: str) -> Any:
    """A tf.Example from its bytes, or InvalidInput naming `where` it came from."""
    try:
        return example_pb2.Example.FromString(raw)
    except DecodeError as exc:
        raise InvalidInput(f"{where} is not a serialized tf.Example: {exc}") from None


def check(examples: Sequence[bytes], context: bytes, features: Mapping[str, ExampleFeature] | None) -> None:
    """Parse every example (and the context) and check it against the signature's features (only
    for conflicts with the context when they are unknown); InvalidInput names the first bad
    example by its index, and the feature."""
    check_parsed((parse(raw, f"example {index}") for index, raw in enumerate(examples)),
                 parse(context, "the context") if context else None, features)


def check_parsed(examples: Iterable[Any], context: Any, features: Mapping[str, ExampleFeature] | None) -> None:
    """`check` on tf.Example messages (`context` None without one)."""
    shared = context.features.feature if context is not None else {}
    for index, example in enumerate(examples):
        own = example.features.feature
        if shared:
            both = sorted(set(own) & set(shared))
            if both:
                raise InvalidInput(f"example {index} and the context both have feature '{both[0]}'; give each "
                                   f"feature in one of them only")
        if features:
            check_features(index, own, shared, features)


def check_features(index: int, own: Any, shared: Any, features: Mapping[str, ExampleFeature]) -> None:
    """One example's features (its own, and the context's) against what the model reads."""
    for name, wanted in features.items():
        feature = own.get(name)  # a map's get() adds no entry
        if feature is None:
            feature = shared.get(name)
        kind = None if feature is None else feature.WhichOneof("kind")
        if kind is None:
            if wanted.required:
                raise InvalidInput(f"example {index}: feature '{name}' is missing; the model requires it "
                                   f"({describe(wanted)})")
            continue
        if kind != wanted.kind:
            raise InvalidInput(f"example {index}: feature '{name}' is a {kind}; the model reads it as "
                               f"{describe(wanted)}")
        if wanted.shape is not None:
            count = len(getattr(feature, kind).value)
            if not _fits(count, wanted.shape):
                raise InvalidInput(f"example {index}: feature '{name}' has {count} values; the model reads "
                                   f"{describe(wanted)}")


def _unit(shape: tuple[int, ...]) -> tuple[int, bool]:
    """(the values a dense feature of `shape` holds, whether it may hold any multiple of them: a
    variable-length one, -1 first)."""
    variable = bool(shape) and shape[0] < 0
    return math.prod(shape[1:] if variable else shape), variable


def _fits(count: int, shape: tuple[int, ...]) -> bool:
    each, variable = _unit(shape)
    if variable:
        return each == 0 or count % each == 0
    return count == each


def describe(feature: ExampleFeature) -> str:
    """E.g. "a float_list of 2 values", "an int64_list of any length"."""
    article = "an" if feature.kind[0] in "aeiou" else "a"
    if feature.shape is None:
        return f"{article} {feature.kind} of any length"
    each, variable = _unit(feature.shape)
    if variable:
        return f"{article} {feature.kind} of a multiple of {each} values"
    shape = f" (shape {list(feature.shape)})" if len(feature.shape) > 1 else ""
    return f"{article} {feature.kind} of {each} value{'s' if each != 1 else ''}{shape}"


def merged(examples: list[bytes], context: bytes) -> list[bytes]:
    """What the model gets: each example after the context's bytes (TF Serving's merge)."""
    if not context:
        return examples
    return [context + example for example in examples]


def request_bytes(model: str, signature: str, examples: list[bytes], context: bytes) -> bytes:
    """The ClassificationRequest (or RegressionRequest: the same fields) that carries these
    examples, serialized: what a request log records of a REST call."""
    request = serialized_input_pb2.SerializedExamplesRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = signature
    holder = request.input.example_list_with_context if context else request.input.example_list
    holder.examples.extend(examples)
    if context:
        request.input.example_list_with_context.context = context
    data: bytes = request.SerializeToString()
    return data
