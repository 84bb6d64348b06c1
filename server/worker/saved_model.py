"""Load one SavedModel version folder in the model worker.

Signatures are read twice, on purpose: from the saved_model.pb's SignatureDefs (exactly what TF
Serving returns from GetModelMetadata, tensor names included; sent to the serving process as plain
data) and as callable functions of the model loaded under the strategy's scope, so every replica
holds its own copy of the variables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_shape_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from server.core.signatures import ModelInfo, Signature, SignatureDefinition, TensorInfo, TensorSpec
from server.dtypes import numpy_dtype
from server.worker.example_features import example_features, warm_up_example


@dataclass(frozen=True)
class LoadedModel:
    info: ModelInfo
    path: Path
    signature_defs: dict[str, SignatureDefinition]
    functions: dict[str, Any]
    handle: Any
    """The loaded object; holding it keeps the variables alive."""


def _dims(proto: tensor_shape_pb2.TensorShapeProto) -> tuple[tuple[int, str], ...] | None:
    if proto.unknown_rank:
        return None
    return tuple((int(d.size), str(d.name)) for d in proto.dim)


def _definition(sdef: meta_graph_pb2.SignatureDef) -> SignatureDefinition:
    def infos(protos: Any) -> dict[str, TensorInfo]:
        return {k: TensorInfo(str(v.name), int(v.dtype), _dims(v.tensor_shape)) for k, v in sorted(protos.items())}

    return SignatureDefinition(str(sdef.method_name), infos(sdef.inputs), infos(sdef.outputs))


def read_signature_defs(version_dir: Path) -> dict[str, SignatureDefinition]:
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((version_dir / "saved_model.pb").read_bytes())
    graphs = [g for g in saved.meta_graphs if "serve" in g.meta_info_def.tags] or list(saved.meta_graphs)
    if not graphs:
        raise ValueError(f"{version_dir}/saved_model.pb holds no meta graph")
    # Sorted: a proto map's iteration order differs from process to process, and the order reaches
    # clients (GetModelMetadata's maps, v2 metadata's tensor lists, outputs in signature order).
    return {k: _definition(v) for k, v in sorted(graphs[0].signature_def.items()) if not k.startswith("__")}


def signature_from_def(name: str, sdef: SignatureDefinition) -> Signature:
    def specs(infos: Mapping[str, TensorInfo]) -> dict[str, TensorSpec]:
        return {k: TensorSpec(_numpy(v.dtype), None if v.dims is None else tuple(None if size < 0 else size
                                                                                 for size, _ in v.dims))
                for k, v in infos.items()}

    return Signature(name=name, inputs=specs(sdef.inputs), outputs=specs(sdef.outputs))


def _with_features(signature: Signature, function: Any) -> Signature:
    """A signature of one string input may take serialized tf.Examples: note what it parses."""
    inputs = list(signature.inputs.values())
    if len(inputs) != 1 or inputs[0].dtype != object:
        return signature
    features = example_features(function)
    if not features:
        return signature
    return dataclasses.replace(signature, features=features, warm_up_example=warm_up_example(features))


def _numpy(enum: int) -> np.dtype:
    try:
        name = str(types_pb2.DataType.Name(enum))
    except ValueError:
        name = ""
    return numpy_dtype(enum, name)


def load(version_dir: str | Path, name: str, version: int, strategy: tf.distribute.Strategy) -> LoadedModel:
    """Load one version folder under the strategy's scope (every replica holds the variables)."""
    version_dir = Path(version_dir)
    defs = read_signature_defs(version_dir)
    with strategy.scope():
        handle = tf.saved_model.load(str(version_dir))
    functions = {k: handle.signatures[k] for k in defs}
    signatures = {k: _with_features(signature_from_def(k, d), functions[k]) for k, d in defs.items()}
    unbatched = {k: p for k, s in signatures.items() if (p := s.batching_problem()) is not None}
    info = ModelInfo(name=name, version=version, signatures=signatures, unbatched=unbatched)
    return LoadedModel(info=info, path=version_dir, signature_defs=defs, functions=functions, handle=handle)
