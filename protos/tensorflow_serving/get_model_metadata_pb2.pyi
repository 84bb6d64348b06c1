from google.protobuf import any_pb2 as _any_pb2
from protos.tf.tensorflow.core.protobuf import meta_graph_pb2 as _meta_graph_pb2
from protos.tensorflow_serving import model_pb2 as _model_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SignatureDefMap(_message.Message):
    __slots__ = ("signature_def",)
    class SignatureDefEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _meta_graph_pb2.SignatureDef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_meta_graph_pb2.SignatureDef, _Mapping]] = ...) -> None: ...
    SIGNATURE_DEF_FIELD_NUMBER: _ClassVar[int]
    signature_def: _containers.MessageMap[str, _meta_graph_pb2.SignatureDef]
    def __init__(self, signature_def: _Optional[_Mapping[str, _meta_graph_pb2.SignatureDef]] = ...) -> None: ...

class GetModelMetadataRequest(_message.Message):
    __slots__ = ("model_spec", "metadata_field")
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_FIELD_NUMBER: _ClassVar[int]
    model_spec: _model_pb2.ModelSpec
    metadata_field: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_spec: _Optional[_Union[_model_pb2.ModelSpec, _Mapping]] = ..., metadata_field: _Optional[_Iterable[str]] = ...) -> None: ...

class GetModelMetadataResponse(_message.Message):
    __slots__ = ("model_spec", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _any_pb2.Any
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    model_spec: _model_pb2.ModelSpec
    metadata: _containers.MessageMap[str, _any_pb2.Any]
    def __init__(self, model_spec: _Optional[_Union[_model_pb2.ModelSpec, _Mapping]] = ..., metadata: _Optional[_Mapping[str, _any_pb2.Any]] = ...) -> None: ...
