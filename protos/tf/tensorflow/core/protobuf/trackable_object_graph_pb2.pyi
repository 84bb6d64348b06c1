from google.protobuf import wrappers_pb2 as _wrappers_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrackableObjectGraph(_message.Message):
    __slots__ = ("nodes",)
    class TrackableObject(_message.Message):
        __slots__ = ("children", "attributes", "slot_variables", "registered_saver", "has_checkpoint_values")
        class ObjectReference(_message.Message):
            __slots__ = ("node_id", "local_name")
            NODE_ID_FIELD_NUMBER: _ClassVar[int]
            LOCAL_NAME_FIELD_NUMBER: _ClassVar[int]
            node_id: int
            local_name: str
            def __init__(self, node_id: _Optional[int] = ..., local_name: _Optional[str] = ...) -> None: ...
        class SerializedTensor(_message.Message):
            __slots__ = ("name", "full_name", "checkpoint_key")
            NAME_FIELD_NUMBER: _ClassVar[int]
            FULL_NAME_FIELD_NUMBER: _ClassVar[int]
            CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
            name: str
            full_name: str
            checkpoint_key: str
            def __init__(self, name: _Optional[str] = ..., full_name: _Optional[str] = ..., checkpoint_key: _Optional[str] = ...) -> None: ...
        class SlotVariableReference(_message.Message):
            __slots__ = ("original_variable_node_id", "slot_name", "slot_variable_node_id")
            ORIGINAL_VARIABLE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
            SLOT_NAME_FIELD_NUMBER: _ClassVar[int]
            SLOT_VARIABLE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
            original_variable_node_id: int
            slot_name: str
            slot_variable_node_id: int
            def __init__(self, original_variable_node_id: _Optional[int] = ..., slot_name: _Optional[str] = ..., slot_variable_node_id: _Optional[int] = ...) -> None: ...
        CHILDREN_FIELD_NUMBER: _ClassVar[int]
        ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
        SLOT_VARIABLES_FIELD_NUMBER: _ClassVar[int]
        REGISTERED_SAVER_FIELD_NUMBER: _ClassVar[int]
        HAS_CHECKPOINT_VALUES_FIELD_NUMBER: _ClassVar[int]
        children: _containers.RepeatedCompositeFieldContainer[TrackableObjectGraph.TrackableObject.ObjectReference]
        attributes: _containers.RepeatedCompositeFieldContainer[TrackableObjectGraph.TrackableObject.SerializedTensor]
        slot_variables: _containers.RepeatedCompositeFieldContainer[TrackableObjectGraph.TrackableObject.SlotVariableReference]
        registered_saver: RegisteredSaver
        has_checkpoint_values: _wrappers_pb2.BoolValue
        def __init__(self, children: _Optional[_Iterable[_Union[TrackableObjectGraph.TrackableObject.ObjectReference, _Mapping]]] = ..., attributes: _Optional[_Iterable[_Union[TrackableObjectGraph.TrackableObject.SerializedTensor, _Mapping]]] = ..., slot_variables: _Optional[_Iterable[_Union[TrackableObjectGraph.TrackableObject.SlotVariableReference, _Mapping]]] = ..., registered_saver: _Optional[_Union[RegisteredSaver, _Mapping]] = ..., has_checkpoint_values: _Optional[_Union[_wrappers_pb2.BoolValue, _Mapping]] = ...) -> None: ...
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[TrackableObjectGraph.TrackableObject]
    def __init__(self, nodes: _Optional[_Iterable[_Union[TrackableObjectGraph.TrackableObject, _Mapping]]] = ...) -> None: ...

class RegisteredSaver(_message.Message):
    __slots__ = ("name", "object_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OBJECT_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    object_name: str
    def __init__(self, name: _Optional[str] = ..., object_name: _Optional[str] = ...) -> None: ...
