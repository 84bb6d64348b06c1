"""TF Serving's REST classify and regress JSON (g3doc/api_rest.md) <-> serialized tf.Examples and
results. Pure: no HTTP.

A body is `{"signature_name": ..., "context": {features}, "examples": [{features}, ...]}`; a
feature is a value or a list of values, all of one kind, typed as TF Serving types them
(util/json_tensor.cc): an integer (or true/false) is int64, a number with a fraction or exponent
float, a string bytes (its UTF-8), {"b64": "..."} bytes (decoded). One difference: a list of
numbers some of which have a fraction is all floats, where TF Serving refuses it. An empty list is
a feature with no list set, which the model treats as absent. Answers are `{"results": [[[label, score], ...], ...]}`
for classify and `{"results": [value, ...]}` for regress.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from protos.tf.tensorflow.core.example import example_pb2
from server.api.http import json_codec
from server.api.tfserving import tf_example
from server.api.tfserving.examples import label_text
from server.core.example_methods import CLASSES, OUTPUTS, SCORES
from server.core.signatures import DEFAULT_SIGNATURE, ExampleFeature
from server.errors import InvalidInput, Overloaded

FIELDS = ("signature_name", "context", "examples")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def decode_body(raw: bytes, verb: str, features: Mapping[str, Mapping[str, ExampleFeature] | None], max_bytes: int,
                max_examples: int) -> tuple[str, list[bytes], bytes]:
    """(signature_name, the serialized examples, the serialized context or b"") of a classify or
    regress body, each example checked against the features of the signature it names (when that
    signature takes examples: `features` has them by signature); more than `max_examples` (what
    could ever be queued) are refused before they are built. Picklable: a large body is decoded
    in the helper process (server.api.http.body)."""
    body = json_codec.loads(raw)
    if not isinstance(body, dict):
        raise InvalidInput('the body must be a JSON object: {"examples": [...]}, optionally with "context" and '
                           '"signature_name"')
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise InvalidInput(f"unknown field {', '.join(repr(u[:100]) for u in unknown[:5])} in the body; "
                           f"known: {', '.join(FIELDS)}")
    signature_name = body.get("signature_name", "")
    if not isinstance(signature_name, str):
        raise InvalidInput('"signature_name" must be a string')
    if "examples" not in body:
        raise InvalidInput(f"When method is {verb}, key 'examples' is expected and was not found")
    values = body["examples"]
    if not isinstance(values, list):
        raise InvalidInput("Expecting 'examples' value to be an list/array")
    if not values:
        raise InvalidInput("'examples' value is an empty array")
    if len(values) > max_examples:
        raise Overloaded(f"request has {len(values)} examples; at most {max_examples} rows may be queued")
    shared = example_from_json(body["context"], "the context") if "context" in body else None
    parsed = [example_from_json(value, f"example {i}") for i, value in enumerate(values)]
    context = b"" if shared is None else shared.SerializeToString()
    examples = [example.SerializeToString() for example in parsed]
    tf_example.check_size(examples, context, max_bytes)
    tf_example.check_parsed(parsed, shared, features.get(signature_name or DEFAULT_SIGNATURE))
    return signature_name, examples, context


def example_from_json(value: Any, where: str) -> Any:
    """A tf.Example from a JSON object of features."""
    if not isinstance(value, dict) or json_codec.is_b64(value):
        raise InvalidInput(f"{where}: Example must be JSON object but got JSON {_json_type(value)}")
    example = example_pb2.Example()
    features = example.features.feature
    for name, content in value.items():
        feature = features[name]
        kind, values = _feature_values(content if isinstance(content, list) else (content,), name, where)
        if kind is not None:
            getattr(feature, kind).value.extend(values)  # one call a feature: a call a value costs more
    return example


def _feature_values(items: Any, name: str, where: str) -> tuple[str | None, list[Any]]:
    """(the list kind, the values) of one feature's JSON values: of one kind, as TF Serving types
    them, except that numbers with and without a fraction together are floats (TF Serving refuses
    [1.5, 2]); (None, []) for an empty list, a Feature with no list set."""
    floats = any(isinstance(i, float) for i in items) and all(
        isinstance(i, (int, float)) and not isinstance(i, bool) for i in items)
    kind: str | None = None
    values: list[Any] = []
    for item in items:
        this, converted = _typed(float(item) if floats else item, name, where)
        if kind is not None and this != kind:
            raise InvalidInput(f"{where}: Unexpected element type in feature: {name} expecting type: "
                               f"{kind.split('_')[0]} (got a {this.split('_')[0]} value)")
        kind = this
        values.append(converted)
    return kind, values


def _typed(item: Any, name: str, where: str) -> tuple[str, Any]:
    """One JSON value's list kind and value."""
    if isinstance(item, bool):
        return "int64_list", int(item)
    if isinstance(item, int):
        if not INT64_MIN <= item <= INT64_MAX:
            raise InvalidInput(f"{where}: feature '{name}' has an integer out of int64's range; only int64 is "
                               f"supported")
        return "int64_list", item
    if isinstance(item, float):
        return "float_list", item
    if isinstance(item, str):
        return "bytes_list", json_codec.text_bytes(item)
    if json_codec.is_b64(item):
        return "bytes_list", json_codec.b64_bytes(item, f"{where}: feature '{name}'")
    raise InvalidInput(f"{where}: feature '{name}' has an element of JSON type {_json_type(item)}; a feature is a "
                       f"number, a string, true/false, {{\"b64\": ...}}, or a list of one kind of them")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def classification_json(outputs: Mapping[str, np.ndarray]) -> Any:
    """{"results": per example, [label, score] per class} (a label "" without classes, a score 0
    without scores, as the gRPC result). Scores stay float32, which the JSON writer prints in
    their shortest form."""
    classes = outputs.get(CLASSES)
    scores = outputs.get(SCORES)
    rows, columns = (classes if classes is not None else scores).shape  # type: ignore[union-attr]
    if scores is None:
        scores = np.zeros((rows, columns), np.float32)
    return {"results": [[[label_text(classes[row, column]) if classes is not None else "", scores[row, column]]
                         for column in range(columns)] for row in range(rows)]}


def regression_json(outputs: Mapping[str, np.ndarray]) -> Any:
    return {"results": outputs[OUTPUTS]}
