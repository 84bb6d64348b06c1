"""TFRecord files (warmup files, request logs) through the tfrecord-slow and crc32c packages:
every record's CRC32C is checked when read. The library masks CRCs in numpy uint32s, which wrap
as they should but warn; that warning is silenced here, once for every caller."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import TracebackType

import numpy as np
from tfrecord_slow.reader import TfrecordReader
from tfrecord_slow.writer import TfrecordWriter


def read(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """The file's records in order; RuntimeError at a corrupt or cut record, OSError if unreadable."""
    with TfrecordReader.open(str(path), check_integrity=True) as reader:
        while True:
            with np.errstate(over="ignore"):
                record = reader.read()
            if record is None:
                return
            yield bytes(record)


class Writer:
    """Records appended to a new file (replacing one of that name)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._writer = TfrecordWriter.create(str(path))

    def write(self, record: bytes) -> None:
        with np.errstate(over="ignore"):
            self._writer.write(record)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
