"""Open Inference Protocol (v2) requests for the bench. Its own module: the generated
`inference` protos clash with tritonclient's in one process, so only code that needs them imports
this (never `client.api`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from protos.inference import grpc_service_pb2
from server.api.v2.codec import encode_raw

INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"


def build_infer_request(model: str, inputs: Mapping[str, np.ndarray], *, signature: str = "",
                        version: int | None = None) -> Any:
    """A ModelInferRequest with every input in raw_input_contents (as tritonclient sends them)."""
    request = grpc_service_pb2.ModelInferRequest(model_name=model,
                                                 model_version="" if version is None else str(version))
    if signature:
        request.parameters["signature_name"].string_param = signature
    for name, array in inputs.items():
        datatype, raw = encode_raw(np.asarray(array))
        request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        request.raw_input_contents.append(raw)
    return request
