from protos.tensorflow_serving import model_pb2 as _model_pb2
from protos.tensorflow_serving import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetModelStatusRequest(_message.Message):
    __slots__ = ("model_spec",)
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    model_spec: _model_pb2.ModelSpec
    def __init__(self, model_spec: _Optional[_Union[_model_pb2.ModelSpec, _Mapping]] = ...) -> None: ...

class ModelVersionStatus(_message.Message):
    __slots__ = ("version", "state", "status")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[ModelVersionStatus.State]
        START: _ClassVar[ModelVersionStatus.State]
        LOADING: _ClassVar[ModelVersionStatus.State]
        AVAILABLE: _ClassVar[ModelVersionStatus.State]
        UNLOADING: _ClassVar[ModelVersionStatus.State]
        END: _ClassVar[ModelVersionStatus.State]
    UNKNOWN: ModelVersionStatus.State
    START: ModelVersionStatus.State
    LOADING: ModelVersionStatus.State
    AVAILABLE: ModelVersionStatus.State
    UNLOADING: ModelVersionStatus.State
    END: ModelVersionStatus.State
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: ModelVersionStatus.State
    status: _status_pb2.StatusProto
    def __init__(self, version: _Optional[int] = ..., state: _Optional[_Union[ModelVersionStatus.State, str]] = ..., status: _Optional[_Union[_status_pb2.StatusProto, _Mapping]] = ...) -> None: ...

class GetModelStatusResponse(_message.Message):
    __slots__ = ("model_version_status",)
    MODEL_VERSION_STATUS_FIELD_NUMBER: _ClassVar[int]
    model_version_status: _containers.RepeatedCompositeFieldContainer[ModelVersionStatus]
    def __init__(self, model_version_status: _Optional[_Iterable[_Union[ModelVersionStatus, _Mapping]]] = ...) -> None: ...
