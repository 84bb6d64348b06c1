from google.protobuf import any_pb2 as _any_pb2
from protos.tf.tensorflow.core.framework import graph_pb2 as _graph_pb2
from protos.tf.tensorflow.core.framework import op_def_pb2 as _op_def_pb2
from protos.tf.tensorflow.core.framework import tensor_pb2 as _tensor_pb2
from protos.tf.tensorflow.core.framework import tensor_shape_pb2 as _tensor_shape_pb2
from protos.tf.tensorflow.core.framework import types_pb2 as _types_pb2
from protos.tf.tensorflow.core.protobuf import saved_object_graph_pb2 as _saved_object_graph_pb2
from protos.tf.tensorflow.core.protobuf import saver_pb2 as _saver_pb2
from protos.tf.tensorflow.core.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MetaGraphDef(_message.Message):
    __slots__ = ("meta_info_def", "graph_def", "saver_def", "collection_def", "signature_def", "asset_file_def", "object_graph_def")
    class MetaInfoDef(_message.Message):
        __slots__ = ("meta_graph_version", "stripped_op_list", "any_info", "tags", "tensorflow_version", "tensorflow_git_version", "stripped_default_attrs", "function_aliases")
        class FunctionAliasesEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: str
            def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
        META_GRAPH_VERSION_FIELD_NUMBER: _ClassVar[int]
        STRIPPED_OP_LIST_FIELD_NUMBER: _ClassVar[int]
        ANY_INFO_FIELD_NUMBER: _ClassVar[int]
        TAGS_FIELD_NUMBER: _ClassVar[int]
        TENSORFLOW_VERSION_FIELD_NUMBER: _ClassVar[int]
        TENSORFLOW_GIT_VERSION_FIELD_NUMBER: _ClassVar[int]
        STRIPPED_DEFAULT_ATTRS_FIELD_NUMBER: _ClassVar[int]
        FUNCTION_ALIASES_FIELD_NUMBER: _ClassVar[int]
        meta_graph_version: str
        stripped_op_list: _op_def_pb2.OpList
        any_info: _any_pb2.Any
        tags: _containers.RepeatedScalarFieldContainer[str]
        tensorflow_version: str
        tensorflow_git_version: str
        stripped_default_attrs: bool
        function_aliases: _containers.ScalarMap[str, str]
        def __init__(self, meta_graph_version: _Optional[str] = ..., stripped_op_list: _Optional[_Union[_op_def_pb2.OpList, _Mapping]] = ..., any_info: _Optional[_Union[_any_pb2.Any, _Mapping]] = ..., tags: _Optional[_Iterable[str]] = ..., tensorflow_version: _Optional[str] = ..., tensorflow_git_version: _Optional[str] = ..., stripped_default_attrs: _Optional[bool] = ..., function_aliases: _Optional[_Mapping[str, str]] = ...) -> None: ...
    class CollectionDefEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: CollectionDef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[CollectionDef, _Mapping]] = ...) -> None: ...
    class SignatureDefEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SignatureDef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SignatureDef, _Mapping]] = ...) -> None: ...
    META_INFO_DEF_FIELD_NUMBER: _ClassVar[int]
    GRAPH_DEF_FIELD_NUMBER: _ClassVar[int]
    SAVER_DEF_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_DEF_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_DEF_FIELD_NUMBER: _ClassVar[int]
    ASSET_FILE_DEF_FIELD_NUMBER: _ClassVar[int]
    OBJECT_GRAPH_DEF_FIELD_NUMBER: _ClassVar[int]
    meta_info_def: MetaGraphDef.MetaInfoDef
    graph_def: _graph_pb2.GraphDef
    saver_def: _saver_pb2.SaverDef
    collection_def: _containers.MessageMap[str, CollectionDef]
    signature_def: _containers.MessageMap[str, SignatureDef]
    asset_file_def: _containers.RepeatedCompositeFieldContainer[AssetFileDef]
    object_graph_def: _saved_object_graph_pb2.SavedObjectGraph
    def __init__(self, meta_info_def: _Optional[_Union[MetaGraphDef.MetaInfoDef, _Mapping]] = ..., graph_def: _Optional[_Union[_graph_pb2.GraphDef, _Mapping]] = ..., saver_def: _Optional[_Union[_saver_pb2.SaverDef, _Mapping]] = ..., collection_def: _Optional[_Mapping[str, CollectionDef]] = ..., signature_def: _Optional[_Mapping[str, SignatureDef]] = ..., asset_file_def: _Optional[_Iterable[_Union[AssetFileDef, _Mapping]]] = ..., object_graph_def: _Optional[_Union[_saved_object_graph_pb2.SavedObjectGraph, _Mapping]] = ...) -> None: ...

class CollectionDef(_message.Message):
    __slots__ = ("node_list", "bytes_list", "int64_list", "float_list", "any_list")
    class NodeList(_message.Message):
        __slots__ = ("value",)
        VALUE_FIELD_NUMBER: _ClassVar[int]
        value: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, value: _Optional[_Iterable[str]] = ...) -> None: ...
    class BytesList(_message.Message):
        __slots__ = ("value",)
        VALUE_FIELD_NUMBER: _ClassVar[int]
        value: _containers.RepeatedScalarFieldContainer[bytes]
        def __init__(self, value: _Optional[_Iterable[bytes]] = ...) -> None: ...
    class Int64List(_message.Message):
        __slots__ = ("value",)
        VALUE_FIELD_NUMBER: _ClassVar[int]
        value: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, value: _Optional[_Iterable[int]] = ...) -> None: ...
    class FloatList(_message.Message):
        __slots__ = ("value",)
        VALUE_FIELD_NUMBER: _ClassVar[int]
        value: _containers.RepeatedScalarFieldContainer[float]
        def __init__(self, value: _Optional[_Iterable[float]] = ...) -> None: ...
    class AnyList(_message.Message):
        __slots__ = ("value",)
        VALUE_FIELD_NUMBER: _ClassVar[int]
        value: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
        def __init__(self, value: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ...) -> None: ...
    NODE_LIST_FIELD_NUMBER: _ClassVar[int]
    BYTES_LIST_FIELD_NUMBER: _ClassVar[int]
    INT64_LIST_FIELD_NUMBER: _ClassVar[int]
    FLOAT_LIST_FIELD_NUMBER: _ClassVar[int]
    ANY_LIST_FIELD_NUMBER: _ClassVar[int]
    node_list: CollectionDef.NodeList
    bytes_list: CollectionDef.BytesList
    int64_list: CollectionDef.Int64List
    float_list: CollectionDef.FloatList
    any_list: CollectionDef.AnyList
    def __init__(self, node_list: _Optional[_Union[CollectionDef.NodeList, _Mapping]] = ..., bytes_list: _Optional[_Union[CollectionDef.BytesList, _Mapping]] = ..., int64_list: _Optional[_Union[CollectionDef.Int64List, _Mapping]] = ..., float_list: _Optional[_Union[CollectionDef.FloatList, _Mapping]] = ..., any_list: _Optional[_Union[CollectionDef.AnyList, _Mapping]] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "coo_sparse", "composite_tensor", "dtype", "tensor_shape")
    class CooSparse(_message.Message):
        __slots__ = ("values_tensor_name", "indices_tensor_name", "dense_shape_tensor_name")
        VALUES_TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
        INDICES_TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
        DENSE_SHAPE_TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
        values_tensor_name: str
        indices_tensor_name: str
        dense_shape_tensor_name: str
        def __init__(self, values_tensor_name: _Optional[str] = ..., indices_tensor_name: _Optional[str] = ..., dense_shape_tensor_name: _Optional[str] = ...) -> None: ...
    class CompositeTensor(_message.Message):
        __slots__ = ("type_spec", "components")
        TYPE_SPEC_FIELD_NUMBER: _ClassVar[int]
        COMPONENTS_FIELD_NUMBER: _ClassVar[int]
        type_spec: _struct_pb2.TypeSpecProto
        components: _containers.RepeatedCompositeFieldContainer[TensorInfo]
        def __init__(self, type_spec: _Optional[_Union[_struct_pb2.TypeSpecProto, _Mapping]] = ..., components: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    COO_SPARSE_FIELD_NUMBER: _ClassVar[int]
    COMPOSITE_TENSOR_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    coo_sparse: TensorInfo.CooSparse
    composite_tensor: TensorInfo.CompositeTensor
    dtype: _types_pb2.DataType
    tensor_shape: _tensor_shape_pb2.TensorShapeProto
    def __init__(self, name: _Optional[str] = ..., coo_sparse: _Optional[_Union[TensorInfo.CooSparse, _Mapping]] = ..., composite_tensor: _Optional[_Union[TensorInfo.CompositeTensor, _Mapping]] = ..., dtype: _Optional[_Union[_types_pb2.DataType, str]] = ..., tensor_shape: _Optional[_Union[_tensor_shape_pb2.TensorShapeProto, _Mapping]] = ...) -> None: ...

class SignatureDef(_message.Message):
    __slots__ = ("inputs", "outputs", "method_name", "defaults")
    class InputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorInfo
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorInfo, _Mapping]] = ...) -> None: ...
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorInfo
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorInfo, _Mapping]] = ...) -> None: ...
    class DefaultsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.TensorProto
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ...) -> None: ...
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METHOD_NAME_FIELD_NUMBER: _ClassVar[int]
    DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.MessageMap[str, TensorInfo]
    outputs: _containers.MessageMap[str, TensorInfo]
    method_name: str
    defaults: _containers.MessageMap[str, _tensor_pb2.TensorProto]
    def __init__(self, inputs: _Optional[_Mapping[str, TensorInfo]] = ..., outputs: _Optional[_Mapping[str, TensorInfo]] = ..., method_name: _Optional[str] = ..., defaults: _Optional[_Mapping[str, _tensor_pb2.TensorProto]] = ...) -> None: ...

class AssetFileDef(_message.Message):
    __slots__ = ("tensor_info", "filename")
    TENSOR_INFO_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    tensor_info: TensorInfo
    filename: str
    def __init__(self, tensor_info: _Optional[_Union[TensorInfo, _Mapping]] = ..., filename: _Optional[str] = ...) -> None: ...
