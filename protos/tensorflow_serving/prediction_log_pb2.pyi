from protos.tensorflow_serving import classification_pb2 as _classification_pb2
from protos.tensorflow_serving import inference_pb2 as _inference_pb2
from protos.tensorflow_serving import logging_pb2 as _logging_pb2
from protos.tensorflow_serving import predict_pb2 as _predict_pb2
from protos.tensorflow_serving import regression_pb2 as _regression_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClassifyLog(_message.Message):
    __slots__ = ("request", "response")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    request: _classification_pb2.ClassificationRequest
    response: _classification_pb2.ClassificationResponse
    def __init__(self, request: _Optional[_Union[_classification_pb2.ClassificationRequest, _Mapping]] = ..., response: _Optional[_Union[_classification_pb2.ClassificationResponse, _Mapping]] = ...) -> None: ...

class RegressLog(_message.Message):
    __slots__ = ("request", "response")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    request: _regression_pb2.RegressionRequest
    response: _regression_pb2.RegressionResponse
    def __init__(self, request: _Optional[_Union[_regression_pb2.RegressionRequest, _Mapping]] = ..., response: _Optional[_Union[_regression_pb2.RegressionResponse, _Mapping]] = ...) -> None: ...

class PredictLog(_message.Message):
    __slots__ = ("request", "response")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    request: _predict_pb2.PredictRequest
    response: _predict_pb2.PredictResponse
    def __init__(self, request: _Optional[_Union[_predict_pb2.PredictRequest, _Mapping]] = ..., response: _Optional[_Union[_predict_pb2.PredictResponse, _Mapping]] = ...) -> None: ...

class PredictStreamedLog(_message.Message):
    __slots__ = ("request", "response")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    request: _containers.RepeatedCompositeFieldContainer[_predict_pb2.PredictRequest]
    response: _containers.RepeatedCompositeFieldContainer[_predict_pb2.PredictResponse]
    def __init__(self, request: _Optional[_Iterable[_Union[_predict_pb2.PredictRequest, _Mapping]]] = ..., response: _Optional[_Iterable[_Union[_predict_pb2.PredictResponse, _Mapping]]] = ...) -> None: ...

class MultiInferenceLog(_message.Message):
    __slots__ = ("request", "response")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    request: _inference_pb2.MultiInferenceRequest
    response: _inference_pb2.MultiInferenceResponse
    def __init__(self, request: _Optional[_Union[_inference_pb2.MultiInferenceRequest, _Mapping]] = ..., response: _Optional[_Union[_inference_pb2.MultiInferenceResponse, _Mapping]] = ...) -> None: ...

class SessionRunLog(_message.Message):
    __slots__ = ("request", "response")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    request: bytes
    response: bytes
    def __init__(self, request: _Optional[bytes] = ..., response: _Optional[bytes] = ...) -> None: ...

class PredictionLog(_message.Message):
    __slots__ = ("log_metadata", "classify_log", "regress_log", "predict_log", "predict_streamed_log", "multi_inference_log", "session_run_log")
    LOG_METADATA_FIELD_NUMBER: _ClassVar[int]
    CLASSIFY_LOG_FIELD_NUMBER: _ClassVar[int]
    REGRESS_LOG_FIELD_NUMBER: _ClassVar[int]
    PREDICT_LOG_FIELD_NUMBER: _ClassVar[int]
    PREDICT_STREAMED_LOG_FIELD_NUMBER: _ClassVar[int]
    MULTI_INFERENCE_LOG_FIELD_NUMBER: _ClassVar[int]
    SESSION_RUN_LOG_FIELD_NUMBER: _ClassVar[int]
    log_metadata: _logging_pb2.LogMetadata
    classify_log: ClassifyLog
    regress_log: RegressLog
    predict_log: PredictLog
    predict_streamed_log: PredictStreamedLog
    multi_inference_log: MultiInferenceLog
    session_run_log: SessionRunLog
    def __init__(self, log_metadata: _Optional[_Union[_logging_pb2.LogMetadata, _Mapping]] = ..., classify_log: _Optional[_Union[ClassifyLog, _Mapping]] = ..., regress_log: _Optional[_Union[RegressLog, _Mapping]] = ..., predict_log: _Optional[_Union[PredictLog, _Mapping]] = ..., predict_streamed_log: _Optional[_Union[PredictStreamedLog, _Mapping]] = ..., multi_inference_log: _Optional[_Union[MultiInferenceLog, _Mapping]] = ..., session_run_log: _Optional[_Union[SessionRunLog, _Mapping]] = ...) -> None: ...
