from google.protobuf import any_pb2 as _any_pb2
from protos.tensorflow_serving import file_system_storage_path_source_pb2 as _file_system_storage_path_source_pb2
from protos.tensorflow_serving import logging_config_pb2 as _logging_config_pb2
from protos.tensorflow_serving import session_bundle_config_pb2 as _session_bundle_config_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_TYPE_UNSPECIFIED: _ClassVar[ModelType]
    TENSORFLOW: _ClassVar[ModelType]
    OTHER: _ClassVar[ModelType]
MODEL_TYPE_UNSPECIFIED: ModelType
TENSORFLOW: ModelType
OTHER: ModelType

class ModelConfig(_message.Message):
    __slots__ = ("name", "base_path", "model_type", "model_platform", "model_version_policy", "version_labels", "logging_config", "batching_parameters")
    class VersionLabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PLATFORM_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_POLICY_FIELD_NUMBER: _ClassVar[int]
    VERSION_LABELS_FIELD_NUMBER: _ClassVar[int]
    LOGGING_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BATCHING_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_path: str
    model_type: ModelType
    model_platform: str
    model_version_policy: _file_system_storage_path_source_pb2.FileSystemStoragePathSourceConfig.ServableVersionPolicy
    version_labels: _containers.ScalarMap[str, int]
    logging_config: _logging_config_pb2.LoggingConfig
    batching_parameters: _session_bundle_config_pb2.BatchingParameters
    def __init__(self, name: _Optional[str] = ..., base_path: _Optional[str] = ..., model_type: _Optional[_Union[ModelType, str]] = ..., model_platform: _Optional[str] = ..., model_version_policy: _Optional[_Union[_file_system_storage_path_source_pb2.FileSystemStoragePathSourceConfig.ServableVersionPolicy, _Mapping]] = ..., version_labels: _Optional[_Mapping[str, int]] = ..., logging_config: _Optional[_Union[_logging_config_pb2.LoggingConfig, _Mapping]] = ..., batching_parameters: _Optional[_Union[_session_bundle_config_pb2.BatchingParameters, _Mapping]] = ...) -> None: ...

class ModelConfigList(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: _containers.RepeatedCompositeFieldContainer[ModelConfig]
    def __init__(self, config: _Optional[_Iterable[_Union[ModelConfig, _Mapping]]] = ...) -> None: ...

class ModelServerConfig(_message.Message):
    __slots__ = ("model_config_list", "custom_model_config")
    MODEL_CONFIG_LIST_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    model_config_list: ModelConfigList
    custom_model_config: _any_pb2.Any
    def __init__(self, model_config_list: _Optional[_Union[ModelConfigList, _Mapping]] = ..., custom_model_config: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...
