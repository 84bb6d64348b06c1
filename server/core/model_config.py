"""Which models to serve: TensorFlow Serving's ModelServerConfig (text format, or the proto a
HandleReloadConfigRequest carries), or the one-model shorthand of --model-base-path/--model-name,
turned into plain ModelSource values. Pure: no TensorFlow, no I/O beyond reading the file.

Errors are ConfigError (a ValueError, so a bad file at start-up exits 2) and name the file and
line: text_format's own for syntax and unknown fields, the `config {` block's line for the checks
made here (a bad policy, a duplicate name, a label that cannot resolve).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from protos.tensorflow_serving import model_server_config_pb2, session_bundle_config_pb2
from server.core import batching_policy
from server.core.version_folders import local_path

PLATFORMS = ("", "tensorflow")


class ConfigError(ValueError):
    """A model config that cannot be served; the message names where."""




@dataclass(frozen=True)
class VersionPolicy:
    """TF Serving's ServableVersionPolicy: which version folders on disk are served."""

    kind: str
    """latest, all or specific."""
    num_versions: int = 1
    versions: frozenset[int] = frozenset()

    def aspired(self, on_disk: Sequence[int]) -> set[int]:
        """The versions to serve, given the numeric version folders found."""
        if self.kind == "all":
            return set(on_disk)
        if self.kind == "specific":
            return set(self.versions) & set(on_disk)
        return set(sorted(on_disk)[-self.num_versions:]) if on_disk else set()

    def describe(self) -> str:
        if self.kind == "latest":
            return f"latest {self.num_versions}"
        if self.kind == "specific":
            return "specific " + ",".join(str(v) for v in sorted(self.versions))
        return "all"


LATEST_ONE = VersionPolicy("latest", 1)
CHECK_BASE = batching_policy.BatchingPolicy(max_batch_size=1, batch_timeout_s=None, max_inflight_batches=1,
                                            max_queued_rows=1)
"""A policy to check a model's batching fields against, whatever the server's turns out to be: a
model's own sizes come whole (see batching_policy), so only the fields themselves can be wrong."""


@dataclass(frozen=True)
class RequestLogging:
    """A model's logging_config: a share of its requests, with their responses, written to
    TFRecord files named from filename_prefix (server.api.request_log)."""

    filename_prefix: str
    sampling_rate: float


LOG_COLLECTORS = ("file",)
"""log_collector_config.type values served: TFRecord files of PredictionLogs."""


@dataclass(frozen=True)
class ModelSource:
    """One configured model: its name, where its versions live, and which of them to serve."""

    name: str
    base_path: str
    policy: VersionPolicy = LATEST_ONE
    labels: Mapping[str, int] = field(default_factory=dict)
    batching: session_bundle_config_pb2.BatchingParameters | None = None
    """This model's own batching fields (our `batching_parameters` extension), over the server's."""
    logging: RequestLogging | None = None


def shorthand(base_path: str, name: str) -> list[ModelSource]:
    """--model-base-path/--model-name: one model, its highest version (a local path by now:
    server.config made it one)."""
    return [ModelSource(name=name, base_path=base_path)]


def read_config_file(path: str | os.PathLike[str]) -> list[ModelSource]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read model config file {path}: {exc.strerror or exc}") from None
    return parse_config_text(text, str(path))


def parse_config_text(text: str, where: str = "<config>") -> list[ModelSource]:
    """Parse ModelServerConfig text format (a user's TF Serving file, unchanged)."""
    config = model_server_config_pb2.ModelServerConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(f"{where}:{exc}") from None
    return from_proto(config, where, _config_lines(text))


def from_proto(
    config: model_server_config_pb2.ModelServerConfig, where: str = "the config", lines: Sequence[int] = ()
) -> list[ModelSource]:
    """Check a ModelServerConfig and turn it into sources; `lines` are the 1-based lines of the
    `config {` blocks, when the config came from text."""
    choice = config.WhichOneof("config")
    if choice == "custom_model_config":
        raise ConfigError(f"{where}: custom_model_config is not supported; use model_config_list")
    if choice is None:
        raise ConfigError(f"{where}: model_config_list is missing or empty; it must list at least one config")
    sources: list[ModelSource] = []
    seen: dict[str, str] = {}
    for index, model in enumerate(config.model_config_list.config):
        at = f"{where}:{lines[index]}" if index < len(lines) else f"{where}: config #{index + 1}"
        source = _source(model, at)
        if source.name in seen:
            raise ConfigError(f"{at}: model name '{source.name}' is configured twice (first at {seen[source.name]})")
        seen[source.name] = at
        sources.append(source)
    if not sources:
        raise ConfigError(f"{where}: model_config_list lists no config")
    return sources


def _source(model: model_server_config_pb2.ModelConfig, at: str) -> ModelSource:
    if not model.name:
        raise ConfigError(f"{at}: a config has no name")
    if not model.base_path:
        raise ConfigError(f"{at}: model '{model.name}' has no base_path")
    if model.model_platform not in PLATFORMS:
        raise ConfigError(f"{at}: model '{model.name}' has model_platform '{model.model_platform}'; "
                          f"only 'tensorflow' is served")
    policy = _policy(model, at)
    labels = dict(model.version_labels)
    for label, version in labels.items():
        if not label:
            raise ConfigError(f"{at}: model '{model.name}' has an empty version label")
        if version <= 0:
            raise ConfigError(f"{at}: model '{model.name}' label '{label}' points at version {version}; "
                              f"versions are positive")
        if policy.kind == "specific" and version not in policy.versions:
            raise ConfigError(
                f"{at}: model '{model.name}' label '{label}' points at version {version}, which its "
                f"specific policy does not serve ({policy.describe()})")
    batching = None
    if model.HasField("batching_parameters"):
        batching = session_bundle_config_pb2.BatchingParameters()
        batching.CopyFrom(model.batching_parameters)
        try:
            batching_policy.apply(CHECK_BASE, batching)
        except ValueError as exc:
            raise ConfigError(f"{at}: model '{model.name}' batching_parameters: {exc}") from None
    try:
        base_path = local_path(model.base_path, f"{at}: model '{model.name}' base_path")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return ModelSource(name=model.name, base_path=base_path, policy=policy, labels=labels, batching=batching,
                       logging=_logging(model, at))


def _logging(model: model_server_config_pb2.ModelConfig, at: str) -> RequestLogging | None:
    if not model.HasField("logging_config"):
        return None
    config = model.logging_config
    where = f"{at}: model '{model.name}' logging_config"
    collector = config.log_collector_config
    if collector.type not in LOG_COLLECTORS:
        raise ConfigError(f"{where}: log_collector_config type '{collector.type}' is not supported; "
                          f"supported: {', '.join(LOG_COLLECTORS)}")
    if not collector.filename_prefix:
        raise ConfigError(f"{where}: log_collector_config has no filename_prefix")
    if config.HasField("custom_logging_config"):
        raise ConfigError(f"{where}: custom_logging_config is not supported")
    sampling = config.sampling_config
    if sampling.per_task_sampling_configs:
        raise ConfigError(f"{where}: per_task_sampling_configs are not supported; use sampling_rate")
    if not 0.0 <= sampling.sampling_rate <= 1.0:
        raise ConfigError(f"{where}: sampling_rate {sampling.sampling_rate:g} is not between 0 and 1")
    return RequestLogging(collector.filename_prefix, sampling.sampling_rate)


def _policy(model: model_server_config_pb2.ModelConfig, at: str) -> VersionPolicy:
    chosen = model.model_version_policy.WhichOneof("policy_choice")
    if chosen is None or chosen == "latest":
        # As in TF Serving, `latest {}` (num_versions 0) means the one highest version.
        return VersionPolicy("latest", max(1, model.model_version_policy.latest.num_versions))
    if chosen == "all":
        return VersionPolicy("all")
    versions = list(model.model_version_policy.specific.versions)
    if not versions:
        raise ConfigError(f"{at}: model '{model.name}' has a specific version policy that lists no versions")
    bad = [v for v in versions if v <= 0]
    if bad:
        raise ConfigError(f"{at}: model '{model.name}' specific policy lists version {bad[0]}; versions are positive")
    return VersionPolicy("specific", versions=frozenset(versions))


def _config_lines(text: str) -> list[int]:
    """The line of each `config` block directly inside model_config_list, in order."""
    tokenizer = text_format.Tokenizer(text.splitlines())
    lines: list[int] = []
    path: list[str] = []
    last = ""
    while not tokenizer.AtEnd():
        token = tokenizer.token
        line = tokenizer._line + 1  # the tokenizer offers no public position
        if token in ("{", "<"):
            path.append(last)
            if path == ["model_config_list", "config"]:
                lines.append(line)
        elif token in ("}", ">") and path:
            path.pop()
        elif token != ":":
            last = token
        try:
            tokenizer.NextToken()
        except text_format.ParseError:
            break
    return lines


def _shown(message: Any, name: str, wrapped: bool) -> str:
    if wrapped and not message.HasField(name):
        return "unset"
    text = str(getattr(message, name)).strip().replace("\n", " ")
    return text.removeprefix("value: ") if wrapped else text


def batching_changes(old: session_bundle_config_pb2.BatchingParameters | None,
                     new: session_bundle_config_pb2.BatchingParameters | None) -> list[str]:
    """The batching_parameters fields that differ, each as 'field OLD -> NEW' ('unset' where absent)."""
    empty = session_bundle_config_pb2.BatchingParameters()
    old, new = old or empty, new or empty
    changes = []
    for descriptor in empty.DESCRIPTOR.fields:
        name, wrapped = descriptor.name, descriptor.message_type is not None
        if getattr(old, name) != getattr(new, name):
            changes.append(f"{name} {_shown(old, name, wrapped)} -> {_shown(new, name, wrapped)}")
    return changes
