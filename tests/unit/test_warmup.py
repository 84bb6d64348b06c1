"""Reading warmup files: every record checked against its CRC32C, and each way a file can be bad
named with its code (TF Serving's: DATA_LOSS for a file that is not whole TFRecords,
INVALID_ARGUMENT for more records than it replays)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.api import tfrecords
from server.api.warmup import DATA_LOSS, INVALID_ARGUMENT, iter_records
from server.core.model_process import LoadError


def read_records(path: Path, limit: int = 1000) -> list[bytes]:
    return list(iter_records(path, limit))


def write(path: Path, records: list[bytes]) -> Path:
    with tfrecords.Writer(path) as writer:
        for record in records:
            writer.write(record)
    return path


def test_records_come_back_in_order(tmp_path: Path) -> None:
    records = [b"first", b"", b"x" * 3_000_000]
    assert read_records(write(tmp_path / "w", records)) == records


def test_an_empty_file_has_no_records(tmp_path: Path) -> None:
    assert read_records(write(tmp_path / "w", [])) == []


@pytest.mark.parametrize("where", ["length", "length crc", "data", "data crc"])
def test_a_changed_byte_is_data_loss_naming_the_record(tmp_path: Path, where: str) -> None:
    path = write(tmp_path / "w", [b"a" * 100, b"b" * 100, b"c" * 100])
    data = bytearray(path.read_bytes())
    second = 8 + 4 + 100 + 4
    data[second + {"length": 0, "length crc": 9, "data": 50, "data crc": 8 + 4 + 100 + 1}[where]] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(LoadError) as caught:
        read_records(path)
    assert caught.value.code == DATA_LOSS
    assert f"{path}: record 1 cannot be read" in str(caught.value) and "TFRecord format" in str(caught.value)


def test_a_cut_file_and_a_file_of_text_are_data_loss(tmp_path: Path) -> None:
    path = write(tmp_path / "w", [b"a" * 100, b"b" * 100])
    path.write_bytes(path.read_bytes()[:-30])
    with pytest.raises(LoadError, match="record 1 cannot be read") as caught:
        read_records(path)
    assert caught.value.code == DATA_LOSS
    text = tmp_path / "text"
    text.write_text("this is not a TFRecord file, but it is long enough to look like a header\n")
    with pytest.raises(LoadError, match="record 0 cannot be read") as caught:
        read_records(text)
    assert caught.value.code == DATA_LOSS


def test_more_records_than_the_limit_is_invalid_argument(tmp_path: Path) -> None:
    path = write(tmp_path / "w", [b"r"] * 11)
    assert len(read_records(path, limit=11)) == 11
    with pytest.raises(LoadError, match=r"Number of warmup records exceeds the maximum \(10\) at ") as caught:
        read_records(path, limit=10)
    assert caught.value.code == INVALID_ARGUMENT


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "w"
    folder.mkdir()
    with pytest.raises(LoadError, match=f"cannot read warmup file {folder}") as caught:
        read_records(folder)
    assert caught.value.code == DATA_LOSS
