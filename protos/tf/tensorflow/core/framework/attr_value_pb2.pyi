from protos.tf.tensorflow.core.framework import tensor_pb2 as _tensor_pb2
from protos.tf.tensorflow.core.framework import tensor_shape_pb2 as _tensor_shape_pb2
from protos.tf.tensorflow.core.framework import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttrValue(_message.Message):
    __slots__ = ("s", "i", "f", "b", "type", "shape", "tensor", "list", "func", "placeholder")
    class ListValue(_message.Message):
        __slots__ = ("s", "i", "f", "b", "type", "shape", "tensor", "func")
        S_FIELD_NUMBER: _ClassVar[int]
        I_FIELD_NUMBER: _ClassVar[int]
        F_FIELD_NUMBER: _ClassVar[int]
        B_FIELD_NUMBER: _ClassVar[int]
        TYPE_FIELD_NUMBER: _ClassVar[int]
        SHAPE_FIELD_NUMBER: _ClassVar[int]
        TENSOR_FIELD_NUMBER: _ClassVar[int]
        FUNC_FIELD_NUMBER: _ClassVar[int]
        s: _containers.RepeatedScalarFieldContainer[bytes]
        i: _containers.RepeatedScalarFieldContainer[int]
        f: _containers.RepeatedScalarFieldContainer[float]
        b: _containers.RepeatedScalarFieldContainer[bool]
        type: _containers.RepeatedScalarFieldContainer[_types_pb2.DataType]
        shape: _containers.RepeatedCompositeFieldContainer[_tensor_shape_pb2.TensorShapeProto]
        tensor: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorProto]
        func: _containers.RepeatedCompositeFieldContainer[NameAttrList]
        def __init__(self, s: _Optional[_Iterable[bytes]] = ..., i: _Optional[_Iterable[int]] = ..., f: _Optional[_Iterable[float]] = ..., b: _Optional[_Iterable[bool]] = ..., type: _Optional[_Iterable[_Union[_types_pb2.DataType, str]]] = ..., shape: _Optional[_Iterable[_Union[_tensor_shape_pb2.TensorShapeProto, _Mapping]]] = ..., tensor: _Optional[_Iterable[_Union[_tensor_pb2.TensorProto, _Mapping]]] = ..., func: _Optional[_Iterable[_Union[NameAttrList, _Mapping]]] = ...) -> None: ...
    S_FIELD_NUMBER: _ClassVar[int]
    I_FIELD_NUMBER: _ClassVar[int]
    F_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    FUNC_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_FIELD_NUMBER: _ClassVar[int]
    s: bytes
    i: int
    f: float
    b: bool
    type: _types_pb2.DataType
    shape: _tensor_shape_pb2.TensorShapeProto
    tensor: _tensor_pb2.TensorProto
    list: AttrValue.ListValue
    func: NameAttrList
    placeholder: str
    def __init__(self, s: _Optional[bytes] = ..., i: _Optional[int] = ..., f: _Optional[float] = ..., b: _Optional[bool] = ..., type: _Optional[_Union[_types_pb2.DataType, str]] = ..., shape: _Optional[_Union[_tensor_shape_pb2.TensorShapeProto, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ..., list: _Optional[_Union[AttrValue.ListValue, _Mapping]] = ..., func: _Optional[_Union[NameAttrList, _Mapping]] = ..., placeholder: _Optional[str] = ...) -> None: ...

class NameAttrList(_message.Message):
    __slots__ = ("name", "attr")
    class AttrEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: AttrValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[AttrValue, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ATTR_FIELD_NUMBER: _ClassVar[int]
    name: str
    attr: _containers.MessageMap[str, AttrValue]
    def __init__(self, name: _Optional[str] = ..., attr: _Optional[_Mapping[str, AttrValue]] = ...) -> None: ...
