"""What both Open Inference Protocol front-ends (gRPC and REST) say about a model the same way:
versions as the protocol's strings, the signature a request addresses, and model metadata."""

from __future__ import annotations

from typing import Any

from server.api.v2 import codec as v2_codec
from server.core.inference import signature_of
from server.core.servables import Registry, Servable
from server.errors import InvalidInput, NotFound, Unavailable
from server.limits import MAX_VERSION, ascii_int64

SERVER_NAME = "mirrorserve"
PLATFORM = "tensorflow_savedmodel"
SIGNATURE_PARAMETER = "signature_name"


def parse_version(text: str, where: str) -> int | None:
    """A version string: empty for the highest available, else a number."""
    if not text:
        return None
    version = ascii_int64(text)
    if version is None:
        raise InvalidInput(f"{where} '{text[:40]}' is not a version number (ASCII digits, at most {MAX_VERSION})")
    return version


def is_ready(registry: Registry, name: str, version_text: str) -> bool:
    """ModelReady's answer: whether the version resolves to a serving one. An unknown model or
    version is not ready rather than an error; only a malformed version string is one."""
    version = parse_version(version_text, "version")
    try:
        registry.resolve(name, version)
    except (NotFound, Unavailable):
        return False
    return True


def metadata(registry: Registry, servable: Servable) -> dict[str, Any]:
    """ModelMetadataResponse's fields, as plain values: the default signature's tensors, with -1
    for the batch dimension (and any other dimension of unknown size)."""
    described = signature_of(servable, "")

    def tensors(specs: Any) -> list[dict[str, Any]]:
        return [{"name": name, "datatype": v2_codec.datatype_of(spec.dtype),
                 "shape": [] if spec.shape is None else [-1 if d is None else d for d in spec.shape]}
                for name, spec in specs.items()]

    return {"name": servable.name, "versions": [str(v) for v in registry.models[servable.name].available_versions()],
            "platform": PLATFORM, "inputs": tensors(described.inputs), "outputs": tensors(described.outputs)}
