from google.protobuf import any_pb2 as _any_pb2
from protos.tensorflow_serving import log_collector_config_pb2 as _log_collector_config_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PerTaskSamplingConfig(_message.Message):
    __slots__ = ("dc", "task_index", "sampling_rate")
    DC_FIELD_NUMBER: _ClassVar[int]
    TASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_RATE_FIELD_NUMBER: _ClassVar[int]
    dc: str
    task_index: int
    sampling_rate: float
    def __init__(self, dc: _Optional[str] = ..., task_index: _Optional[int] = ..., sampling_rate: _Optional[float] = ...) -> None: ...

class SamplingConfig(_message.Message):
    __slots__ = ("sampling_rate", "attributes", "per_task_sampling_configs")
    SAMPLING_RATE_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    PER_TASK_SAMPLING_CONFIGS_FIELD_NUMBER: _ClassVar[int]
    sampling_rate: float
    attributes: int
    per_task_sampling_configs: _containers.RepeatedCompositeFieldContainer[PerTaskSamplingConfig]
    def __init__(self, sampling_rate: _Optional[float] = ..., attributes: _Optional[int] = ..., per_task_sampling_configs: _Optional[_Iterable[_Union[PerTaskSamplingConfig, _Mapping]]] = ...) -> None: ...

class LoggingConfig(_message.Message):
    __slots__ = ("log_collector_config", "sampling_config", "custom_logging_config")
    LOG_COLLECTOR_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_CONFIG_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_LOGGING_CONFIG_FIELD_NUMBER: _ClassVar[int]
    log_collector_config: _log_collector_config_pb2.LogCollectorConfig
    sampling_config: SamplingConfig
    custom_logging_config: _any_pb2.Any
    def __init__(self, log_collector_config: _Optional[_Union[_log_collector_config_pb2.LogCollectorConfig, _Mapping]] = ..., sampling_config: _Optional[_Union[SamplingConfig, _Mapping]] = ..., custom_logging_config: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...
