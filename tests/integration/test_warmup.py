"""TF Serving's warmup files, written the way TF Serving's documentation writes them (the official
package's PredictionLog, TensorFlow's TFRecordWriter): replayed before a version serves, so its
first real request is as fast as the steady ones; a corrupt file or a failing record fails that
version's load, naming the file and the record, while the version serving goes on serving. And
the worker's own warm-up on generated rows: a version that fails it does not serve, unless a
warmup file of its own or --no-strict-warm-up lets it."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from client.api import build_predict_request, decode_outputs
from protos.tensorflow_serving import (
    get_model_status_pb2,
    model_service_pb2_grpc,
    prediction_log_pb2,
    prediction_service_pb2_grpc,
)
from server.api import tfrecords
from tests.integration.conftest import ServerProcess, start_server
from tests.integration.saved_models import build_convolution, build_positive_only
from tests.integration.test_official_client import official_client_path

HERE = Path(__file__).resolve().parent
WARMUP = Path("assets.extra") / "tf_serving_warmup_requests"
SIZE = 96
"""The real requests' image size; the worker's own warm-up only runs 1x1 images."""
STEADY_CALLS = 100
STEADY_GAP_S = 0.02
AVAILABLE, END = 30, 50


def image(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((rows, SIZE, SIZE, 3), dtype=np.float32)


def write_warmup(version_dir: Path, records: dict[str, dict[str, np.ndarray]], session_runs: int = 0) -> Path:
    """A warmup file of predict records (and `session_runs` session_run records, a kind this
    server skips), by the official package."""
    target = version_dir / WARMUP
    target.parent.mkdir(parents=True, exist_ok=True)
    arrays = version_dir.parent / f"{version_dir.name}-warmup.npz"
    np.savez(arrays, **{f"{record}/{name}": array for record, inputs in records.items()
                        for name, array in inputs.items()})
    env = {**os.environ, "PYTHONPATH": official_client_path(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, str(HERE / "official_warmup_writer.py"), str(target), str(arrays),
                           str(session_runs)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    arrays.unlink()
    return target


@pytest.fixture(scope="module")
def convolution(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A built convolution version, to copy into each test's model folder."""
    built = tmp_path_factory.mktemp("convolution") / "1"
    build_convolution(built)
    return built


def add_version(base: Path, version: int, built: Path, **warmup: object) -> Path:
    """Version `version` of the model at `base`, with a warmup file if asked, moved into place whole."""
    staging = base.parent / f".staging-{version}"
    shutil.copytree(built, staging)
    if warmup:
        write_warmup(staging, **warmup)  # type: ignore[arg-type]
    staging.rename(base / str(version))
    return base / str(version)


class Client:
    def __init__(self, server: ServerProcess) -> None:
        self.channel = grpc.insecure_channel(server.target)
        self.predict = prediction_service_pb2_grpc.PredictionServiceStub(self.channel).Predict
        self.models = model_service_pb2_grpc.ModelServiceStub(self.channel)

    def seconds(self, rows: int = 1, seed: int = 0, version: int | None = None) -> float:
        """The server's own time on one request (its mirrorserve-server-seconds trailer)."""
        request = build_predict_request("conv", {"image": image(rows, seed)})
        if version is not None:
            request.model_spec.version.value = version
        response, call = self.predict.with_call(request, timeout=30)
        assert decode_outputs(response)["features"].shape == (rows, 16)
        return float(dict(call.trailing_metadata())["mirrorserve-server-seconds"])

    def status(self) -> dict[int, tuple[int, int, str]]:
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = "conv"
        response = self.models.GetModelStatus(request, timeout=10)
        return {s.version: (s.state, s.status.error_code, s.status.error_message)
                for s in response.model_version_status}

    def wait_for(self, version: int, state: int, timeout: float = 60.0) -> tuple[int, int, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.status().get(version)
            if found is not None and found[0] == state:
                return found
            time.sleep(0.05)
        raise AssertionError(f"version {version} never reached state {state}: {self.status()}")


def firsts_then_steady(server: ServerProcess, versions: list[int]) -> tuple[list[float], float]:
    """(each version's first request's seconds, the p99 of STEADY_CALLS), one at a time, as the
    server timed them: from its receipt to its answer, so neither the client's connection nor its
    own first call counts. Each call comes STEADY_GAP_S after the one before, to an idle server,
    and the steady calls go round the versions as the first ones do: each call meets another
    version's weights than the call before, so both sides of the comparison pay the same cache
    misses and only compilation differs."""
    client = Client(server)
    for version in versions:
        client.wait_for(version, AVAILABLE)
    firsts = []
    for version in versions:
        time.sleep(STEADY_GAP_S)
        firsts.append(client.seconds(seed=version, version=version))
    steady = []
    for i in range(STEADY_CALLS):
        time.sleep(STEADY_GAP_S)
        steady.append(client.seconds(seed=10 + i, version=versions[i % len(versions)]))
    client.channel.close()
    return firsts, float(np.percentile(steady, 99))


def serve(base: Path, folder: Path, *flags: str) -> ServerProcess:
    return start_server(["--model-base-path", str(base), "--model-name", "conv", "--batch-timeout-ms", "1",
                         "--file-system-poll-wait-seconds", "0.2", "--drain-delay-s", "0", *flags],
                        folder / "server.log")


def test_a_warmup_file_makes_the_first_request_as_fast_as_the_steady_ones(
        convolution: Path, tmp_path: Path) -> None:
    """Three versions, each with its warmup file, all served: the first request to each, with
    warmup and without, against the steady p99."""
    base = tmp_path / "conv"
    base.mkdir()
    records = {"a": {"image": image(1, 100)}, "b": {"image": image(3, 101)}}
    for version in (1, 2, 3):
        add_version(base, version, convolution, records=records, session_runs=2)
    config = tmp_path / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "conv" base_path: "{base}" '
                      f'model_version_policy {{ all {{}} }} }} }}\n')
    results = {}
    for label, flags in (("without warmup", ("--no-model-warmup",)), ("with warmup", ())):
        folder = tmp_path / label.replace(" ", "-")
        folder.mkdir()
        server = start_server(["--model-config-file", str(config), "--batch-timeout-ms", "1", "--drain-delay-s", "0",
                               *flags], folder / "server.log")
        try:
            results[label] = firsts_then_steady(server, [1, 2, 3])
            log = server.log()
            warmups = server.metric(":tensorflow:serving:model_warmup_latency_count", status="OK")
        finally:
            server.stop()
        if flags:
            assert "warmed up" not in log and warmups == 0
        else:
            for version in (1, 2, 3):
                assert (f"warmed up model=conv version={version} from {base / str(version) / WARMUP}: "
                        f"4 records, 2 requests in " in log), log
            assert log.count("; skipped (not served here): 2 session_run_log") == 3
            assert warmups == 3
    print({label: f"first requests {', '.join(f'{f * 1e3:.1f}' for f in firsts)} ms; steady p99 {p99 * 1e3:.1f} ms"
           for label, (firsts, p99) in results.items()})
    firsts, p99 = results["with warmup"]
    assert statistics.median(firsts) <= p99, results
    firsts, p99 = results["without warmup"]
    assert min(firsts) > 3 * p99, "without the file, the first request at a new shape compiles"


@pytest.fixture(scope="module")
def rolling(convolution: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[Path, ServerProcess, Client]]:
    """A server whose conv model serves version 1 (warmed up), polled every 0.2 s for new ones:
    the tests below add versions 2 (corrupt file), 3 (failing record) and 4 (good)."""
    tmp_path = tmp_path_factory.mktemp("rolling")
    base = tmp_path / "conv"
    base.mkdir()
    add_version(base, 1, convolution, records={"a": {"image": image(1, 7)}})
    server = serve(base, tmp_path)
    client = Client(server)
    yield base, server, client
    client.channel.close()
    server.stop()


def test_a_corrupt_warmup_file_fails_the_new_version_and_the_old_one_serves_on(
        rolling: tuple[Path, ServerProcess, Client], convolution: Path) -> None:
    base, server, client = rolling
    staging = base.parent / "v2"
    shutil.copytree(convolution, staging)
    warmup = write_warmup(staging, {"a": {"image": image(1, 8)}, "b": {"image": image(1, 9)}})
    data = bytearray(warmup.read_bytes())
    data[len(data) // 2 + 40] ^= 0xFF  # a byte of the second record's data: its CRC no longer matches
    warmup.write_bytes(bytes(data))
    staging.rename(base / "2")
    _, code, message = client.wait_for(2, END)
    assert code == grpc.StatusCode.DATA_LOSS.value[0], message
    assert f"{base / '2' / WARMUP}: record 1 cannot be read" in message and "TFRecord format" in message
    assert client.status()[1][0] == AVAILABLE
    client.seconds()
    assert server.metric(":tensorflow:serving:model_warmup_latency_count", status="DATA_LOSS") >= 1
    assert server.metric("mirrorserve_model_load_failures_total", model="conv", version="2") >= 1


def test_a_failing_record_fails_the_new_version_naming_it(
        rolling: tuple[Path, ServerProcess, Client], convolution: Path) -> None:
    base, _, client = rolling
    good, bad = image(1, 10), image(1, 11)[..., :2]  # two channels where the model takes three
    add_version(base, 3, convolution, records={"a": {"image": good}, "b": {"image": bad}})
    _, code, message = client.wait_for(3, END)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0], message
    assert f"{base / '3' / WARMUP}: record 1 (predict_log) failed: " in message and "image" in message, message
    assert client.status()[1][0] == AVAILABLE
    client.seconds()
    # The folder fixed: the next version with a good file serves, and the old one is unloaded.
    add_version(base, 4, convolution, records={"a": {"image": good}})
    client.wait_for(4, AVAILABLE)
    client.wait_for(1, END)
    assert client.seconds() > 0


def test_a_corrupt_warmup_file_at_start_is_named_while_the_server_waits(convolution: Path, tmp_path: Path) -> None:
    """The only version's file is corrupt: the server listens, says it is not serving and why
    (file and record), and keeps retrying, as for any version that fails to load."""
    base = tmp_path / "conv"
    base.mkdir()
    version = add_version(base, 1, convolution, records={"a": {"image": image(1, 3)}})
    warmup = version / WARMUP
    warmup.write_bytes(warmup.read_bytes()[:-7])  # cut: the record's end is missing
    server = start_server(["--model-base-path", str(base), "--model-name", "conv", "--drain-delay-s", "0"],
                          tmp_path / "server.log", ready=False)
    try:
        deadline = time.monotonic() + 60
        while "not serving yet" not in server.log():
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        assert f"not serving yet (health NOT_SERVING); retrying: 'conv': {warmup}: record 0 cannot be read" in (
            server.log())
    finally:
        server.stop()


def model_status(channel: grpc.Channel, model: str) -> dict[int, tuple[int, int, str]]:
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = model
    response = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(request, timeout=10)
    return {s.version: (s.state, s.status.error_code, s.status.error_message) for s in response.model_version_status}


def predict(channel: grpc.Channel, model: str, x: np.ndarray) -> np.ndarray:
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    return decode_outputs(stub.Predict(build_predict_request(model, {"x": x}), timeout=30))["log"]


def v2_ready(server: ServerProcess, model: str) -> int:
    try:
        with urllib.request.urlopen(f"{server.rest_url}/v2/models/{model}/ready", timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_a_version_that_fails_the_generated_warm_up_does_not_serve_unless_its_warmup_file_passes(
        tmp_path: Path) -> None:
    """positive_only refuses zeros: alone it does not serve and says why; the same model with a
    warmup file of positive rows is judged by that file, and serves."""
    build_positive_only(tmp_path / "picky" / "1")
    shutil.copytree(tmp_path / "picky", tmp_path / "picky_warm")
    record = prediction_log_pb2.PredictionLog()
    record.predict_log.request.CopyFrom(build_predict_request("picky_warm", {"x": np.full((2, 2), 3.0, np.float32)}))
    (tmp_path / "picky_warm" / "1" / WARMUP).parent.mkdir()
    with tfrecords.Writer(tmp_path / "picky_warm" / "1" / WARMUP) as writer:
        writer.write(record.SerializeToString())
    config = tmp_path / "models.config"
    config.write_text("model_config_list {" + "".join(
        f' config {{ name: "{name}" base_path: "{tmp_path / name}" }}' for name in ("picky", "picky_warm")) + " }\n")
    server = start_server(["--model-config-file", str(config), "--replicas", "2", "--drain-delay-s", "0"],
                          tmp_path / "server.log", ready=False)
    channel = grpc.insecure_channel(server.target)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:  # UNAVAILABLE while the server starts
                if (model_status(channel, "picky").get(1, (0,))[0] == END
                        and model_status(channel, "picky_warm").get(1, (0,))[0] == AVAILABLE):
                    break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            time.sleep(0.1)
        _, code, message = model_status(channel, "picky")[1]
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0], message
        assert ("signature 'serving_default' failed its warm-up on 1 generated rows" in message
                and "inputs must be positive" in message and "--no-strict-warm-up" in message), message
        assert v2_ready(server, "picky") == 400 and v2_ready(server, "picky_warm") == 200
        with pytest.raises(grpc.RpcError) as refused:
            predict(channel, "picky", np.ones((1, 2), np.float32))
        # Failed, or loading again after its back-off: never served.
        assert refused.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE), refused.value
        np.testing.assert_allclose(predict(channel, "picky_warm", np.full((3, 2), np.e, np.float32)), np.ones((3, 2)),
                                   rtol=1e-6)
        log = server.log()
        assert "model 'picky_warm' version 1: signature 'serving_default' failed its warm-up" in log
        assert "served anyway (its warmup file decides" in log
        assert "warmed up model=picky_warm version=1" in log
        assert "serving model=" not in log  # a configured model has no version: the server is not ready
    finally:
        channel.close()
        server.stop()


def test_no_strict_warm_up_serves_a_model_that_refuses_the_generated_rows(tmp_path: Path) -> None:
    build_positive_only(tmp_path / "picky" / "1")
    server = start_server(["--model-base-path", str(tmp_path / "picky"), "--model-name", "picky",
                           "--no-strict-warm-up", "--drain-delay-s", "0"], tmp_path / "server.log")
    channel = grpc.insecure_channel(server.target)
    try:
        np.testing.assert_allclose(predict(channel, "picky", np.full((2, 2), np.e, np.float32)), np.ones((2, 2)),
                                   rtol=1e-6)
        with pytest.raises(grpc.RpcError) as refused:  # the model's own check still answers zeros
            predict(channel, "picky", np.zeros((1, 2), np.float32))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert (refused.value.details() or "").startswith("assertion failed: [inputs must be positive"), refused.value
        assert "served anyway (--no-strict-warm-up)" in server.log()
    finally:
        channel.close()
        server.stop()
