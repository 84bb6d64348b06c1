from protos.tf.tensorflow.core.framework import attr_value_pb2 as _attr_value_pb2
from protos.tf.tensorflow.core.framework import full_type_pb2 as _full_type_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeDef(_message.Message):
    __slots__ = ("name", "op", "input", "device", "attr", "experimental_debug_info", "experimental_type")
    class AttrEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _attr_value_pb2.AttrValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_attr_value_pb2.AttrValue, _Mapping]] = ...) -> None: ...
    class ExperimentalDebugInfo(_message.Message):
        __slots__ = ("original_node_names", "original_func_names")
        ORIGINAL_NODE_NAMES_FIELD_NUMBER: _ClassVar[int]
        ORIGINAL_FUNC_NAMES_FIELD_NUMBER: _ClassVar[int]
        original_node_names: _containers.RepeatedScalarFieldContainer[str]
        original_func_names: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, original_node_names: _Optional[_Iterable[str]] = ..., original_func_names: _Optional[_Iterable[str]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTR_FIELD_NUMBER: _ClassVar[int]
    EXPERIMENTAL_DEBUG_INFO_FIELD_NUMBER: _ClassVar[int]
    EXPERIMENTAL_TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    op: str
    input: _containers.RepeatedScalarFieldContainer[str]
    device: str
    attr: _containers.MessageMap[str, _attr_value_pb2.AttrValue]
    experimental_debug_info: NodeDef.ExperimentalDebugInfo
    experimental_type: _full_type_pb2.FullTypeDef
    def __init__(self, name: _Optional[str] = ..., op: _Optional[str] = ..., input: _Optional[_Iterable[str]] = ..., device: _Optional[str] = ..., attr: _Optional[_Mapping[str, _attr_value_pb2.AttrValue]] = ..., experimental_debug_info: _Optional[_Union[NodeDef.ExperimentalDebugInfo, _Mapping]] = ..., experimental_type: _Optional[_Union[_full_type_pb2.FullTypeDef, _Mapping]] = ...) -> None: ...
