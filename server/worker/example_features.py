"""The features a signature's tf.io.parse_example reads, found in its graph at load.

Classify and Regress requests carry serialized tf.Examples, which the model parses itself. One bad
example (a missing feature, a wrong type) would fail the whole batch it shares with other clients'
requests, and TensorFlow's message names neither the request nor the example. So at load the
worker reads the parse spec out of the graph: every ParseExample / ParseExampleV2 node, in the
signature's graph and the functions it calls, with its constant key and default inputs. The
serving process then checks each example against it before batching (server.api.tfserving.tf_example).

What cannot be read for sure gives None, and the examples then go to the model unchecked: another
parse op (ParseSingleExample, ParseSequenceExample, DecodeProto), keys that are not constants, or
two parse ops that disagree on a feature. A default that cannot be read counts as a default, so
a check never refuses what the model would accept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2

from server.core.signatures import ExampleFeature

PARSERS = ("ParseExample", "ParseExampleV2")
OPAQUE = ("ParseSingleExample", "ParseSequenceExample", "ParseSequenceExampleV2", "ParseSingleSequenceExample",
          "DecodeProtoV2")
"""Ops that read examples in a way not checked here: a graph holding one is not checked at all."""
KINDS = {types_pb2.DT_STRING: "bytes_list", types_pb2.DT_FLOAT: "float_list", types_pb2.DT_INT64: "int64_list"}
PASS_THROUGH = ("Identity", "Reshape", "Squeeze", "ExpandDims")
"""Ops between a constant and the parse op that keep its values and their number."""


class Unreadable(Exception):
    """The parse spec cannot be read for sure."""


def example_features(function: Any) -> dict[str, ExampleFeature] | None:
    """The features a signature function's parse ops read, or None (see the module docstring)."""
    graph_def = function.graph.as_graph_def()
    try:
        return _features(graph_def)
    except Unreadable:
        return None


def _features(graph_def: graph_pb2.GraphDef) -> dict[str, ExampleFeature] | None:
    bodies: list[Sequence[node_def_pb2.NodeDef]] = [graph_def.node, *(f.node_def for f in graph_def.library.function)]
    found: dict[str, ExampleFeature] = {}
    parsers = 0
    for nodes in bodies:
        by_name = {node.name: node for node in nodes}
        for node in nodes:
            if node.op in OPAQUE:
                raise Unreadable(node.op)
            if node.op not in PARSERS:
                continue
            parsers += 1
            for name, feature in _parse_op(node, by_name).items():
                if found.setdefault(name, feature) != feature:
                    raise Unreadable(f"two parse ops read feature {name} differently")
    return found if parsers else None


def _parse_op(node: node_def_pb2.NodeDef, by_name: Mapping[str, node_def_pb2.NodeDef]) -> dict[str, ExampleFeature]:
    inputs = [i for i in node.input if not i.startswith("^")]
    dense_types = list(node.attr["Tdense"].list.type)
    dense_shapes = [tuple(int(d.size) for d in shape.dim) for shape in node.attr["dense_shapes"].list.shape]
    if node.op == "ParseExampleV2":
        sparse_keys = _keys(inputs[2], by_name)
        dense_keys = _keys(inputs[3], by_name)
        ragged_keys = _keys(inputs[4], by_name)
        defaults = inputs[5:]
        sparse_types = list(node.attr["sparse_types"].list.type)
        ragged_types = list(node.attr["ragged_value_types"].list.type)
    else:
        sparse_count = node.attr["Nsparse"].i
        dense_count = node.attr["Ndense"].i
        sparse_keys = [k for ref in inputs[2:2 + sparse_count] for k in _keys(ref, by_name)]
        dense_keys = [k for ref in inputs[2 + sparse_count:2 + sparse_count + dense_count] for k in _keys(ref, by_name)]
        defaults = inputs[2 + sparse_count + dense_count:]
        sparse_types = list(node.attr["sparse_types"].list.type)
        ragged_keys, ragged_types = [], []
    if not (len(dense_keys) == len(dense_types) == len(dense_shapes) == len(defaults)
            and len(sparse_keys) == len(sparse_types) and len(ragged_keys) == len(ragged_types)):
        raise Unreadable(f"{node.name}: keys and types do not line up")
    features: dict[str, ExampleFeature] = {}
    for key, dtype in [*zip(sparse_keys, sparse_types, strict=True), *zip(ragged_keys, ragged_types, strict=True)]:
        _add(features, key, ExampleFeature(_kind(dtype), None, False))
    for key, dtype, shape, default in zip(dense_keys, dense_types, dense_shapes, defaults, strict=True):
        _add(features, key, ExampleFeature(_kind(dtype), shape, _size(default, by_name) == 0))
    return features


def _add(features: dict[str, ExampleFeature], key: str, feature: ExampleFeature) -> None:
    if features.setdefault(key, feature) != feature:
        raise Unreadable(f"feature {key} is read twice, differently")


def _kind(dtype: int) -> str:
    kind = KINDS.get(dtype)
    if kind is None:
        raise Unreadable(f"a feature of type {dtype}")
    return kind


def _const(ref: str, by_name: Mapping[str, node_def_pb2.NodeDef]) -> Any:
    """The constant values a node input refers to, or Unreadable. A reference is "node" or
    "node:1" in a graph, "node:output:0" in a function."""
    node = by_name.get(ref.split(":")[0])
    for _ in range(16):
        if node is None:
            break
        if node.op == "Const":
            return tf.make_ndarray(node.attr["value"].tensor)
        if node.op not in PASS_THROUGH:
            break
        node = by_name.get(node.input[0].split(":")[0])
    raise Unreadable(f"input {ref} is not a constant")


def _keys(ref: str, by_name: Mapping[str, node_def_pb2.NodeDef]) -> list[str]:
    value = _const(ref, by_name)
    return [k.decode() if isinstance(k, bytes) else str(k) for k in value.ravel().tolist()]


def _size(ref: str, by_name: Mapping[str, node_def_pb2.NodeDef]) -> int:
    """A dense default's number of values (0: none, the feature is required); 1 when unreadable."""
    try:
        value = _const(ref, by_name)
    except Unreadable:
        return 1
    return int(math.prod(value.shape))


def warm_up_example(features: Mapping[str, ExampleFeature]) -> bytes:
    """A serialized tf.Example that passes the parse: every required feature, zeros (or empty
    strings) as many as its shape holds, so that a warm-up run gets past the parse op."""
    example = tf.train.Example()
    for name, feature in features.items():
        if not feature.required or feature.shape is None:
            continue
        count = math.prod(max(size, 1) for size in feature.shape)
        values = getattr(example.features.feature[name], feature.kind).value
        values.extend([b""] * count if feature.kind == "bytes_list" else [0] * count)
    data: bytes = example.SerializeToString()
    return data
