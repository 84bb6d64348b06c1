"""server.core.model_config: TF Serving's config text parsed exactly, bad configs named by line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from protos.tensorflow_serving import model_server_config_pb2
from server.core.model_config import (
    ConfigError,
    ModelSource,
    RequestLogging,
    VersionPolicy,
    from_proto,
    parse_config_text,
    read_config_file,
)

THREE_MODELS = """\
model_config_list {
  config {
    name: "a"
    base_path: "/models/a"
    model_platform: "tensorflow"
  }
  config {
    name: "b"
    base_path: "/models/b"
    model_version_policy { specific { versions: 1 versions: 3 } }
    version_labels { key: "stable" value: 1 }
    version_labels { key: "canary" value: 3 }
  }
  config {
    name: "c"
    base_path: "/models/c"
    model_version_policy { all {} }
  }
  config {
    name: "d"
    base_path: "/models/d"
    model_version_policy { latest { num_versions: 2 } }
  }
}
"""


def test_three_policies_and_labels() -> None:
    a, b, c, d = parse_config_text(THREE_MODELS)
    assert a == ModelSource("a", "/models/a", VersionPolicy("latest", 1), {})
    assert b == ModelSource("b", "/models/b", VersionPolicy("specific", versions=frozenset({1, 3})),
                            {"stable": 1, "canary": 3})
    assert c.policy == VersionPolicy("all")
    assert d.policy == VersionPolicy("latest", 2)


def test_a_tf_serving_file_with_logging_config_and_comments_parses() -> None:
    text = """
    # a comment
    model_config_list: {
      config: {
        name: 'm', base_path: '/m', model_type: TENSORFLOW,
        logging_config { log_collector_config { type: "file" filename_prefix: "/logs/m" }
                         sampling_config { sampling_rate: 0.1 } }
        model_version_policy: { latest: {} }
      }
    }"""
    (m,) = parse_config_text(text)
    assert m.policy == VersionPolicy("latest", 1)  # latest {} means the one highest, as in TF Serving
    assert m.logging == RequestLogging("/logs/m", 0.1)


@pytest.mark.parametrize(("block", "expected"), [
    ("logging_config { sampling_config { sampling_rate: 0.1 } }",
     "<config>:1: model 'm' logging_config: log_collector_config type '' is not supported; supported: file"),
    ('logging_config { log_collector_config { type: "file" } }', "log_collector_config has no filename_prefix"),
    ('logging_config { log_collector_config { type: "file" filename_prefix: "/l" } '
     'sampling_config { sampling_rate: -0.5 } }', "sampling_rate -0.5 is not between 0 and 1"),
    ('logging_config { log_collector_config { type: "file" filename_prefix: "/l" } '
     'sampling_config { per_task_sampling_configs { dc: "x" sampling_rate: 1 } } }',
     "per_task_sampling_configs are not supported; use sampling_rate"),
    ('logging_config { log_collector_config { type: "file" filename_prefix: "/l" } '
     'custom_logging_config { type_url: "x" } }', "custom_logging_config is not supported"),
])
def test_bad_logging_configs_are_named(block: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config_text(f'model_config_list {{ config {{ name: "m" base_path: "/m" {block} }} }}')
    assert expected in str(caught.value)


@pytest.mark.parametrize(("on_disk", "policy", "aspired"), [
    ([1, 2, 3], VersionPolicy("latest", 1), {3}),
    ([1, 2, 3], VersionPolicy("latest", 2), {2, 3}),
    ([2], VersionPolicy("latest", 2), {2}),
    ([], VersionPolicy("latest", 1), set()),
    ([1, 2, 3], VersionPolicy("all"), {1, 2, 3}),
    ([1, 2, 3], VersionPolicy("specific", versions=frozenset({1, 4})), {1}),
])
def test_aspired_versions(on_disk: list[int], policy: VersionPolicy, aspired: set[int]) -> None:
    assert policy.aspired(on_disk) == aspired


def bad(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config_text(text, "models.config")
    return str(caught.value)


def test_unknown_field_names_the_line() -> None:
    message = bad('model_config_list {\n  config {\n    name: "a"\n    base_pth: "/a"\n  }\n}\n')
    assert message.startswith("models.config:4:")
    assert 'no field named "base_pth"' in message


def test_bad_policy_syntax_names_the_line() -> None:
    message = bad('model_config_list {\n config {\n  name: "a" base_path: "/a"\n'
                  '  model_version_policy { newest {} }\n }\n}\n')
    assert message.startswith("models.config:4:") and "newest" in message


@pytest.mark.parametrize(("block", "expected"), [
    ('name: "a" base_path: "/a" model_version_policy { specific {} }',
     "specific version policy that lists no versions"),
    ('name: "a" base_path: "/a" model_version_policy { specific { versions: 0 } }', "versions are positive"),
    ('base_path: "/a"', "a config has no name"),
    ('name: "a"', "model 'a' has no base_path"),
    ('name: "a" base_path: "/a" model_platform: "pytorch"', "only 'tensorflow' is served"),
    ('name: "a" base_path: "/a" model_version_policy { specific { versions: 1 } } '
     'version_labels { key: "x" value: 2 }', "label 'x' points at version 2, which its specific policy does not"),
    ('name: "a" base_path: "/a" version_labels { key: "x" value: 0 }', "versions are positive"),
])
def test_semantic_errors_name_the_config_block_line(block: str, expected: str) -> None:
    text = 'model_config_list {\n  config { name: "ok" base_path: "/ok" }\n\n  config {\n    ' + block + "\n  }\n}\n"
    message = bad(text)
    assert message.startswith("models.config:4: "), message
    assert expected in message


def test_duplicate_names_point_at_both() -> None:
    message = bad('model_config_list {\n config { name: "a" base_path: "/a" }\n'
                  ' config { name: "a" base_path: "/b" }\n}')
    assert message == "models.config:3: model name 'a' is configured twice (first at models.config:2)"


def test_empty_and_custom_configs_are_refused() -> None:
    assert "model_config_list is missing" in bad("")
    assert "lists no config" in bad("model_config_list {}")
    config = model_server_config_pb2.ModelServerConfig()
    config.custom_model_config.type_url = "x"
    with pytest.raises(ConfigError, match="custom_model_config is not supported"):
        from_proto(config)


def test_proto_errors_count_configs_from_one() -> None:
    config = model_server_config_pb2.ModelServerConfig()
    config.model_config_list.config.add(name="a", base_path="/a")
    config.model_config_list.config.add(name="b")
    with pytest.raises(ConfigError, match=r"^request: config #2: model 'b' has no base_path$"):
        from_proto(config, "request")


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read model config file"):
        read_config_file(tmp_path / "missing.config")



@pytest.mark.parametrize(("path", "local"), [
    ("/models/m", "/models/m"), ("relative/m", "relative/m"), ("file:///models/m", "/models/m"),
    ("file://localhost/models/m", "/models/m"), ("FILE:///m", "/m"),
])
def test_a_file_url_is_a_local_folder(path: str, local: str) -> None:
    from server.core.version_folders import local_path

    assert local_path(path, "base_path") == local


@pytest.mark.parametrize(("path", "message"), [
    ("gs://bucket/models/m", "base_path gs://bucket/models/m: the gs:// scheme is not served here"),
    ("s3://bucket/m", "the s3:// scheme is not served here"),
    ("hdfs://namenode:8020/m", "the hdfs:// scheme is not served here"),
    ("file://otherhost/m", "a file:// path names a local folder (file:///models/m); 'otherhost' is another host"),
])
def test_another_scheme_is_refused_naming_it_and_why(path: str, message: str) -> None:
    from server.core.version_folders import local_path

    with pytest.raises(ValueError, match=re.escape(message)):
        local_path(path, "base_path")


def test_a_config_file_with_a_scheme(tmp_path: Path) -> None:
    sources = parse_config_text('model_config_list { config { name: "m" base_path: "file:///models/m" } }', "c")
    assert sources[0].base_path == "/models/m"
    with pytest.raises(ConfigError, match=re.escape("c:1: model 'g' base_path gs://b/g: the gs:// scheme is not "
                                                    "served here. Version folders are listed")):
        parse_config_text('model_config_list { config { name: "g" base_path: "gs://b/g" } }', "c")


def test_batching_changes_name_each_field_that_differs() -> None:
    from protos.tensorflow_serving import session_bundle_config_pb2
    from server.core.model_config import batching_changes

    old = session_bundle_config_pb2.BatchingParameters()
    old.max_batch_size.value = 32
    old.allowed_batch_sizes.extend([8, 32])
    new = session_bundle_config_pb2.BatchingParameters()
    new.max_batch_size.value = 64
    new.batch_timeout_micros.value = 500
    new.allowed_batch_sizes.extend([8, 64])
    assert batching_changes(old, new) == ["max_batch_size 32 -> 64", "batch_timeout_micros unset -> 500",
                                          "allowed_batch_sizes [8, 32] -> [8, 64]"]
    assert batching_changes(None, None) == [] and batching_changes(old, old) == []
    assert batching_changes(old, None) == ["max_batch_size 32 -> unset", "allowed_batch_sizes [8, 32] -> []"]
