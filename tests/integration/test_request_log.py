"""Request logging (a model's logging_config): sampled Predict requests, gRPC and REST, with their
responses, in TFRecord files that TensorFlow's own tf.data.TFRecordDataset reads back; files
rotated by size with bounded disk use; writing failures counted, never failing a request;
`python -m client warmup-from-log` turns the logs into a warmup file the server replays; bad
logging configs stop the start, naming what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from client.api import build_predict_request, decode_outputs
from protos.tensorflow_serving import prediction_log_pb2, prediction_service_pb2_grpc
from server.api import tensor_codec as codec
from tests.integration.conftest import ROOT, ServerProcess, start_server
from tests.integration.test_lifecycle import wait_until

WARMUP = Path("assets.extra") / "tf_serving_warmup_requests"


def tensor_array(tensor: object) -> np.ndarray:
    return codec.to_ndarray(tensor, name="t", max_bytes=1 << 30)


def logging_block(prefix: Path, rate: float) -> str:
    return (f'logging_config {{ log_collector_config {{ type: "file" filename_prefix: "{prefix}" }} '
            f'sampling_config {{ sampling_rate: {rate} }} }}')


def config(path: Path, models: dict[str, tuple[Path, str]]) -> Path:
    path.write_text("model_config_list {\n" + "".join(
        f'  config {{ name: "{name}" base_path: "{base}" {extra} }}\n' for name, (base, extra) in models.items())
        + "}\n")
    return path


def read_back(prefix: Path) -> list[prediction_log_pb2.PredictionLog]:
    """Every record of the logs under `prefix`, oldest file first, read by TensorFlow itself."""
    import tensorflow as tf

    files = sorted(prefix.parent.glob(prefix.name + ".*.tfrecord"), key=lambda p: int(p.name.split(".")[-2]))
    return [prediction_log_pb2.PredictionLog.FromString(raw.numpy())
            for raw in tf.data.TFRecordDataset([str(f) for f in files])]


def rest_predict(server: ServerProcess, model: str, rows: list[list[float]]) -> dict[str, object]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.rest_port}/v1/models/{model}:predict",
                                     data=json.dumps({"instances": rows}).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return dict(json.loads(answer.read()))


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> Iterator[
        tuple[ServerProcess, Path]]:
    """demo logs every request; echo half of them; multi has no logging_config."""
    folder = tmp_path_factory.mktemp("logged")
    (folder / "logs").mkdir()
    path = config(folder / "models.config", {
        "demo": (model_dirs["demo"], logging_block(folder / "logs" / "demo", 1.0)),
        "echo": (model_dirs["echo"], logging_block(folder / "logs" / "echo", 0.5)),
        "multi": (model_dirs["multi"], ""),
    })
    server = start_server(["--model-config-file", str(path), "--batch-timeout-ms", "1"], folder / "server.log")
    yield server, folder / "logs"
    server.stop()


def test_sampled_requests_and_their_responses_are_logged(logged: tuple[ServerProcess, Path]) -> None:
    server, logs = logged
    channel = grpc.insecure_channel(server.target)
    predict = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict
    rng = np.random.default_rng(3)
    sent, answers = [], []
    for i in range(20):
        x = rng.standard_normal((1 + i % 3, 8)).astype(np.float32)
        sent.append(x)
        answers.append(decode_outputs(predict(build_predict_request("demo", {"x": x}), timeout=30)))
    rows = [[0.5] * 8, [1.0] * 8]
    rest_answer = rest_predict(server, "demo", rows)
    for _ in range(400):
        predict(build_predict_request("echo", {"x": np.array([[1, 2]], np.int64)}), timeout=30)
    predict(build_predict_request("multi", {"a": np.ones((1, 3), np.float32), "b": np.ones(1, np.int32)}),
            timeout=30)
    channel.close()
    wait_until(lambda: server.metric("mirrorserve_request_log_records_total", model="demo") == 21)

    records = read_back(logs / "demo")
    assert len(records) == 21
    for record, x, answer in zip(records, sent, answers, strict=False):
        assert record.WhichOneof("log_type") == "predict_log"
        metadata = record.log_metadata
        assert (metadata.model_spec.name, metadata.model_spec.version.value) == ("demo", 1)
        assert metadata.model_spec.signature_name == "serving_default"
        assert metadata.sampling_config.sampling_rate == 1.0 and list(metadata.saved_model_tags) == ["serve"]
        assert abs(metadata.timestamp_secs - time.time()) < 300
        np.testing.assert_array_equal(tensor_array(record.predict_log.request.inputs["x"]), x)
        for name, value in answer.items():
            np.testing.assert_array_equal(tensor_array(record.predict_log.response.outputs[name]), value)
    rest_record = records[-1].predict_log  # the REST call, as the gRPC call would have carried it
    np.testing.assert_array_equal(tensor_array(rest_record.request.inputs["x"]), np.array(rows, np.float32))
    predictions = rest_answer["predictions"]
    assert isinstance(predictions, list)
    np.testing.assert_allclose(tensor_array(rest_record.response.outputs["probabilities"]),
                               [p["probabilities"] for p in predictions], rtol=1e-6)

    echo = server.metric("mirrorserve_request_log_records_total", model="echo")
    assert 140 <= echo <= 260, f"sampling_rate 0.5 logged {echo:.0f} of 400"  # binomial sd 10
    assert not list(logs.glob("multi*")) and server.metric("mirrorserve_request_log_records_total", model="multi") == 0
    assert server.metric("mirrorserve_request_log_dropped_total") == 0
    assert "logging model=demo requests: sampling_rate=1 files=" in server.log()


@pytest.fixture(scope="module")
def small_files(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> Iterator[
        tuple[ServerProcess, Path]]:
    """Files of 4,000 bytes, 3 kept: `rotating` logs under logs/, `failing` under failing/."""
    folder = tmp_path_factory.mktemp("small-files")
    (folder / "logs").mkdir()
    (folder / "failing").mkdir()
    path = config(folder / "models.config", {
        "rotating": (model_dirs["demo"], logging_block(folder / "logs" / "d", 1)),
        "failing": (model_dirs["demo"], logging_block(folder / "failing" / "d", 1)),
    })
    server = start_server(["--model-config-file", str(path), "--request-log-file-bytes", "4000",
                           "--request-log-max-files", "3", "--drain-delay-s", "0"], folder / "server.log")
    yield server, folder
    server.stop()


def logged_or_dropped(server: ServerProcess, model: str) -> float:
    return (server.metric("mirrorserve_request_log_records_total", model=model)
            + server.metric("mirrorserve_request_log_dropped_total", model=model))


def test_files_rotate_by_size_and_only_the_newest_are_kept(small_files: tuple[ServerProcess, Path]) -> None:
    server, folder = small_files
    channel = grpc.insecure_channel(server.target)
    predict = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict
    for i in range(60):  # each record ~0.35 KB: about 6 files' worth
        predict(build_predict_request("rotating", {"x": np.full((2, 8), i, np.float32)}), timeout=30)
        wait_until(lambda i=i: logged_or_dropped(server, "rotating") == i + 1)  # never a file's worth behind
    channel.close()
    assert server.metric("mirrorserve_request_log_records_total", model="rotating") == 60
    written = server.metric("mirrorserve_request_log_bytes_total", model="rotating")
    files = sorted((folder / "logs").glob("d.*.tfrecord"))
    assert len(files) == 3, files
    assert all(f.stat().st_size < 4000 + 1000 for f in files)
    assert sum(f.stat().st_size for f in files) < written
    records = read_back(folder / "logs" / "d")
    values = [int(tensor_array(r.predict_log.request.inputs["x"])[0, 0]) for r in records]
    assert values == list(range(60 - len(values), 60)), "the newest records, in order"


def test_a_log_that_cannot_be_written_drops_records_and_requests_go_on(small_files: tuple[ServerProcess, Path]) -> None:
    server, folder = small_files
    channel = grpc.insecure_channel(server.target)
    predict = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict
    request = build_predict_request("failing", {"x": np.ones((2, 8), np.float32)})
    predict(request, timeout=30)
    wait_until(lambda: server.metric("mirrorserve_request_log_records_total", model="failing") == 1)
    logs = folder / "failing"
    for file in logs.iterdir():
        file.unlink()
    logs.rmdir()  # the open file takes records up to its 4,000 bytes; the next one cannot be created
    for sent in range(2, 32):
        predict(request, timeout=30)
        wait_until(lambda sent=sent: logged_or_dropped(server, "failing") == sent)  # never a file's worth behind
    channel.close()
    assert server.metric("mirrorserve_request_log_dropped_total", model="failing", reason="write_error") >= 15
    assert server.metric("mirrorserve_request_log_dropped_total", model="failing", reason="queue_full") == 0
    assert server.metric("mirrorserve_requests_total", model="failing", code="OK") == 31
    assert server.log().count("records are dropped until writing works again") == 1, "logged once, not per record"


def test_warmup_from_log_makes_a_warmup_file_the_server_replays(
        logged: tuple[ServerProcess, Path], model_dirs: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    import tensorflow as tf

    server, logs = logged
    before = server.metric("mirrorserve_request_log_records_total", model="demo")
    channel = grpc.insecure_channel(server.target)
    predict = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict
    for rows in range(1, 7):
        predict(build_predict_request("demo", {"x": np.ones((rows, 8), np.float32)}), timeout=30)
    channel.close()
    wait_until(lambda: server.metric("mirrorserve_request_log_records_total", model="demo") == before + 6)
    base = tmp_path / "demo"
    shutil.copytree(model_dirs["demo"], base)
    out = base / "1" / WARMUP
    files = sorted(str(f) for f in logs.glob("*.tfrecord"))
    done = subprocess.run([sys.executable, "-m", "client", "warmup-from-log", *files, "--out", str(out),
                           "--model", "demo", "--max-records", "5"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote 5 requests (of " in done.stdout and str(out) in done.stdout
    kept = [prediction_log_pb2.PredictionLog.FromString(r.numpy()) for r in tf.data.TFRecordDataset(str(out))]
    assert len(kept) == 5 and all(r.WhichOneof("log_type") == "predict_log" for r in kept)
    assert all(not r.predict_log.HasField("response") and not r.HasField("log_metadata") for r in kept)
    replaying = start_server(["--model-base-path", str(base), "--model-name", "demo"], tmp_path / "server.log")
    try:
        assert f"warmed up model=demo version=1 from {out}: 5 records, 5 requests in " in replaying.log()
    finally:
        replaying.stop()


@pytest.mark.parametrize(("block", "message"), [
    ('logging_config { log_collector_config { type: "kafka" filename_prefix: "/tmp/x" } }',
     "log_collector_config type 'kafka' is not supported; supported: file"),
    ('logging_config { log_collector_config { type: "file" } }', "log_collector_config has no filename_prefix"),
    ('logging_config { log_collector_config { type: "file" filename_prefix: "/tmp/x" } '
     'sampling_config { sampling_rate: 1.5 } }', "sampling_rate 1.5 is not between 0 and 1"),
    ('logging_config { log_collector_config { type: "file" filename_prefix: "MISSING/sub/x" } }',
     "request log folder MISSING/sub (of filename_prefix MISSING/sub/x) is not a folder"),
    ('logging_config { log_collector_config { type: "file" filename_prefix: "FILE/x" } }',
     "request log folder FILE (of filename_prefix FILE/x) is not a folder"),
    ('logging_config { log_collector_config { type: "file" filename_prefix: "/proc/1/x" } }',
     "request log folder /proc/1 (of filename_prefix /proc/1/x) cannot be written by this process"),
    ('logging_config { log_collector_config { type: "file" filenam_prefix: "/tmp/x" } }',
     'has no field named "filenam_prefix"'),
])
def test_bad_logging_configs_stop_the_start_naming_them(tmp_path: Path, model_dirs: dict[str, Path], block: str,
                                                        message: str) -> None:
    (tmp_path / "file").write_text("")
    block = block.replace("MISSING", str(tmp_path / "missing")).replace("FILE", str(tmp_path / "file"))
    message = message.replace("MISSING", str(tmp_path / "missing")).replace("FILE", str(tmp_path / "file"))
    path = config(tmp_path / "models.config", {"demo": (model_dirs["demo"], block)})
    done = subprocess.run([sys.executable, "-m", "server", "--port", "0", "--rest-api-port", "-1",
                           "--model-config-file", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr, done.stderr[-2000:]
