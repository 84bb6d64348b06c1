"""TF Serving's GetModelMetadataResponse of a SavedModel, built from its own SignatureDefs: what the
bench's reference batcher and fixed-response server answer, so that clients which read the
metadata first (perf_analyzer --service-kind tfserving) can drive them as they drive this server.
Imports TensorFlow: for the bench's helper processes, never the server's."""

from __future__ import annotations

from pathlib import Path

from protos.tensorflow_serving import get_model_metadata_pb2


def metadata_file(response: Path) -> Path:
    """Where bench.inprocess writes the metadata beside the fixed server's PredictResponse."""
    return response.with_suffix(".metadata.pb")


def metadata_response(version_dir: Path, name: str, version: int) -> bytes:
    from tensorflow.python.tools import saved_model_utils

    meta_graph = saved_model_utils.get_meta_graph_def(str(version_dir), "serve")
    signature_map = get_model_metadata_pb2.SignatureDefMap()
    for key, definition in meta_graph.signature_def.items():
        if not key.startswith("__"):  # __saved_model_init_op is not a signature a client calls
            signature_map.signature_def[key].ParseFromString(definition.SerializeToString())
    response = get_model_metadata_pb2.GetModelMetadataResponse()
    response.model_spec.name = name
    response.model_spec.version.value = version
    response.metadata["signature_def"].Pack(signature_map, deterministic=True)
    return bytes(response.SerializeToString())
