"""The request log's writer: records written in order and readable; when the writer falls a
file's worth behind, records are dropped and counted, and putting one never waits."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from server import metrics
from server.api import tfrecords
from server.api.request_log import RequestLogger
from server.core.model_config import RequestLogging


def counter(child: object) -> float:
    return float(child._value.get())  # type: ignore[attr-defined]


def records_in(folder: Path) -> list[bytes]:
    out: list[bytes] = []
    for path in sorted(folder.glob("*.tfrecord"), key=lambda p: int(p.name.split(".")[-2])):
        out += tfrecords.read(path)
    return out


def test_records_are_written_in_order(tmp_path: Path) -> None:
    logger = RequestLogger("in-order", RequestLogging(str(tmp_path / "log"), 1.0), max_file_bytes=300, max_files=100)
    for i in range(50):
        logger.put(b"record %d" % i)
        while logger._pending:  # the bound on waiting records is one (tiny) file's worth: keep under it
            time.sleep(0.001)
    logger.close()
    assert records_in(tmp_path) == [b"record %d" % i for i in range(50)]
    assert len(list(tmp_path.glob("log.*.tfrecord"))) > 1, "rotated at 300 bytes"


def test_a_writer_a_file_behind_drops_and_counts_without_waiting(tmp_path: Path) -> None:
    logger = RequestLogger("behind", RequestLogging(str(tmp_path / "log"), 1.0), max_file_bytes=1000, max_files=10)
    release = threading.Event()
    write = logger._write

    def stuck(record: bytes) -> None:
        release.wait()
        write(record)

    logger._write = stuck  # type: ignore[method-assign]
    dropped = metrics.REQUEST_LOG_DROPPED.labels("behind", "queue_full")
    started = time.perf_counter()
    for _ in range(30):
        logger.put(b"x" * 100)  # 3,000 bytes against a bound of 1,000
    assert time.perf_counter() - started < 0.05, "put never waits for the writer"
    assert 19 <= counter(dropped) <= 21  # ten fit (one may already be in the writer's hands)
    release.set()
    logger.close()
    assert len(records_in(tmp_path)) == 30 - counter(dropped)
    assert counter(metrics.REQUEST_LOG_RECORDS.labels("behind")) == 30 - counter(dropped)


def test_sampling_rate_is_a_share_of_requests(tmp_path: Path) -> None:
    logger = RequestLogger("share", RequestLogging(str(tmp_path / "log"), 0.25), max_file_bytes=1000, max_files=1)
    taken = sum(logger.sampled() for _ in range(20_000))
    logger.close()
    assert 4_700 <= taken <= 5_300  # binomial sd 61


def test_a_model_that_stops_logging_has_its_writer_stopped(tmp_path: Path) -> None:
    from server.api.request_log import RequestLogs
    from server.core.model_config import ModelSource
    from server.core.servables import Model, Registry, Servable

    registry = Registry()
    config = RequestLogging(str(tmp_path / "log"), 1.0)
    registry.models["m"] = Model(ModelSource("m", "/m", logging=config))
    logs = RequestLogs(registry, 1000, 2)
    logger = logs.sample(Servable(name="m", version=1, path="/m"))
    assert logger is not None and logger._thread.is_alive()
    logs.retire(registry)
    assert logger._thread.is_alive(), "still configured: kept"
    registry.models["m"] = Model(ModelSource("m", "/m"))  # a reload without logging_config
    logs.retire(registry)
    logger._thread.join(2.0)
    assert not logger._thread.is_alive()
    assert logs.sample(Servable(name="m", version=1, path="/m")) is None
