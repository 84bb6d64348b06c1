from protos.tf.tensorflow.core.framework import tensor_pb2 as _tensor_pb2
from protos.tensorflow_serving import model_pb2 as _model_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PredictRequest(_message.Message):
    __slots__ = ("model_spec", "inputs", "output_filter")
    class InputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.TensorProto
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ...) -> None: ...
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FILTER_FIELD_NUMBER: _ClassVar[int]
    model_spec: _model_pb2.ModelSpec
    inputs: _containers.MessageMap[str, _tensor_pb2.TensorProto]
    output_filter: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_spec: _Optional[_Union[_model_pb2.ModelSpec, _Mapping]] = ..., inputs: _Optional[_Mapping[str, _tensor_pb2.TensorProto]] = ..., output_filter: _Optional[_Iterable[str]] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("outputs", "model_spec")
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.TensorProto
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.MessageMap[str, _tensor_pb2.TensorProto]
    model_spec: _model_pb2.ModelSpec
    def __init__(self, outputs: _Optional[_Mapping[str, _tensor_pb2.TensorProto]] = ..., model_spec: _Optional[_Union[_model_pb2.ModelSpec, _Mapping]] = ...) -> None: ...
