"""What Triton's extensions say, the same way over gRPC and REST, as plain JSON-shaped values
(the REST body as is; parsed into the protos for gRPC): a model's configuration (ModelConfig), its
statistics (ModelStatistics), the repository index, and the parameters a repository load takes.

The configuration is built from what is served, not stored: TF Serving's layout has no
config.pbtxt. Its `dims` leave out the batch dimension (every served signature batches on its
first), `max_batch_size` and `dynamic_batching` are the version's effective batching (the server's
flags, the model's own fields over them); `max_queue_delay_microseconds` is the present bound of
the auto wait when the timeout is auto.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format

from protos.inference import model_config_pb2
from protos.tensorflow_serving import session_bundle_config_pb2
from server.api.control import ControlPlane
from server.api.v2 import codec as v2_codec
from server.api.v2 import model as v2_model
from server.core import batching_policy
from server.core.inference import predictor_of, signature_of
from server.core.model_config import CHECK_BASE, ModelSource, VersionPolicy
from server.core.repository import IndexEntry, Repository
from server.core.servables import Registry, Servable, State
from server.core.statistics import Duration, PeerStatistics, VersionStatistics, combined
from server.errors import InvalidInput, NotFound

BACKEND = "tensorflow"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "model_repository"]
"""What ServerMetadata lists: only what is implemented (v2 REST's binary tensors; the rest on both)."""
CONFIG_PARAMETER = "config"
FILE_PARAMETER = "file:"
UNLOAD_DEPENDENTS = "unload_dependents"
_LOADED = (State.AVAILABLE, State.UNLOADING)


def _triton_type(dtype: Any) -> str:
    name = v2_codec.datatype_of(dtype)
    return "TYPE_STRING" if name == "BYTES" else f"TYPE_{name}"


def _policy(policy: VersionPolicy) -> dict[str, Any]:
    if policy.kind == "all":
        return {"all": {}}
    if policy.kind == "specific":
        return {"specific": {"versions": sorted(policy.versions)}}
    return {"latest": {"num_versions": policy.num_versions}}


def config(registry: Registry, servable: Servable) -> dict[str, Any]:
    """ModelConfig of a served version (its default signature's tensors)."""
    described = signature_of(servable, "")
    batching = servable.batching
    assert batching is not None, "a served version has its batching"

    batched = described.batched
    skip = 1 if batched else 0  # Triton's dims leave the batch dimension out, where there is one

    def tensors(specs: Any) -> list[dict[str, Any]]:
        return [{"name": name, "data_type": _triton_type(spec.dtype),
                 "dims": [-1] if spec.shape is None else [-1 if d is None else d for d in spec.shape[skip:]]}
                for name, spec in specs.items()]

    delay_us = round(predictor_of(servable).batcher.wait_bound_s() * 1e6)
    found = {
        "name": servable.name, "platform": v2_model.PLATFORM, "backend": BACKEND,
        "version_policy": _policy(registry.models[servable.name].source.policy),
        "max_batch_size": batching.max_batch_size if batched else 0,  # 0: Triton's "no batch dimension"
        "input": [dict(t, format="FORMAT_NONE") for t in tensors(described.inputs)],
        "output": tensors(described.outputs),
    }
    if batching.batching and batched:  # without it, as Triton says a model is not dynamically batched
        found["dynamic_batching"] = {"preferred_batch_size": list(batching.allowed_batch_sizes),
                                     "max_queue_delay_microseconds": delay_us, "preserve_ordering": True}
    return found


def _duration(duration: Duration) -> dict[str, int]:
    return {"count": duration.count, "ns": duration.ns}


def _version_statistics(servable: Servable, others: list[VersionStatistics]) -> dict[str, Any]:
    stats: VersionStatistics = combined(servable.statistics, others)
    return {
        "name": servable.name, "version": str(servable.version), "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count, "execution_count": stats.execution_count,
        "inference_stats": {name: _duration(getattr(stats, name)) for name in (
            "success", "fail", "queue", "compute_input", "compute_infer", "compute_output")}
        | {"cache_hit": _duration(Duration()), "cache_miss": _duration(Duration())},
        "batch_stats": [{"batch_size": size, "compute_input": _duration(batch.compute_input),
                         "compute_infer": _duration(batch.compute_infer),
                         "compute_output": _duration(batch.compute_output)}
                        for size, batch in sorted(stats.batches.items())],
    }


async def statistics(registry: Registry, name: str, version_text: str, peers: PeerStatistics | None = None
                     ) -> dict[str, Any]:
    """ModelStatisticsResponse: every loaded version of every model (no name), of one model (no
    version), or one version, over every front-end process (`peers`: the others'). NotFound names
    what is loaded."""
    version = v2_model.parse_version(version_text, "version")
    if not name:
        if version is not None:
            raise InvalidInput("a version needs a model name")
        names = sorted(registry.models)
    else:
        registry.model(name)
        names = [name]
    servables = [s for n in names for _, s in sorted(registry.models[n].versions.items()) if s.state in _LOADED]
    if version is not None:
        servables = [s for s in servables if s.version == version]
        if not servables:
            loaded = ", ".join(str(v) for v in registry.models[name].available_versions()) or "none"
            raise NotFound(f"model '{name}' version {version} is not loaded; loaded versions: {loaded}")
    others = await peers([s.id for s in servables]) if peers is not None and servables else {}
    return {"model_stats": [_version_statistics(s, others.get(s.id, [])) for s in servables]}


def index(repository: Repository, ready_only: bool) -> list[dict[str, str]]:
    """The repository index as REST answers it (version and reason left out when empty)."""
    return [_entry(e) for e in repository.index(ready_only)]


def _entry(entry: IndexEntry) -> dict[str, str]:
    fields = {"name": entry.name, "version": entry.version, "state": entry.state, "reason": entry.reason}
    return {k: v for k, v in fields.items() if v or k in ("name", "state")}


async def load(repository: Repository, control: ControlPlane, name: str, parameters: Mapping[str, Any]) -> None:
    """A repository load call, its caller authorized: the folder, inside a model root (a subfolder
    may be a symlink out of it), with its parameters applied, served once this returns."""
    source = load_source(repository, name, parameters)
    control.check_paths([source])
    await repository.load(source)


async def unload(repository: Repository, name: str, parameters: Mapping[str, Any]) -> None:
    unknown = sorted(set(parameters) - {UNLOAD_DEPENDENTS})
    if unknown:
        raise InvalidInput(f"unknown unload parameter '{unknown[0][:80]}'; an unload takes '{UNLOAD_DEPENDENTS}' only")
    await repository.unload(name)


def load_source(repository: Repository, name: str, parameters: Mapping[str, Any]) -> ModelSource:
    """The model a load call asks for: the repository's folder `name`, with what its `config`
    parameter (ModelConfig JSON) sets of the version policy and batching. InvalidInput names any
    other parameter, or what is wrong with the config."""
    source = repository.source(name)
    for key in parameters:
        if key.startswith(FILE_PARAMETER):
            raise InvalidInput(f"parameter '{key[:80]}' uploads model files, which this server does not take: put "
                               f"the version folder under the model repository and load it by name")
        if key != CONFIG_PARAMETER:
            raise InvalidInput(f"unknown load parameter '{key[:80]}'; a load takes '{CONFIG_PARAMETER}' "
                               f"(ModelConfig JSON) only")
    if CONFIG_PARAMETER not in parameters:
        return source
    text = parameters[CONFIG_PARAMETER]
    if not isinstance(text, str):
        raise InvalidInput(f"parameter '{CONFIG_PARAMETER}' must be a string of ModelConfig JSON")
    model = model_config_pb2.ModelConfig()
    try:
        json_format.Parse(text, model)
    except json_format.ParseError as exc:
        raise InvalidInput(f"parameter '{CONFIG_PARAMETER}' is not a model configuration: {str(exc)[:300]}") from None
    return dataclasses.replace(source, **_config_fields(name, model))


def _config_fields(name: str, model: Any) -> dict[str, Any]:
    """ModelSource fields a load's ModelConfig sets; its tensors and platform are the SavedModel's
    (checked, not applied)."""
    where = f"parameter '{CONFIG_PARAMETER}'"
    if model.name and model.name != name:
        raise InvalidInput(f"{where} names model '{model.name[:80]}', but the load is of '{name}'")
    if model.platform not in ("", v2_model.PLATFORM) or model.backend not in ("", BACKEND):
        raise InvalidInput(f"{where}: platform '{model.platform[:40]}' backend '{model.backend[:40]}' is not "
                           f"served; this server serves '{v2_model.PLATFORM}' ('{BACKEND}')")
    fields: dict[str, Any] = {}
    choice = model.version_policy.WhichOneof("policy_choice")
    if choice == "all":
        fields["policy"] = VersionPolicy("all")
    elif choice == "specific":
        versions = list(model.version_policy.specific.versions)
        if not versions or min(versions) <= 0:
            raise InvalidInput(f"{where}: a specific version policy lists positive versions, got {versions}")
        fields["policy"] = VersionPolicy("specific", versions=frozenset(versions))
    elif choice == "latest":
        fields["policy"] = VersionPolicy("latest", max(1, model.version_policy.latest.num_versions))
    if model.max_batch_size < 0:
        raise InvalidInput(f"{where}: max_batch_size must be >= 0, got {model.max_batch_size}")
    params = session_bundle_config_pb2.BatchingParameters()
    sizes = list(model.dynamic_batching.preferred_batch_size)
    if model.max_batch_size > 0:
        params.max_batch_size.value = model.max_batch_size
    if sizes:
        params.allowed_batch_sizes.extend(sizes)
    if model.HasField("dynamic_batching") and model.dynamic_batching.max_queue_delay_microseconds:
        params.batch_timeout_micros.value = model.dynamic_batching.max_queue_delay_microseconds
    if params.ListFields():
        try:
            batching_policy.apply(CHECK_BASE, params)
        except ValueError as exc:
            raise InvalidInput(f"{where}: {exc}") from None
        fields["batching"] = params
    return fields
