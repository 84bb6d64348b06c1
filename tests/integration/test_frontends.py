"""Several front-end processes (--frontends N) on the same ports, feeding one model worker: every
front-end answers, exactly; /metrics counts every process's requests; a killed front-end is
restarted while the others' clients see nothing; SIGTERM drains them all."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.mmap_dict import MmapedDict

from protos.tensorflow_serving import predict_pb2, prediction_service_pb2_grpc
from server.api.tensor_codec import fill_tensor_proto
from tests.integration.conftest import ServerProcess, start_server

pytestmark = pytest.mark.timeout(300)


def listeners(port: int) -> set[int]:
    """The processes listening on a TCP port."""
    shown = subprocess.run(["ss", "-Htlnp", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return {int(pid) for pid in re.findall(r"pid=(\d+)", shown)}


def connection_owner(port: int, client_ports: set[int]) -> dict[int, int]:
    """Server-side owner (pid) of each established connection to `port`, by the client's port."""
    shown = subprocess.run(["ss", "-Htnp", "state", "established", f"sport = :{port}"], capture_output=True,
                           text=True, check=True).stdout
    owners = {}
    for line in shown.splitlines():
        peer = re.search(r"\s\S+:(\d+)\s+users:", line)
        pid = re.search(r"pid=(\d+)", line)
        if peer and pid and int(peer.group(1)) not in client_ports:
            owners[int(peer.group(1))] = int(pid.group(1))
    return owners


def predict_request(rows: np.ndarray) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    fill_tensor_proto(request.inputs["x"], rows)
    return request


def own_channel(server: ServerProcess) -> grpc.Channel:
    """A channel with a connection of its own (grpc otherwise shares one between channels)."""
    return grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])


def requests_by_process(folder: Path) -> dict[int, float]:
    """mirrorserve_requests_total of each process, from its prometheus_client multiprocess file."""
    found = {}
    for path in folder.glob("counter_*.db"):
        pid = int(path.stem.split("_")[-1])
        found[pid] = sum(value for key, value, *_ in MmapedDict.read_all_values_from_file(str(path))
                         if json.loads(key)[1] == "mirrorserve_requests_total")
    return found


@pytest.fixture(scope="module")
def demo_model(model_dirs: dict[str, Path]) -> Any:
    import tensorflow as tf

    return tf.saved_model.load(str(model_dirs["demo"] / "1")).signatures["serving_default"]


def test_two_front_ends_share_both_ports_answer_exactly_and_metrics_count_every_request(
        model_dirs: dict[str, Path], demo_model: Any, tmp_path: Path) -> None:
    folder = tmp_path / "metrics"
    server = start_server(["--model-base-path", str(model_dirs["demo"]), "--model-name", "demo", "--frontends", "2",
                           "--max-batch-size", "64", "--drain-delay-s", "0"], tmp_path / "server.log",
                          env={"PROMETHEUS_MULTIPROC_DIR": str(folder)})
    try:
        assert len(listeners(server.port)) == 2 and listeners(server.port) == listeners(server.rest_port)
        rng = np.random.default_rng(0)
        sizes = [1, 2, 7, 63, 64, 65, 129, 300] * 3
        channels = [own_channel(server) for _ in range(8)]
        stubs = [prediction_service_pb2_grpc.PredictionServiceStub(c) for c in channels]
        inputs = [rng.standard_normal((n, 8)).astype(np.float32) for n in sizes]
        futures = [stubs[i % len(stubs)].Predict.future(predict_request(x), timeout=60) for i, x in enumerate(inputs)]
        rest_inputs = [rng.standard_normal((n, 8)).astype(np.float32) for n in (1, 5, 70) * 4]
        for x in rest_inputs:  # urllib: a connection per request, spread like any other
            body = json.dumps({"instances": x.tolist()}).encode()
            with urllib.request.urlopen(urllib.request.Request(f"{server.rest_url}/v1/models/demo:predict",
                                                               data=body), timeout=60) as answer:
                got = np.array([p["probabilities"] for p in json.loads(answer.read())["predictions"]])
            np.testing.assert_allclose(got, demo_model(x=x)["probabilities"].numpy(), rtol=1e-5, atol=1e-6)
        for x, future in zip(inputs, futures, strict=True):
            response = future.result()
            probabilities = np.array(response.outputs["probabilities"].float_val, np.float32).reshape(len(x), -1)
            expected = demo_model(x=x)
            np.testing.assert_allclose(probabilities, expected["probabilities"].numpy(), rtol=1e-5, atol=1e-6)
            assert list(response.outputs["class_id"].int64_val) == expected["class_id"].numpy().tolist()
        for channel in channels:
            channel.close()
        sent = len(inputs) + len(rest_inputs)
        page = server.metrics_text()
        counted = sum(float(v) for v in re.findall(r'^mirrorserve_requests_total\{[^}]*code="OK"[^}]*method="Predict"'
                                                    r'[^}]*\} (\S+)', page, re.M))
        counted += sum(float(v) for v in re.findall(r'^mirrorserve_requests_total\{[^}]*code="OK"[^}]*method="predict"'
                                                     r'[^}]*\} (\S+)', page, re.M))
        assert counted == sent, page
        by_process = requests_by_process(folder)
        assert set(by_process) == listeners(server.port)
        assert all(count > 0 for count in by_process.values()), by_process  # both front-ends answered
        rows = server.metric("mirrorserve_batch_rows_sum", model="demo", version="1")
        replica_rows = server.metric("mirrorserve_replica_rows_total", model="demo", version="1", replica="0")
        assert rows == replica_rows >= sum(sizes) + sum(len(x) for x in rest_inputs)
    finally:
        assert server.stop() == 0


def test_a_killed_front_end_is_restarted_and_the_other_front_ends_clients_see_no_failure(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    server = start_server(["--model-base-path", str(model_dirs["demo"]), "--model-name", "demo", "--frontends", "2",
                           "--drain-delay-s", "0"], tmp_path / "server.log")
    stop = threading.Event()
    failures: dict[int, list[str]] = {}
    answered: Counter[int] = Counter()
    try:
        primary = server.process.pid
        channels, owners = [], {}
        known: set[int] = set()
        for i in range(12):  # a connection each, and which process holds it
            channel = own_channel(server)
            prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                predict_request(np.ones((1, 8), np.float32)), timeout=30)
            new = connection_owner(server.port, known)
            assert len(new) == 1, new
            (client_port, pid), = new.items()
            known.add(client_port)
            channels.append(channel)
            owners[i] = pid
        victims = {i for i, pid in owners.items() if pid != primary}
        assert victims and len(victims) < len(owners), owners  # connections on both front-ends
        victim = owners[min(victims)]

        def call(i: int) -> None:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channels[i])
            failures[i] = []
            while not stop.is_set():
                try:
                    stub.Predict(predict_request(np.ones((3, 8), np.float32)), timeout=10)
                    answered[i] += 1
                except grpc.RpcError as error:
                    failures[i].append(f"{error.code()}: {error.details()}")
                    time.sleep(0.05)

        threads = [threading.Thread(target=call, args=(i,)) for i in owners]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        subprocess.run(["kill", "-9", str(victim)], check=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (victim in listeners(server.port) or len(listeners(server.port)) < 2):
            time.sleep(0.1)
        assert len(listeners(server.port)) == 2 and victim not in listeners(server.port)
        before = Counter(answered)
        time.sleep(2.0)
        stop.set()
        for thread in threads:
            thread.join(30)
        for i in owners:
            if i in victims:  # its clients reconnect, to either front-end, and are answered again
                assert answered[i] > before[i], (i, failures[i][-3:])
            else:
                assert not failures[i], (i, failures[i][:3])
        for channel in channels:
            channel.close()
        assert "front-end 1 is gone" in server.log()
    finally:
        stop.set()
        assert server.stop() == 0


def test_sigterm_drains_every_front_end_under_load_and_exits_0(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    server = start_server(["--model-base-path", str(model_dirs["demo"]), "--model-name", "demo", "--frontends", "2",
                           "--drain-delay-s", "1", "--grace-period-s", "20"], tmp_path / "server.log")
    stop = threading.Event()
    codes: Counter[str] = Counter()
    lock = threading.Lock()

    def call() -> None:
        channel = own_channel(server)
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        while not stop.is_set():
            try:
                stub.Predict(predict_request(np.ones((4, 8), np.float32)), timeout=10)
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
                if code != "OK":
                    time.sleep(0.02)
            with lock:
                codes[code] += 1
        channel.close()

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    server.process.send_signal(signal.SIGTERM)
    code = server.stop(timeout=30)
    stop.set()
    for thread in threads:
        thread.join(30)
    log = server.log()
    assert code == 0, log[-3000:]
    assert codes["OK"] > 50
    # Refused once draining (UNAVAILABLE, or a connection refused after exit), or cancelled by grpc
    # itself in transit as it closes (at most one per connection, as with one front-end: test_drain).
    assert set(codes) <= {"OK", "UNAVAILABLE", "CANCELLED"} and codes["CANCELLED"] <= len(threads), codes
    drained = re.findall(r"drained: accepted=(\d+) answered=(\d+)", log)
    assert len(drained) == 2, log[-3000:]  # the primary and front-end 1
    accepted, answered = (sum(int(d[i]) for d in drained) for i in (0, 1))
    assert accepted == answered == codes["OK"], (drained, codes)


def test_a_control_call_on_any_front_end_is_applied_once_and_routed_by_all_when_it_returns(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Over v2 REST (our v2 protos cannot share the test process with tritonclient's), on kept-alive
    connections whose owning process is known."""
    repository = tmp_path / "models"
    for name in ("demo", "echo"):
        shutil.copytree(model_dirs[name], repository / name)
    (tmp_path / "tokens").write_text("tester secret\n")
    server = start_server(["--model-repository", str(repository), "--model-control-mode", "explicit",
                           "--load-model", "demo", "--enable-model-management", "--admin-token-file",
                           str(tmp_path / "tokens"), "--frontends", "2", "--drain-delay-s", "0",
                           "--file-system-poll-wait-seconds", "0"], tmp_path / "server.log")
    auth = {"Authorization": "Bearer secret", "Content-Type": "application/json"}
    connections: list[http.client.HTTPConnection] = []
    try:
        primary = server.process.pid
        by_owner: dict[bool, http.client.HTTPConnection] = {}  # by whether the primary holds it
        known: set[int] = set()
        for _ in range(24):
            connection = http.client.HTTPConnection("127.0.0.1", server.rest_port, timeout=120)
            connections.append(connection)
            connection.request("GET", "/v2/health/live")
            connection.getresponse().read()
            (client_port, pid), = connection_owner(server.rest_port, known).items()
            known.add(client_port)
            by_owner.setdefault(pid == primary, connection)
            if len(by_owner) == 2:
                break
        assert len(by_owner) == 2, "no connection reached the second front-end"

        def call(connection: http.client.HTTPConnection, method: str, path: str,
                 body: object = None) -> tuple[int, Any]:
            connection.request(method, path, body=None if body is None else json.dumps(body), headers=auth)
            answer = connection.getresponse()
            data = answer.read()
            return answer.status, json.loads(data) if data else None

        def ready(connection: http.client.HTTPConnection) -> bool:
            return call(connection, "GET", "/v2/models/echo/ready")[0] == 200

        def echo(connection: http.client.HTTPConnection, value: int) -> int:
            status, answer = call(connection, "POST", "/v2/models/echo/infer", {"inputs": [
                {"name": "x", "datatype": "INT64", "shape": [1, 2], "data": [value, 1]}]})
            assert status == 200, answer
            return int(answer["outputs"][0]["data"][0])

        every = list(by_owner.values())
        for via in (by_owner[False], by_owner[True]):  # through the other front-end, then the primary
            assert not any(ready(c) for c in every)
            status, answer = call(via, "POST", "/v2/repository/models/echo/load", {})
            assert status == 200, answer
            for connection in every:  # routed by every front-end once the call returns
                assert ready(connection) and echo(connection, 7) == 7
            status, answer = call(via, "POST", "/v2/repository/models/echo/unload", {})
            assert status == 200, answer
            assert not any(ready(c) for c in every)
        log = server.log()
        assert log.count(": loading model=echo") == 2 and log.count(": unloaded model=echo") == 2, log[-3000:]
    finally:
        for connection in connections:
            connection.close()
        assert server.stop() == 0
