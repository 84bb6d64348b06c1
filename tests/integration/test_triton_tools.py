"""Triton's tools against the server, unchanged: tritonclient's get_model_config,
get_inference_statistics, get_model_repository_index, load_model and unload_model over gRPC and
HTTP, checked against what the server did (its request counts and its Prometheus histograms);
loading and unloading a model under load on another; the bad inputs of those calls; each request's
own timing on every protocol; and perf_analyzer, Triton's C++ load generator, in its three modes.

tritonclient registers the protocol's proto symbols, as our generated code does; the two cannot
live in one process, so nothing here imports protos.inference (the server does, in its own).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from client.api import build_predict_request
from protos.tensorflow_serving import prediction_service_pb2_grpc
from tests.integration.conftest import ServerProcess, start_server, triton_client_path
from tests.integration.test_lifecycle import rss_mib
from tests.integration.test_model_worker import worker_of

sys.path.insert(0, triton_client_path())
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CYCLES = int(os.environ.get("REPOSITORY_CYCLES", "10"))


@pytest.fixture(scope="module")
def repository(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    for name in ("demo", "echo"):
        shutil.copytree(model_dirs[name], root / name)
    shutil.copytree(model_dirs["echo"], root / "spare")
    shutil.copytree(model_dirs["slow"], root / "slow")
    (root / "notamodel" / "junk").mkdir(parents=True)
    (root / "escape").symlink_to(model_dirs["echo"])  # a model folder outside the repository
    (root / "corrupt" / "1").mkdir(parents=True)
    (root / "corrupt" / "1" / "saved_model.pb").write_bytes(b"not a SavedModel")
    return root


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("explicit")
    (root / "tokens").write_text(f"tester {TOKEN}\n")
    process = start_server(["--model-repository", str(repository), "--model-control-mode", "explicit",
                            "--load-model", "demo", "--enable-model-management", "--admin-token-file",
                            str(root / "tokens"), "--drain-delay-s", "0", "--file-system-poll-wait-seconds", "0"],
                           root / "server.log")
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def clients(server: ServerProcess) -> Iterator[dict[str, Any]]:
    with tgrpc.InferenceServerClient(server.target) as g:
        h = thttp.InferenceServerClient(server.rest_url.removeprefix("http://"))
        yield {"grpc": g, "http": h}
        h.close()


def infer(client: Any, model: str, array: np.ndarray, name: str = "x") -> Any:
    module = tgrpc if isinstance(client, tgrpc.InferenceServerClient) else thttp
    datatype = "FP32" if array.dtype == np.float32 else "INT64"
    tensor = module.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return client.infer(model, [tensor])


def fails(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_model_config_describes_what_is_served(clients: dict[str, Any], kind: str) -> None:
    if kind == "grpc":
        config = clients[kind].get_model_config("demo", as_json=True)["config"]
    else:
        config = clients[kind].get_model_config("demo")
    assert config["name"] == "demo" and config["platform"] == "tensorflow_savedmodel"
    assert int(config["max_batch_size"]) == 64
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    assert [(i["name"], i["data_type"], [int(d) for d in i["dims"]]) for i in config["input"]] == [
        ("x", "TYPE_FP32", [8])]
    assert sorted((o["name"], o["data_type"]) for o in config["output"]) == [
        ("class_id", "TYPE_INT64"), ("probabilities", "TYPE_FP32")]
    assert "dynamic_batching" in config


def test_server_metadata_lists_the_extensions_served(clients: dict[str, Any]) -> None:
    grpc_extensions = set(clients["grpc"].get_server_metadata(as_json=True)["extensions"])
    assert grpc_extensions == {"model_configuration", "statistics", "model_repository"}
    assert set(clients["http"].get_server_metadata()["extensions"]) == grpc_extensions | {"binary_tensor_data"}


def test_statistics_count_what_the_server_did(server: ServerProcess, clients: dict[str, Any]) -> None:
    """On a freshly loaded model: the counts equal the requests sent, and the durations come
    from the readings of the Prometheus histograms."""
    clients["http"].load_model("spare", headers=AUTH)
    sent = 12
    for i in range(sent):
        infer(clients["grpc" if i % 2 else "http"], "spare", np.array([[i, i]], dtype=np.int64))
    with pytest.raises(InferenceServerException):  # wrong dtype: counted as failed
        infer(clients["grpc"], "spare", np.ones((1, 2), np.float32))
    for kind in ("grpc", "http"):
        stats = clients[kind].get_inference_statistics("spare", as_json=True) if kind == "grpc" else \
            clients[kind].get_inference_statistics("spare")
        (entry,) = stats["model_stats"]
        inference = entry["inference_stats"]
        assert entry["version"] == "1"
        assert int(entry["inference_count"]) == sent
        assert int(inference["success"]["count"]) == sent and int(inference["fail"]["count"]) == 1
        assert int(inference["queue"]["count"]) == sent
        for part in ("compute_input", "compute_infer", "compute_output"):
            assert int(inference[part]["count"]) == sent, part
        batches = entry["batch_stats"]
        assert sum(int(b["compute_infer"]["count"]) for b in batches) == int(entry["execution_count"]) >= 1
        assert int(entry["last_inference"]) / 1000 == pytest.approx(time.time(), abs=60)
    queue_s = int(inference["queue"]["ns"]) / 1e9
    histogram_queue_s = server.metric("mirrorserve_queue_duration_seconds_sum", model="spare")
    assert queue_s == pytest.approx(histogram_queue_s, abs=1e-6)
    request_s = sum(server.metric("mirrorserve_request_duration_seconds_sum", model="spare", method="ModelInfer",
                                  protocol=p) for p in ("v2", "v2-rest"))
    success_s = int(inference["success"]["ns"]) / 1e9
    assert queue_s <= success_s <= request_s + 1e-6
    clients["grpc"].unload_model("spare", headers=AUTH)


def test_repository_index_load_and_unload(server: ServerProcess, clients: dict[str, Any]) -> None:
    index = {(m["name"], m.get("version", "")): m for m in clients["http"].get_model_repository_index()}
    assert index["demo", "1"]["state"] == "READY"
    assert index["notamodel", ""]["state"] == "UNAVAILABLE"
    grpc_index = clients["grpc"].get_model_repository_index(as_json=True)["models"]
    assert {(m["name"], m.get("version", "")) for m in grpc_index} == set(index)
    ready = urllib.request.Request(f"{server.rest_url}/v2/repository/index", data=b'{"ready": true}', method="POST")
    with urllib.request.urlopen(ready, timeout=10) as response:
        assert {m["state"] for m in json.loads(response.read())} == {"READY"}

    clients["grpc"].load_model("echo", headers=AUTH)
    assert clients["http"].is_model_ready("echo")
    out = infer(clients["http"], "echo", np.array([[5, 6]], dtype=np.int64))
    assert out.as_numpy("y").tolist() == [[5, 6]]
    # Loaded with a config: its version policy and batching apply (to versions loaded from then on,
    # so here, unloaded first).
    clients["http"].unload_model("echo", headers=AUTH)
    clients["http"].load_model("echo", headers=AUTH, config='{"version_policy": {"all": {}}, "max_batch_size": 8}')
    config = clients["http"].get_model_config("echo")
    assert (config["version_policy"], config["max_batch_size"]) == ({"all": {}}, 8)
    clients["http"].unload_model("echo", headers=AUTH)
    assert not clients["grpc"].is_model_ready("echo")
    error = fails(lambda: infer(clients["grpc"], "echo", np.array([[1, 2]], dtype=np.int64)))
    assert error.status() == "StatusCode.NOT_FOUND" and "'echo'" in error.message()
    error = fails(lambda: infer(clients["http"], "echo", np.array([[1, 2]], dtype=np.int64)))
    assert error.status() == "404" and "'echo'" in error.message()
    after = {(m["name"], m.get("version", "")): m["state"] for m in clients["http"].get_model_repository_index()}
    assert after["echo", ""] == "UNAVAILABLE"  # back to a repository folder not loaded


def test_an_unloaded_model_answers_its_queued_requests_first(server: ServerProcess,
                                                             clients: dict[str, Any]) -> None:
    """A batch executing and a request queued behind it when the unload comes: both are answered,
    and the model is NOT_FOUND from then on."""
    clients["grpc"].load_model("slow", headers=AUTH)
    answers: dict[str, Any] = {}

    def ask(key: str, work: float) -> None:
        with tgrpc.InferenceServerClient(server.target) as client:
            answers[key] = infer(client, "slow", np.array([[work, 21.0]], np.float32)).as_numpy("y").tolist()

    held = threading.Thread(target=ask, args=("held", 15_000))
    held.start()
    wait_for(lambda: server.metric("mirrorserve_batches_in_flight", model="slow") >= 1, "the slow batch")
    queued = threading.Thread(target=ask, args=("queued", 0))
    queued.start()
    wait_for(lambda: server.metric("mirrorserve_queue_rows", model="slow") >= 1, "a queued row")
    clients["http"].unload_model("slow", headers=AUTH)  # returns once both are answered
    held.join()
    queued.join()
    assert answers == {"held": [42.0], "queued": [42.0]}
    error = fails(lambda: infer(clients["grpc"], "slow", np.array([[0, 1]], np.float32)))
    assert error.status() == "StatusCode.NOT_FOUND" and "'slow'" in error.message()


def wait_for(condition: Any, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.01)


def test_load_and_unload_under_load_fail_nothing(server: ServerProcess, clients: dict[str, Any]) -> None:
    """3 closed-loop clients on demo (TF Serving Predict, v2 gRPC, v2 REST) while echo is loaded
    and unloaded CYCLES times: no request fails, and memory stays flat."""
    stop = threading.Event()
    sent = [0, 0, 0]
    errors: list[str] = []
    row = np.linspace(0, 1, 8, dtype=np.float32)[None, :]

    def tfs_client() -> None:
        with grpc.insecure_channel(server.target) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            while not stop.is_set():
                try:
                    stub.Predict(build_predict_request("demo", {"x": row}), timeout=30)
                    sent[0] += 1
                except grpc.RpcError as exc:
                    errors.append(f"Predict: {exc.code()} {exc.details()}")

    def v2_client(slot: int, kind: str) -> None:
        client = tgrpc.InferenceServerClient(server.target) if kind == "grpc" else \
            thttp.InferenceServerClient(server.rest_url.removeprefix("http://"))
        while not stop.is_set():
            try:
                infer(client, "demo", row)
                sent[slot] += 1
            except InferenceServerException as exc:
                errors.append(f"{kind}: {exc}")
        client.close()

    threads = [threading.Thread(target=tfs_client), threading.Thread(target=v2_client, args=(1, "grpc")),
               threading.Thread(target=v2_client, args=(2, "http"))]
    worker = worker_of(server.process.pid)  # before the clients start: a failure here must not leave them running
    for thread in threads:
        thread.start()
    samples = []
    try:
        for cycle in range(CYCLES):
            client = clients["grpc" if cycle % 2 else "http"]
            client.load_model("echo", headers=AUTH)
            assert infer(client, "echo", np.array([[cycle, 1]], dtype=np.int64)).as_numpy("y")[0, 0] == cycle
            client.unload_model("echo", headers=AUTH)
            samples.append(rss_mib(server.process.pid) + rss_mib(worker))
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    print(f"requests on demo: {sent}; RSS of server + worker per cycle (MiB): {[round(s) for s in samples]}")
    assert errors == []
    assert min(sent) > 0
    warm = samples[min(2, len(samples) - 1)]
    assert samples[-1] - warm <= 40.0, samples  # the bound of the lifecycle test's 17 cycles


def test_bad_repository_calls_get_clear_errors(server: ServerProcess, clients: dict[str, Any]) -> None:
    g, h = clients["grpc"], clients["http"]
    cases = [
        (lambda c: c.load_model("nope", headers=AUTH), "NOT_FOUND", "404", "not in the model repository"),
        (lambda c: c.load_model("notamodel", headers=AUTH), "FAILED_PRECONDITION", "400",
         "no version folder"),
        (lambda c: c.load_model("corrupt", headers=AUTH), "FAILED_PRECONDITION", "400", "failed to load"),
        (lambda c: c.load_model("escape", headers=AUTH), "INVALID_ARGUMENT", "400", "not inside a model root"),
        (lambda c: c.load_model("a\\b", headers=AUTH), "INVALID_ARGUMENT", "400", "not a folder name"),
        (lambda c: c.load_model("echo", headers=AUTH, config="{not json"), "INVALID_ARGUMENT", "400",
         "parameter 'config' is not a model configuration"),
        (lambda c: c.load_model("echo", headers=AUTH, config='{"max_batch_size": 8, '
                                '"dynamic_batching": {"preferred_batch_size": [4, 16]}}'),
         "INVALID_ARGUMENT", "400", "max_batch_size"),
        (lambda c: c.load_model("echo", headers=AUTH, config='{"name": "other"}'), "INVALID_ARGUMENT", "400",
         "names model 'other'"),
        (lambda c: c.load_model("echo"), "UNAUTHENTICATED", "401", "authorization"),
        (lambda c: c.load_model("echo", headers={"authorization": "Bearer wrong"}), "UNAUTHENTICATED", "401",
         "token"),
        (lambda c: c.unload_model("echo", headers=AUTH), "NOT_FOUND", "404", "is not loaded"),
        (lambda c: c.get_model_config("nope"), "NOT_FOUND", "404", "'nope'"),
        (lambda c: c.get_model_config("demo", model_version="x1"), "INVALID_ARGUMENT", "400",
         "not a version number"),
        (lambda c: c.get_inference_statistics("demo", model_version="7"), "NOT_FOUND", "404",
         "version 7 is not loaded"),
        (lambda c: c.get_inference_statistics("nope"), "NOT_FOUND", "404", "'nope'"),
    ]
    for call, grpc_code, http_status, text in cases:
        for client, expected in ((g, f"StatusCode.{grpc_code}"), (h, http_status)):
            error = fails(lambda: call(client))  # noqa: B023
            assert error.status() == expected and text in error.message(), (expected, error)
    index = {(m["name"], m.get("version", "")): m["state"] for m in h.get_model_repository_index()}
    assert ("notamodel", "") in index and ("corrupt", "1") not in index  # failed loads were undone
    # A body not JSON, straight over HTTP; and one declared too large, refused before it is sent.
    for body, status in ((b"[1, 2]", 400), (b"{" * 100_000, 400)):
        request = urllib.request.Request(f"{server.rest_url}/v2/repository/models/echo/load", data=body,
                                         headers={"Authorization": f"Bearer {TOKEN}"}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
        assert caught.value.code == status, body[:20]
    connection = http.client.HTTPConnection("127.0.0.1", server.rest_port, timeout=10)
    connection.putrequest("POST", "/v2/repository/models/echo/load")
    connection.putheader("Authorization", f"Bearer {TOKEN}")
    connection.putheader("Content-Length", str((1 << 20) + 1))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and b"a control call's body" in response.read()
    connection.close()
    assert infer(g, "demo", np.zeros((1, 8), np.float32)).as_numpy("probabilities").shape == (1, 3)


def test_each_request_gets_its_own_timing(server: ServerProcess, clients: dict[str, Any]) -> None:
    """Queue, compute and total of a request add up to no more than what its client measured."""
    row = np.zeros((1, 8), np.float32)
    with grpc.insecure_channel(server.target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        started = time.perf_counter()
        _, call = stub.Predict.with_call(build_predict_request("demo", {"x": row}), timeout=10)
        client_s = time.perf_counter() - started
    trailers = dict(call.trailing_metadata())
    queue, compute, total = (float(trailers[f"mirrorserve-{k}-seconds"]) for k in ("queue", "compute", "server"))
    assert queue >= 0 and compute > 0 and queue + compute <= total <= client_s

    started = time.perf_counter()
    result = infer(clients["grpc"], "demo", row)
    client_s = time.perf_counter() - started
    parameters = result.get_response().parameters
    assert parameters["compute_ns"].int64_param > 0
    assert (parameters["queue_ns"].int64_param + parameters["compute_ns"].int64_param) / 1e9 <= client_s

    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 8], "data": [0,0,0,0,0,0,0,0]}]}'
    for url, data in ((f"{server.rest_url}/v2/models/demo/infer", body),
                      (f"{server.rest_url}/v1/models/demo:predict", b'{"instances": [[0,0,0,0,0,0,0,0]]}')):
        started = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST"), timeout=10) as response:
            response.read()
            header = response.headers["Server-Timing"]
        client_s = time.perf_counter() - started
        figures = dict(part.strip().split(";dur=") for part in header.split(","))
        assert set(figures) == {"queue", "compute", "total"}, header
        assert float(figures["queue"]) + float(figures["compute"]) <= float(figures["total"]) <= client_s * 1e3


def perf_analyzer() -> str:
    path = os.environ.get("PERF_ANALYZER") or str(Path(__file__).parents[2] / ".venv/perf_analyzer/perf_analyzer")
    if not Path(path).is_file():
        pytest.fail(f"perf_analyzer not installed at {path}; run `make test`", pytrace=False)
    return path


@pytest.mark.parametrize("mode", ["triton-grpc", "triton-http", "tfserving"])
def test_perf_analyzer_runs_against_the_server(server: ServerProcess, mode: str) -> None:
    common = ["-m", "demo", "--concurrency-range", "2", "--measurement-interval", "1000",
              "--stability-percentage", "90", "--max-trials", "3"]
    if mode == "tfserving":
        args = ["--service-kind", "tfserving", "-i", "grpc", "-u", server.target, "--shape", "x:1,8"]
    else:
        protocol = mode.split("-")[1]
        url = server.target if protocol == "grpc" else server.rest_url.removeprefix("http://")
        args = ["-i", protocol, "-u", url, "-b", "1", "--shape", "x:8"]
    run = subprocess.run([perf_analyzer(), *common, *args], capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "Throughput:" in output
    if mode != "tfserving":  # the server side, from ModelStatistics
        assert "Server:" in output and "queue" in output and "compute infer" in output, output[-2000:]
