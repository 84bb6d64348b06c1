from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FileSystemStoragePathSourceConfig(_message.Message):
    __slots__ = ()
    class ServableVersionPolicy(_message.Message):
        __slots__ = ("latest", "all", "specific")
        class Latest(_message.Message):
            __slots__ = ("num_versions",)
            NUM_VERSIONS_FIELD_NUMBER: _ClassVar[int]
            num_versions: int
            def __init__(self, num_versions: _Optional[int] = ...) -> None: ...
        class All(_message.Message):
            __slots__ = ()
            def __init__(self) -> None: ...
        class Specific(_message.Message):
            __slots__ = ("versions",)
            VERSIONS_FIELD_NUMBER: _ClassVar[int]
            versions: _containers.RepeatedScalarFieldContainer[int]
            def __init__(self, versions: _Optional[_Iterable[int]] = ...) -> None: ...
        LATEST_FIELD_NUMBER: _ClassVar[int]
        ALL_FIELD_NUMBER: _ClassVar[int]
        SPECIFIC_FIELD_NUMBER: _ClassVar[int]
        latest: FileSystemStoragePathSourceConfig.ServableVersionPolicy.Latest
        all: FileSystemStoragePathSourceConfig.ServableVersionPolicy.All
        specific: FileSystemStoragePathSourceConfig.ServableVersionPolicy.Specific
        def __init__(self, latest: _Optional[_Union[FileSystemStoragePathSourceConfig.ServableVersionPolicy.Latest, _Mapping]] = ..., all: _Optional[_Union[FileSystemStoragePathSourceConfig.ServableVersionPolicy.All, _Mapping]] = ..., specific: _Optional[_Union[FileSystemStoragePathSourceConfig.ServableVersionPolicy.Specific, _Mapping]] = ...) -> None: ...
    def __init__(self) -> None: ...
