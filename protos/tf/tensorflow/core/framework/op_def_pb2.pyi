from protos.tf.tensorflow.core.framework import attr_value_pb2 as _attr_value_pb2
from protos.tf.tensorflow.core.framework import full_type_pb2 as _full_type_pb2
from protos.tf.tensorflow.core.framework import resource_handle_pb2 as _resource_handle_pb2
from protos.tf.tensorflow.core.framework import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpDef(_message.Message):
    __slots__ = ("name", "input_arg", "output_arg", "control_output", "attr", "deprecation", "summary", "description", "is_commutative", "is_aggregate", "is_stateful", "allows_uninitialized_input", "is_distributed_communication")
    class ArgDef(_message.Message):
        __slots__ = ("name", "description", "type", "type_attr", "number_attr", "type_list_attr", "handle_data", "is_ref", "experimental_full_type")
        NAME_FIELD_NUMBER: _ClassVar[int]
        DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
        TYPE_FIELD_NUMBER: _ClassVar[int]
        TYPE_ATTR_FIELD_NUMBER: _ClassVar[int]
        NUMBER_ATTR_FIELD_NUMBER: _ClassVar[int]
        TYPE_LIST_ATTR_FIELD_NUMBER: _ClassVar[int]
        HANDLE_DATA_FIELD_NUMBER: _ClassVar[int]
        IS_REF_FIELD_NUMBER: _ClassVar[int]
        EXPERIMENTAL_FULL_TYPE_FIELD_NUMBER: _ClassVar[int]
        name: str
        description: str
        type: _types_pb2.DataType
        type_attr: str
        number_attr: str
        type_list_attr: str
        handle_data: _containers.RepeatedCompositeFieldContainer[_resource_handle_pb2.ResourceHandleProto.DtypeAndShape]
        is_ref: bool
        experimental_full_type: _full_type_pb2.FullTypeDef
        def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., type: _Optional[_Union[_types_pb2.DataType, str]] = ..., type_attr: _Optional[str] = ..., number_attr: _Optional[str] = ..., type_list_attr: _Optional[str] = ..., handle_data: _Optional[_Iterable[_Union[_resource_handle_pb2.ResourceHandleProto.DtypeAndShape, _Mapping]]] = ..., is_ref: _Optional[bool] = ..., experimental_full_type: _Optional[_Union[_full_type_pb2.FullTypeDef, _Mapping]] = ...) -> None: ...
    class AttrDef(_message.Message):
        __slots__ = ("name", "type", "default_value", "description", "has_minimum", "minimum", "allowed_values")
        NAME_FIELD_NUMBER: _ClassVar[int]
        TYPE_FIELD_NUMBER: _ClassVar[int]
        DEFAULT_VALUE_FIELD_NUMBER: _ClassVar[int]
        DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
        HAS_MINIMUM_FIELD_NUMBER: _ClassVar[int]
        MINIMUM_FIELD_NUMBER: _ClassVar[int]
        ALLOWED_VALUES_FIELD_NUMBER: _ClassVar[int]
        name: str
        type: str
        default_value: _attr_value_pb2.AttrValue
        description: str
        has_minimum: bool
        minimum: int
        allowed_values: _attr_value_pb2.AttrValue
        def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., default_value: _Optional[_Union[_attr_value_pb2.AttrValue, _Mapping]] = ..., description: _Optional[str] = ..., has_minimum: _Optional[bool] = ..., minimum: _Optional[int] = ..., allowed_values: _Optional[_Union[_attr_value_pb2.AttrValue, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    INPUT_ARG_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_ARG_FIELD_NUMBER: _ClassVar[int]
    CONTROL_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ATTR_FIELD_NUMBER: _ClassVar[int]
    DEPRECATION_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    IS_COMMUTATIVE_FIELD_NUMBER: _ClassVar[int]
    IS_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    IS_STATEFUL_FIELD_NUMBER: _ClassVar[int]
    ALLOWS_UNINITIALIZED_INPUT_FIELD_NUMBER: _ClassVar[int]
    IS_DISTRIBUTED_COMMUNICATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    input_arg: _containers.RepeatedCompositeFieldContainer[OpDef.ArgDef]
    output_arg: _containers.RepeatedCompositeFieldContainer[OpDef.ArgDef]
    control_output: _containers.RepeatedScalarFieldContainer[str]
    attr: _containers.RepeatedCompositeFieldContainer[OpDef.AttrDef]
    deprecation: OpDeprecation
    summary: str
    description: str
    is_commutative: bool
    is_aggregate: bool
    is_stateful: bool
    allows_uninitialized_input: bool
    is_distributed_communication: bool
    def __init__(self, name: _Optional[str] = ..., input_arg: _Optional[_Iterable[_Union[OpDef.ArgDef, _Mapping]]] = ..., output_arg: _Optional[_Iterable[_Union[OpDef.ArgDef, _Mapping]]] = ..., control_output: _Optional[_Iterable[str]] = ..., attr: _Optional[_Iterable[_Union[OpDef.AttrDef, _Mapping]]] = ..., deprecation: _Optional[_Union[OpDeprecation, _Mapping]] = ..., summary: _Optional[str] = ..., description: _Optional[str] = ..., is_commutative: _Optional[bool] = ..., is_aggregate: _Optional[bool] = ..., is_stateful: _Optional[bool] = ..., allows_uninitialized_input: _Optional[bool] = ..., is_distributed_communication: _Optional[bool] = ...) -> None: ...

class OpDeprecation(_message.Message):
    __slots__ = ("version", "explanation")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    version: int
    explanation: str
    def __init__(self, version: _Optional[int] = ..., explanation: _Optional[str] = ...) -> None: ...

class OpList(_message.Message):
    __slots__ = ("op",)
    OP_FIELD_NUMBER: _ClassVar[int]
    op: _containers.RepeatedCompositeFieldContainer[OpDef]
    def __init__(self, op: _Optional[_Iterable[_Union[OpDef, _Mapping]]] = ...) -> None: ...
