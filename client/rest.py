"""TensorFlow Serving REST predict bodies, for the bench: the row format (`instances`) most REST
clients send, binary strings as {"b64": ...}."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson


def _json_value(array: np.ndarray) -> Any:
    if array.dtype.kind in "OS":
        flat = [{"b64": base64.b64encode(v if isinstance(v, bytes) else str(v).encode()).decode()}
                for v in array.ravel()]
        return np.array(flat, dtype=object).reshape(array.shape).tolist()
    return array.tolist()


def build_predict_body(inputs: Mapping[str, np.ndarray], *, signature: str = "") -> bytes:
    """{"instances": [...]}: each row the one input's row, or an object naming every input's row."""
    columns = {name: _json_value(np.asarray(array)) for name, array in inputs.items()}
    if len(columns) == 1:
        instances = next(iter(columns.values()))
    else:
        instances = [dict(zip(columns, row, strict=True)) for row in zip(*columns.values(), strict=True)]
    body: dict[str, Any] = {"instances": instances}
    if signature:
        body["signature_name"] = signature
    return orjson.dumps(body)


def predict_url(target: str, model: str, version: int | None = None) -> str:
    """http://TARGET/v1/models/MODEL[/versions/N]:predict"""
    versioned = "" if version is None else f"/versions/{version}"
    return f"http://{target}/v1/models/{model}{versioned}:predict"
