"""Find and load a SavedModel in TensorFlow Serving's layout (BASE/<version>/saved_model.pb).

Which versions are served is the version policy's business (server.core.model_config); here, finding
the version folders and loading one. Signatures are read twice, on purpose: from the
saved_model.pb's SignatureDefs (exactly what TF Serving returns from GetModelMetadata, tensor
names included) and as callable functions of the model loaded under the strategy's scope, so
every replica holds its own copy of the variables.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import tensor_shape_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from server.codec import numpy_dtype
from server.core.signatures import ModelInfo, Signature, TensorSpec
from server.limits import ascii_int64


@dataclass(frozen=True)
class LoadedModel:
    info: ModelInfo
    path: Path
    signature_defs: dict[str, meta_graph_pb2.SignatureDef]
    functions: dict[str, Any]
    handle: Any
    """The loaded object; holding it keeps the variables alive."""


def scan_versions(base_path: str | Path) -> dict[int, Path]:
    """The numeric version folders under base_path that hold a saved_model.pb. Anything else is
    ignored, so a version copied in under a dot-name (.3) and then renamed appears only whole."""
    base = Path(base_path)
    if not base.is_dir():
        raise FileNotFoundError(f"model base path {base} is not a folder")
    versions = {}
    for path in base.iterdir():
        version = ascii_int64(path.name)
        if version is not None and (path / "saved_model.pb").is_file():
            versions[version] = path
    return versions


def _shape(proto: tensor_shape_pb2.TensorShapeProto) -> tuple[int | None, ...] | None:
    if proto.unknown_rank:
        return None
    return tuple(None if d.size < 0 else int(d.size) for d in proto.dim)


def read_signature_defs(version_dir: Path) -> dict[str, meta_graph_pb2.SignatureDef]:
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((version_dir / "saved_model.pb").read_bytes())
    graphs = [g for g in saved.meta_graphs if "serve" in g.meta_info_def.tags] or list(saved.meta_graphs)
    if not graphs:
        raise ValueError(f"{version_dir}/saved_model.pb holds no meta graph")
    return {k: v for k, v in graphs[0].signature_def.items() if not k.startswith("__")}


def signature_from_def(name: str, sdef: meta_graph_pb2.SignatureDef) -> Signature:
    def specs(infos: Any) -> dict[str, TensorSpec]:
        return {k: TensorSpec(numpy_dtype(v.dtype), _shape(v.tensor_shape)) for k, v in infos.items()}

    return Signature(name=name, inputs=specs(sdef.inputs), outputs=specs(sdef.outputs))


def load(version_dir: str | Path, name: str, version: int, strategy: tf.distribute.Strategy) -> LoadedModel:
    """Load one version folder under the strategy's scope (every replica holds the variables)."""
    version_dir = Path(version_dir)
    defs = read_signature_defs(version_dir)
    with strategy.scope():
        handle = tf.saved_model.load(str(version_dir))
    signatures = {k: signature_from_def(k, d) for k, d in defs.items()}
    functions = {k: handle.signatures[k] for k in signatures}
    unservable = {k: p for k, s in signatures.items() if (p := s.batching_problem()) is not None}
    info = ModelInfo(name=name, version=version, signatures=signatures, unservable=unservable)
    return LoadedModel(info=info, path=version_dir, signature_defs=defs, functions=functions, handle=handle)
