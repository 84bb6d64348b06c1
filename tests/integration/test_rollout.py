"""Rolling versions in under load on every protocol at once, with zero failed requests: gRPC
Predict, TF Serving REST :predict with bodies big enough to be decoded in the helper process,
v2 REST infer with such bodies too, and gRPC Classify with enough examples that their checks run
in the helper. Those paths await between resolving a version and queueing on it; a request that
resolved to a version keeps it until answered (the version is unloaded only when none holds it).
Every answer says the version that computed it, and it must be the version the response names."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from client.api import build_predict_request, decode_outputs
from protos.tensorflow_serving import classification_pb2, prediction_service_pb2_grpc
from tests.integration.conftest import ServerProcess, start_server
from tests.integration.saved_models import Rolling

VERSIONS = 4
ROWS = 64
"""Rows of a REST body: 64 x 512 floats is about 400 KB of JSON, over the helper's 256 KB."""
EXAMPLES = 2100
"""Examples of a Classify call: over 2,000 examples x features, its checks run in the helper."""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integration.saved_models import build_rolling

    root = tmp_path_factory.mktemp("rolling-built")
    for version in range(1, VERSIONS + 1):
        build_rolling(root / str(version), version)
    return root


class Protocol:
    """One closed-loop client: sends until stopped, records the version of each answer."""

    def __init__(self, name: str, send: Callable[[], tuple[int, int]]) -> None:
        self.name = name
        self.send = send
        self.versions: list[int] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                named, computed = self.send()
            except Exception as exc:  # every failure is the test's business
                self.failures.append(f"{self.name}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            if named != computed:
                self.failures.append(f"{self.name}: the response names version {named}, version {computed} computed it")
            self.versions.append(computed)


def clients(server: ServerProcess) -> list[Protocol]:
    channel = grpc.insecure_channel(server.target)
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    rows = np.round(np.random.default_rng(0).random((ROWS, Rolling.FEATURES)), 6).astype(np.float32)
    predict = build_predict_request("rolling", {"x": rows[:2]})
    classify = classification_pb2.ClassificationRequest()
    classify.model_spec.name = "rolling"
    classify.model_spec.signature_name = "classify"
    for i in range(EXAMPLES):
        classify.input.example_list.examples.add().features.feature["x"].float_list.value.append(float(i))
    rest_body = json.dumps({"instances": rows.tolist()}).encode()
    v2_body = json.dumps({"inputs": [{"name": "x", "shape": list(rows.shape), "datatype": "FP32",
                                      "data": rows.ravel().tolist()}]}).encode()
    assert len(rest_body) > 256 * 1024 and len(v2_body) > 256 * 1024

    def grpc_predict() -> tuple[int, int]:
        response = stub.Predict(predict, timeout=30)
        return response.model_spec.version.value, int(decode_outputs(response)["version"][0])

    def grpc_classify() -> tuple[int, int]:
        response = stub.Classify(classify, timeout=60)
        last = response.result.classifications[-1].classes
        assert last[0].score == EXAMPLES - 1
        return response.model_spec.version.value, int(last[1].score)

    def post(path: str, body: bytes) -> dict[str, object]:
        request = urllib.request.Request(f"{server.rest_url}{path}", data=body, method="POST",
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                return dict(json.loads(answer.read()))
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"HTTP {error.code}: {error.read()[:300]!r}") from None

    def rest_predict() -> tuple[int, int]:
        # TF Serving's REST answer names no version: one version must have computed all its rows.
        predictions = post("/v1/models/rolling:predict", rest_body)["predictions"]
        assert isinstance(predictions, list) and len(predictions) == ROWS
        versions = {int(p["version"]) for p in predictions}
        assert len(versions) == 1, versions
        version = versions.pop()
        return version, version

    def v2_rest() -> tuple[int, int]:
        answer = post("/v2/models/rolling/infer", v2_body)
        outputs = {o["name"]: o for o in answer["outputs"]}  # type: ignore[union-attr]
        computed = set(outputs["version"]["data"])
        assert len(computed) == 1, computed
        return int(answer["model_version"]), int(computed.pop())  # type: ignore[arg-type]

    return [Protocol("gRPC Predict", grpc_predict), Protocol("gRPC Classify", grpc_classify),
            Protocol("REST :predict", rest_predict), Protocol("v2 REST infer", v2_rest)]


@pytest.mark.parametrize("frontends", [1, 4])
def test_versions_roll_in_under_load_on_every_protocol_with_zero_failures(built: Path, tmp_path: Path,
                                                                          frontends: int) -> None:
    base = tmp_path / "rolling"
    base.mkdir()
    shutil.copytree(built / "1", base / "1")
    server = start_server(["--model-base-path", str(base), "--model-name", "rolling", "--file-system-poll-wait-seconds",
                           "0.2", "--drain-delay-s", "0", "--frontends", str(frontends)], tmp_path / "server.log")
    running: list[Protocol] = []
    try:
        running = clients(server)
        for client in running:
            client.thread.start()
        for version in range(2, VERSIONS + 1):
            counts = [len(c.versions) for c in running]
            shutil.copytree(built / str(version), base / f".{version}")
            os.rename(base / f".{version}", base / str(version))
            deadline = time.monotonic() + 60
            while not all(c.versions[count:] and c.versions[-1] == version for c, count in zip(
                    running, counts, strict=True)) and time.monotonic() < deadline:
                time.sleep(0.05)
            shutil.rmtree(base / str(version - 1))  # retires the old one (the policy serves the latest anyway)
        time.sleep(0.5)
    finally:
        for client in running:
            client.stop.set()
        for client in running:
            client.thread.join(120)
        log = server.log()
        server.stop()
    failures = [f for c in running for f in c.failures]
    summary = {c.name: {v: c.versions.count(v) for v in sorted(set(c.versions))} for c in running}
    print(f"answers by protocol and version: {summary}")
    assert not failures, failures[:10]
    for client in running:
        assert client.versions[-1] == VERSIONS and set(range(2, VERSIONS + 1)) <= set(client.versions), summary
        if frontends == 1:  # one closed loop: each answer from the same version as the last, or a newer one
            assert client.versions == sorted(client.versions), summary
        # With several front-ends, each switches when it applies the view: a client whose calls
        # reach different front-ends may meet the old version once more in that moment, never a
        # failure.
    assert log.count("unloaded model=rolling") == VERSIONS - 1, log[-3000:]
