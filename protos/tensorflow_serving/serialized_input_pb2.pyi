from protos.tensorflow_serving import inference_pb2 as _inference_pb2
from protos.tensorflow_serving import model_pb2 as _model_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SerializedExampleList(_message.Message):
    __slots__ = ("examples",)
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    examples: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, examples: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SerializedExampleListWithContext(_message.Message):
    __slots__ = ("examples", "context")
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    examples: _containers.RepeatedScalarFieldContainer[bytes]
    context: bytes
    def __init__(self, examples: _Optional[_Iterable[bytes]] = ..., context: _Optional[bytes] = ...) -> None: ...

class SerializedInput(_message.Message):
    __slots__ = ("example_list", "example_list_with_context")
    EXAMPLE_LIST_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_LIST_WITH_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    example_list: SerializedExampleList
    example_list_with_context: SerializedExampleListWithContext
    def __init__(self, example_list: _Optional[_Union[SerializedExampleList, _Mapping]] = ..., example_list_with_context: _Optional[_Union[SerializedExampleListWithContext, _Mapping]] = ...) -> None: ...

class SerializedExamplesRequest(_message.Message):
    __slots__ = ("model_spec", "input")
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    model_spec: _model_pb2.ModelSpec
    input: SerializedInput
    def __init__(self, model_spec: _Optional[_Union[_model_pb2.ModelSpec, _Mapping]] = ..., input: _Optional[_Union[SerializedInput, _Mapping]] = ...) -> None: ...

class SerializedMultiInferenceRequest(_message.Message):
    __slots__ = ("tasks", "input")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[_inference_pb2.InferenceTask]
    input: SerializedInput
    def __init__(self, tasks: _Optional[_Iterable[_Union[_inference_pb2.InferenceTask, _Mapping]]] = ..., input: _Optional[_Union[SerializedInput, _Mapping]] = ...) -> None: ...
