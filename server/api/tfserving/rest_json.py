"""TensorFlow Serving's REST predict JSON (g3doc/api_rest.md) <-> named arrays. Pure.

Row format: `{"instances": [...]}`, one element per row; with one input an element is that
input's row, with several it is an object naming them. Answered `{"predictions": [...]}`: a row
per element, an object of outputs per row when there are several. Columnar format:
`{"inputs": value or {name: value}}`, answered `{"outputs": value or {name: value}}`. Binary
strings travel as {"b64": "..."}; an output whose name ends in `_bytes` is always written so, as
TF Serving does (and so is any other output whose bytes are not UTF-8).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from server.api.http import json_codec
from server.core.signatures import DEFAULT_SIGNATURE, TensorSpec
from server.dtypes import tf_name
from server.errors import InvalidInput
from server.limits import check_array

FIELDS = ("signature_name", "instances", "inputs")
BYTES_SUFFIX = "_bytes"


def parse_predict(body: Any) -> tuple[str, Any, bool]:
    """(signature_name, the instances or inputs value, row_format) of a predict body."""
    if not isinstance(body, dict):
        raise InvalidInput('the body must be a JSON object: {"instances": [...]} or {"inputs": ...}')
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise InvalidInput(f"unknown field {', '.join(repr(u) for u in unknown)} in the body; "
                           f"known: {', '.join(FIELDS)}")
    if ("instances" in body) == ("inputs" in body):
        raise InvalidInput('the body must have exactly one of "instances" (row format) and "inputs" '
                           '(columnar format)')
    signature_name = body.get("signature_name", "")
    if not isinstance(signature_name, str):
        raise InvalidInput('"signature_name" must be a string')
    row_format = "instances" in body
    return signature_name, body["instances" if row_format else "inputs"], row_format


def _named(value: Any, specs: Mapping[str, TensorSpec]) -> bool:
    """Whether a value is an object of named inputs (rather than the one input's value)."""
    return isinstance(value, dict) and not json_codec.is_b64(value) and (len(specs) != 1 or set(value) <= set(specs))


def decode_predict_body(raw: bytes, signatures: Mapping[str, Mapping[str, TensorSpec]], max_bytes: int
                        ) -> tuple[str, bool, dict[str, np.ndarray] | None]:
    """(signature name, row format, named arrays) of a predict body, given the input specs of each
    signature that may be asked for; the arrays are None when the body asks for another (the
    caller then says why it cannot be served). Pure and picklable: large bodies are decoded in a
    helper process (server.api.http.body)."""
    signature_name, value, row_format = parse_predict(json_codec.loads(raw))
    specs = signatures.get(signature_name or DEFAULT_SIGNATURE)
    if specs is None:
        return signature_name, row_format, None
    return signature_name, row_format, decode_inputs(value, row_format, specs, max_bytes)


def decode_inputs(value: Any, row_format: bool, specs: Mapping[str, TensorSpec],
                  max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """The named arrays of the instances (row format) or inputs (columnar) value, each refused when
    it takes more than max_bytes."""
    columns = _rows_to_columns(value, specs) if row_format else _columns(value, specs)
    arrays = {}
    for name, column in columns.items():
        spec = specs.get(name)
        if spec is None:
            raise InvalidInput(f"unexpected input '{name}'; the signature takes: {', '.join(sorted(specs))}")
        where = f"input '{name}'"
        arrays[name] = json_codec.array_from_json(column, spec.dtype, where, tf_name(spec.dtype))
        if max_bytes is not None:
            check_array(where, arrays[name], max_bytes)
    return arrays


def _sole(specs: Mapping[str, TensorSpec], what: str) -> str:
    if len(specs) != 1:
        raise InvalidInput(f"the signature takes {len(specs)} inputs ({', '.join(sorted(specs))}): each {what} "
                           f"must be an object naming them")
    return next(iter(specs))


def _columns(value: Any, specs: Mapping[str, TensorSpec]) -> dict[str, Any]:
    if _named(value, specs):
        return dict(value)
    return {_sole(specs, 'value of "inputs"'): value}


def _rows_to_columns(instances: Any, specs: Mapping[str, TensorSpec]) -> dict[str, list[Any]]:
    if not isinstance(instances, list) or not instances:
        raise InvalidInput('"instances" must be a non-empty list, one element per row')
    if not _named(instances[0], specs):
        name = _sole(specs, "instance")
        if any(_named(i, specs) for i in instances):
            raise InvalidInput("instances mix named objects and plain values; use one form")
        return {name: instances}
    names = list(instances[0])
    columns: dict[str, list[Any]] = {n: [] for n in names}
    for index, instance in enumerate(instances):
        if not _named(instance, specs) or set(instance) != set(names):
            raise InvalidInput(f"instance {index} does not name the same inputs as instance 0 "
                               f"({', '.join(names)}); every instance must")
        for name in names:
            columns[name].append(instance[name])
    return columns


def encode_outputs(outputs: Mapping[str, np.ndarray], row_format: bool) -> dict[str, Any]:
    """The response object: {"predictions": ...} or {"outputs": ...}."""
    if not row_format:
        encoded = {n: json_codec.array_to_json(a, n.endswith(BYTES_SUFFIX)) for n, a in outputs.items()}
        return {"outputs": next(iter(encoded.values())) if len(encoded) == 1 else encoded}
    scalar = next((n for n, a in outputs.items() if a.ndim == 0), None)
    if scalar is not None:
        raise InvalidInput(f"output '{scalar}' is a scalar, which the row format cannot hold; "
                           'send "inputs" (columnar) instead')
    rows = {n: json_codec.rows_to_json(a, n.endswith(BYTES_SUFFIX)) for n, a in outputs.items()}
    if len(rows) == 1:
        return {"predictions": next(iter(rows.values()))}
    counts = {len(r) for r in rows.values()}
    if len(counts) != 1:
        raise InvalidInput("the outputs have different numbers of rows, which the row format cannot hold; "
                           'send "inputs" (columnar) instead')
    names = list(rows)
    return {"predictions": [dict(zip(names, values, strict=True)) for values in zip(*rows.values(), strict=True)]}
