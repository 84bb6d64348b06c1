from google.protobuf import wrappers_pb2 as _wrappers_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BatchingParameters(_message.Message):
    __slots__ = ("max_batch_size", "batch_timeout_micros", "max_enqueued_batches", "num_batch_threads", "thread_pool_name", "allowed_batch_sizes", "pad_variable_length_inputs", "enable_large_batch_splitting", "max_execution_batch_size", "target_latency_ms")
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TIMEOUT_MICROS_FIELD_NUMBER: _ClassVar[int]
    MAX_ENQUEUED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCH_THREADS_FIELD_NUMBER: _ClassVar[int]
    THREAD_POOL_NAME_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    PAD_VARIABLE_LENGTH_INPUTS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_LARGE_BATCH_SPLITTING_FIELD_NUMBER: _ClassVar[int]
    MAX_EXECUTION_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    max_batch_size: _wrappers_pb2.Int64Value
    batch_timeout_micros: _wrappers_pb2.Int64Value
    max_enqueued_batches: _wrappers_pb2.Int64Value
    num_batch_threads: _wrappers_pb2.Int64Value
    thread_pool_name: _wrappers_pb2.StringValue
    allowed_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    pad_variable_length_inputs: bool
    enable_large_batch_splitting: _wrappers_pb2.BoolValue
    max_execution_batch_size: _wrappers_pb2.Int64Value
    target_latency_ms: _wrappers_pb2.DoubleValue
    def __init__(self, max_batch_size: _Optional[_Union[_wrappers_pb2.Int64Value, _Mapping]] = ..., batch_timeout_micros: _Optional[_Union[_wrappers_pb2.Int64Value, _Mapping]] = ..., max_enqueued_batches: _Optional[_Union[_wrappers_pb2.Int64Value, _Mapping]] = ..., num_batch_threads: _Optional[_Union[_wrappers_pb2.Int64Value, _Mapping]] = ..., thread_pool_name: _Optional[_Union[_wrappers_pb2.StringValue, _Mapping]] = ..., allowed_batch_sizes: _Optional[_Iterable[int]] = ..., pad_variable_length_inputs: _Optional[bool] = ..., enable_large_batch_splitting: _Optional[_Union[_wrappers_pb2.BoolValue, _Mapping]] = ..., max_execution_batch_size: _Optional[_Union[_wrappers_pb2.Int64Value, _Mapping]] = ..., target_latency_ms: _Optional[_Union[_wrappers_pb2.DoubleValue, _Mapping]] = ...) -> None: ...
