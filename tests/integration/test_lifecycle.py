"""Model lifecycle on one real server: several models and versions from one config file, versions
rolled in and out live under load, config changes by file and by HandleReloadConfigRequest, a
corrupt version, and memory over many load/unload cycles.

The tests share one server process and run in order (each leaves the config the next expects).
Every model is of the `tagged` family, which answers with its own version number, so each
response shows which version computed it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import text_format

from client.api import build_predict_request, decode_outputs
from protos.tensorflow_serving import (
    get_model_status_pb2,
    model_management_pb2,
    model_server_config_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)
from tests.integration.conftest import ServerProcess, start_server
from tests.integration.test_model_worker import worker_of
from tests.integration.test_official_client import HERE, official_client_path

POLL_S = 0.25
SLOW_QUEUE_ROWS = 256
"""--max-queued-rows, per version: small, so the overload test fills the slow model's queue."""
CONFIG_POLL_S = 0.5
AVAILABLE, END = 30, 50
DATA_LOSS = 15


def config_text(models: dict[str, tuple[Path, str]]) -> str:
    """A ModelServerConfig: name -> (base path, extra fields of its config block)."""
    blocks = "".join(
        f'  config {{\n    name: "{name}"\n    base_path: "{base}"\n'
        f'    model_platform: "tensorflow"\n    {extra}\n  }}\n'
        for name, (base, extra) in models.items())
    return "model_config_list {\n" + blocks + "}\n"


@dataclass
class Family:
    """Built versions of the tagged model, copied into base paths as a deploy would."""

    built: Path
    root: Path

    def version(self, version: int) -> Path:
        source = self.built / str(version)
        if not source.exists():
            from tests.integration.saved_models import build_tagged

            build_tagged(source, version)
        return source

    def deploy(self, model: str, version: int, built: int | None = None) -> Path:
        """Copy under a dot-name, then rename: the version appears whole or not at all. `built`:
        copy that built version's files instead (faster; its outputs then say that version)."""
        base = self.root / model
        base.mkdir(exist_ok=True)
        hidden = base / f".{version}"
        shutil.copytree(self.version(version if built is None else built), hidden)
        os.rename(hidden, base / str(version))
        return base


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(tmp_path_factory.mktemp("tagged-built"), tmp_path_factory.mktemp("tagged-models"))


ADMIN_TOKEN = "lifecycle-admin-token"
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
"""What HandleReloadConfigRequest calls carry (model management is on, with a token file)."""
LABELS = 'version_labels { key: "stable" value: 2 } version_labels { key: "canary" value: 3 }'
START_MODELS = {
    "alpha": ([1, 2, 3], "model_version_policy { latest { num_versions: 2 } } " + LABELS),
    "beta": ([1, 2, 3], 'model_version_policy { specific { versions: 1 versions: 3 } } '
                        'version_labels { key: "stable" value: 1 }'),
    "gamma": ([1, 2], "model_version_policy { all {} }"),
    "roll": ([1], ""),
}


@dataclass
class Lifecycle:
    server: ServerProcess
    family: Family
    config_path: Path
    channel: grpc.Channel
    start_models: dict[str, tuple[Path, str]]
    predict: Callable[..., predict_pb2.PredictResponse] = field(init=False)
    models: model_service_pb2_grpc.ModelServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.predict = prediction_service_pb2_grpc.PredictionServiceStub(self.channel).Predict
        self.models = model_service_pb2_grpc.ModelServiceStub(self.channel)

    def status(self, model: str) -> dict[int, tuple[int, int, str]]:
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = model
        response = self.models.GetModelStatus(request, timeout=10)
        return {s.version: (s.state, s.status.error_code, s.status.error_message)
                for s in response.model_version_status}

    def states(self, model: str) -> dict[int, int]:
        return {v: s[0] for v, s in self.status(model).items()}

    def served(self, model: str, version: int | None = None, label: str | None = None) -> tuple[int, int]:
        """(model_spec.version of the response, the version its outputs say)."""
        response = self.predict(request(model, version, label), timeout=10)
        return response.model_spec.version.value, int(decode_outputs(response)["version"][0])


def request(model: str, version: int | None = None, label: str | None = None,
            rows: int = 2) -> predict_pb2.PredictRequest:
    req = build_predict_request(model, {"x": np.ones((rows, 2), np.float32)})
    if version is not None:
        req.model_spec.version.value = version
    if label is not None:
        req.model_spec.version_label = label
    return req


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if condition():
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def start_models(family: Family, model_dirs: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    """The start-up config: the tagged models, and `slow` (for overload isolation)."""
    models = {m: (family.root / m, extra) for m, (_, extra) in START_MODELS.items()}
    models["slow"] = (model_dirs["slow"], "")
    return models


@pytest.fixture(scope="module")
def life(family: Family, model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lifecycle]:
    for model, (versions, _) in START_MODELS.items():
        for version in versions:
            family.deploy(model, version)
    config_path = family.root / "models.config"
    config_path.write_text(config_text(start_models(family, model_dirs)))
    folder = tmp_path_factory.mktemp("lifecycle")
    tokens = folder / "tokens"
    tokens.write_text(f"lifecycle-tests {ADMIN_TOKEN}\n")
    server = start_server(["--model-config-file", str(config_path), "--file-system-poll-wait-seconds", str(POLL_S),
                           "--model-config-file-poll-wait-seconds", str(CONFIG_POLL_S), "--drain-delay-s", "0",
                           "--max-queued-rows", str(SLOW_QUEUE_ROWS), "--enable-model-management",
                           "--admin-token-file", str(tokens)], folder / "server.log")
    channel = grpc.insecure_channel(server.target)
    try:
        yield Lifecycle(server, family, config_path, channel, start_models(family, model_dirs))
    finally:
        channel.close()
        assert server.stop() == 0, server.log()[-3000:]


class Traffic:
    """Closed-loop clients calling Predict on some models (no version named) until stopped;
    every answer is checked: its model_spec.version must be the version its outputs carry."""

    def __init__(self, target: str, models: list[str], clients_per_model: int = 3) -> None:
        self.ok: dict[str, list[int]] = {m: [] for m in models}
        self.failures: list[str] = []
        self.mismatches: list[tuple[int, int]] = []
        self._stop = {m: threading.Event() for m in models}
        self._channel = grpc.insecure_channel(target)
        stub = prediction_service_pb2_grpc.PredictionServiceStub(self._channel)
        self._threads = {m: [threading.Thread(target=self._run, args=(stub, m), daemon=True)
                             for _ in range(clients_per_model)] for m in models}

    def __enter__(self) -> Traffic:
        for threads in self._threads.values():
            for thread in threads:
                thread.start()
        return self

    def stop(self, model: str) -> None:
        """Stop one model's clients (before a change that removes it)."""
        self._stop[model].set()
        for thread in self._threads[model]:
            thread.join(60)

    def _run(self, stub: prediction_service_pb2_grpc.PredictionServiceStub, model: str) -> None:
        req = request(model)
        while not self._stop[model].is_set():
            try:
                response = stub.Predict(req, timeout=30)
            except grpc.RpcError as exc:
                self.failures.append(f"{model}: {exc.code().name} {exc.details()}")
                continue
            outputs = decode_outputs(response)
            served, says = response.model_spec.version.value, int(outputs["version"][0])
            if served != says or outputs["y"][0, 0] != 1.0 + says:
                self.mismatches.append((served, says))
            self.ok[model].append(served)

    def latest(self, model: str) -> int:
        return self.ok[model][-1] if self.ok[model] else -1

    def __exit__(self, *_: object) -> None:
        for model in self._threads:
            self.stop(model)
        self._channel.close()

    def check(self) -> int:
        assert not self.failures, self.failures[:5]
        assert not self.mismatches, self.mismatches[:5]
        answered = sum(len(v) for v in self.ok.values())
        assert answered > 0
        return answered


def test_three_policies_from_one_config_file_by_number_and_label(life: Lifecycle) -> None:
    assert life.states("alpha") == {2: AVAILABLE, 3: AVAILABLE}  # latest 2 of 1,2,3
    assert life.states("beta") == {1: AVAILABLE, 3: AVAILABLE}  # specific 1 and 3
    assert life.states("gamma") == {1: AVAILABLE, 2: AVAILABLE}  # all
    expected = {("alpha", None, None): 3, ("alpha", 2, None): 2, ("alpha", None, "stable"): 2,
                ("alpha", None, "canary"): 3, ("beta", None, None): 3, ("beta", 1, None): 1,
                ("beta", None, "stable"): 1, ("gamma", None, None): 2, ("gamma", 1, None): 1}
    for (model, version, label), want in expected.items():
        assert life.served(model, version, label) == (want, want), (model, version, label)
    for model, version, label, fragment in [
        ("alpha", 1, None, "model 'alpha' version 1 not found; available versions: 2, 3"),
        ("beta", 2, None, "model 'beta' version 2 not found; available versions: 1, 3"),
        ("beta", None, "canary", "version label 'canary' of model 'beta' not found; labels: stable=1"),
        ("delta", None, None, "model 'delta' not found; models served: alpha, beta, gamma, roll, slow"),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            life.served(model, version, label)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert fragment in caught.value.details()
    assert life.server.metric("mirrorserve_model_ready", model="alpha", version="3") == 1
    assert life.server.metric("mirrorserve_model_ready", model="alpha", version="1") == 0


def test_the_official_client_reads_status_and_picks_versions_by_number_and_label(life: Lifecycle) -> None:
    env = {**os.environ, "PYTHONPATH": official_client_path(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, str(HERE / "official_model_client.py"), life.server.target, "alpha", "2",
                           "canary"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["module"].startswith(official_client_path()), report["module"]
    assert report["states"] == {"2": ["AVAILABLE", 0], "3": ["AVAILABLE", 0]}
    assert report["answers"] == {"default": [3, 3], "version": [2, 2], "label": [3, 3]}


def test_model_service_bad_requests_get_named_errors(life: Lifecycle) -> None:
    def raw(method: str, payload: bytes) -> grpc.RpcError:
        call = life.channel.unary_unary(f"/tensorflow.serving.ModelService/{method}")
        with pytest.raises(grpc.RpcError) as caught:
            call(payload, timeout=10, metadata=ADMIN)
        return caught.value

    for method in ("GetModelStatus", "HandleReloadConfigRequest"):
        error = raw(method, b"\xff\xfe not a proto")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "is not a valid" in error.details()
    for spec, code, fragment in [
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "model_spec.name is empty"),
        ({"name": "nope"}, grpc.StatusCode.NOT_FOUND, "model 'nope' not found; models served: alpha"),
        ({"name": "alpha", "version": 9}, grpc.StatusCode.NOT_FOUND, "model 'alpha' version 9 not found"),
        ({"name": "alpha", "label": "beta"}, grpc.StatusCode.NOT_FOUND, "labels: canary=3, stable=2"),
    ]:
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = spec.get("name", "")
        if "version" in spec:
            request.model_spec.version.value = spec["version"]
        if "label" in spec:
            request.model_spec.version_label = spec["label"]
        error = raw("GetModelStatus", request.SerializeToString())
        assert error.code() == code and fragment in error.details(), error.details()
    assert life.served("alpha") == (3, 3)


def test_one_models_overload_does_not_hold_up_another(life: Lifecycle) -> None:
    """Each version has its own batcher and queue bound; the shared worker runs at most
    --max-inflight-batches of a version's batches at once, so a request to another model waits
    for those at most, never for the overloaded model's queue."""
    slow_request = build_predict_request("slow", {"x": np.tile(np.float32([[4000, 1]]), (64, 1))})
    slow_codes: list[str] = []
    slow_ok_seconds: list[float] = []
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                life.predict(slow_request, timeout=60)
                slow_ok_seconds.append(time.perf_counter() - started)
                slow_codes.append("OK")
            except grpc.RpcError as exc:
                slow_codes.append(exc.code().name)
                time.sleep(0.005)

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(12)]
    for thread in flooders:
        thread.start()
    try:
        wait_until(lambda: "UNAVAILABLE" in slow_codes and len(slow_ok_seconds) >= 3, timeout=60,
                   what="the slow model to shed load")
        alpha_seconds = []
        for _ in range(30):
            started = time.perf_counter()
            assert life.served("alpha") == (3, 3)
            alpha_seconds.append(time.perf_counter() - started)
    finally:
        stop.set()
        for thread in flooders:
            thread.join(60)
    alpha_p50, slow_p50 = float(np.median(alpha_seconds)), float(np.median(slow_ok_seconds))
    print(f"overload: slow answered {len(slow_ok_seconds)} (p50 {slow_p50 * 1e3:.0f} ms), refused "
          f"{slow_codes.count('UNAVAILABLE')}; alpha meanwhile p50 {alpha_p50 * 1e3:.0f} ms")
    assert set(slow_codes) <= {"OK", "UNAVAILABLE"}  # a full queue answers UNAVAILABLE, as TF Serving
    # A request waiting in the slow model's full queue takes several of its batches; alpha waits
    # for at most the two running ones.
    assert alpha_p50 < 0.5 * slow_p50, (alpha_seconds, slow_ok_seconds)


def test_a_new_version_rolls_in_under_load_with_zero_failures(life: Lifecycle) -> None:
    with Traffic(life.server.target, ["roll"]) as traffic:
        wait_until(lambda: len(traffic.ok["roll"]) > 50, what="traffic on version 1")
        deployed = time.monotonic()
        life.family.deploy("roll", 2)
        wait_until(lambda: traffic.latest("roll") == 2, timeout=20, what="traffic to move to version 2")
        moved = time.monotonic() - deployed
        wait_until(lambda: life.states("roll").get(1) == END, what="version 1 to be unloaded")
        shutil.rmtree(life.family.root / "roll" / "1")
        time.sleep(4 * POLL_S)
        count = len(traffic.ok["roll"])
        wait_until(lambda: len(traffic.ok["roll"]) > count + 50, what="traffic after the old folder went")
    answered = traffic.check()
    print(f"rollout: {answered} requests, 0 failed; traffic moved {moved:.2f}s after the rename")
    # Within a few polls: one poll to notice, then load and warm-up of a small model.
    assert moved < 8 * POLL_S + 2.0, moved
    assert life.states("roll") == {1: END, 2: AVAILABLE}
    assert set(traffic.ok["roll"]) == {1, 2} and traffic.ok["roll"][-1] == 2


def test_a_config_file_change_adds_one_model_and_removes_another(life: Lifecycle) -> None:
    life.family.deploy("delta", 1)
    with Traffic(life.server.target, ["alpha", "roll"]) as traffic:
        wait_until(lambda: len(traffic.ok["alpha"]) > 20, what="traffic")
        models = {m: v for m, v in life.start_models.items() if m != "gamma"}
        models["delta"] = (life.family.root / "delta", "")
        life.config_path.write_text(config_text(models))
        wait_until(lambda: _answers(life, "delta"), what="delta to serve")
        with pytest.raises(grpc.RpcError) as caught:
            life.served("gamma")
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        count = len(traffic.ok["alpha"])
        wait_until(lambda: len(traffic.ok["alpha"]) > count + 20, what="traffic after the change")
    traffic.check()
    assert life.served("delta") == (1, 1)
    assert "model config file" in life.server.log() and "changed" in life.server.log()


def _answers(life: Lifecycle, model: str) -> bool:
    try:
        life.served(model)
    except grpc.RpcError:
        return False
    return True


def test_handle_reload_config_request_swaps_models_under_load(life: Lifecycle) -> None:
    life.family.deploy("epsilon", 4)
    models = {m: v for m, v in life.start_models.items() if m != "gamma"}
    models["epsilon"] = (life.family.root / "epsilon", "")
    reload = model_management_pb2.ReloadConfigRequest()
    text_format.Parse(config_text(models), reload.config)
    with Traffic(life.server.target, ["alpha", "delta"]) as traffic:
        wait_until(lambda: len(traffic.ok["delta"]) > 20, what="traffic")
        traffic.stop("delta")  # the reload removes it: its later calls must fail
        before = len(traffic.ok["alpha"])
        response = life.models.HandleReloadConfigRequest(reload, timeout=60, metadata=ADMIN)
        # It returns once the added model serves: the very next call finds it.
        assert response.status.error_code == 0
        assert life.served("epsilon") == (4, 4)
        wait_until(lambda: len(traffic.ok["alpha"]) > before + 20, what="traffic after the reload")
    traffic.check()
    with pytest.raises(grpc.RpcError) as caught:
        life.served("delta")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_handle_reload_config_request_refuses_a_bad_config_and_changes_nothing(life: Lifecycle) -> None:
    cases = {
        "a missing base path": (config_text({"x": (life.family.root / "nowhere", "")}),
                                grpc.StatusCode.INVALID_ARGUMENT, "is not a folder"),
        "a bad policy": (config_text({"x": (life.family.root / "alpha", "model_version_policy { specific {} }")}),
                         grpc.StatusCode.INVALID_ARGUMENT, "specific version policy that lists no versions"),
    }
    for text, code, fragment in cases.values():
        reload = model_management_pb2.ReloadConfigRequest()
        text_format.Parse(text, reload.config)
        with pytest.raises(grpc.RpcError) as caught:
            life.models.HandleReloadConfigRequest(reload, timeout=30, metadata=ADMIN)
        assert caught.value.code() == code and fragment in caught.value.details(), caught.value.details()
    empty = model_management_pb2.ReloadConfigRequest(config=model_server_config_pb2.ModelServerConfig())
    with pytest.raises(grpc.RpcError) as caught:
        life.models.HandleReloadConfigRequest(empty, timeout=30, metadata=ADMIN)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert life.served("epsilon") == (4, 4)


def test_a_corrupt_version_leaves_the_old_serving_and_is_reported(life: Lifecycle) -> None:
    failures_before = life.server.metric("mirrorserve_model_load_failures_total", model="roll", version="3")
    base = life.family.root / "roll"
    hidden = base / ".3"
    shutil.copytree(life.family.version(2), hidden)
    (hidden / "saved_model.pb").write_bytes(b"\x08\x01 this is not a SavedModel \xff\xff\xff")
    with Traffic(life.server.target, ["roll"]) as traffic:
        os.rename(hidden, base / "3")
        wait_until(lambda: life.status("roll").get(3, (0, 0, ""))[1] == DATA_LOSS,
                   what="the failure in GetModelStatus")
        count = len(traffic.ok["roll"])
        wait_until(lambda: len(traffic.ok["roll"]) > count + 20, what="traffic after the failure")
    traffic.check()
    assert set(traffic.ok["roll"]) == {2}
    state, code, message = life.status("roll")[3]
    assert (state, code) == (END, DATA_LOSS) and "DecodeError" in message, message
    assert life.status("roll")[2] == (AVAILABLE, 0, "")
    assert life.server.metric("mirrorserve_model_load_failures_total", model="roll", version="3") > failures_before
    assert "model=roll version=3 failed to load" in life.server.log()
    shutil.rmtree(base / "3")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


CYCLES = int(os.environ.get("LIFECYCLE_CYCLES", "20"))
WARM_CYCLES = 3
RSS_GROWTH_BOUND_MIB = 40.0
"""After the first cycles (allocator pools and TensorFlow caches reach their working size), 17 more
loads and unloads of a 4 MB model may grow both processes together by at most this: less than
half of what keeping every unloaded version would cost (17 x ~5 MB in the worker alone)."""


def test_memory_stays_bounded_over_many_load_unload_cycles(life: Lifecycle) -> None:
    server_pid = life.server.process.pid
    worker_pid = worker_of(server_pid)
    current = 2
    samples = []
    for cycle in range(1, CYCLES + 1):
        new = current + 2  # 3 is the corrupt version's number: skip odd ones
        life.family.deploy("roll", new, built=2)
        wait_until(lambda v=new: life.served("roll")[0] == v, what=f"version {new}")
        shutil.rmtree(life.family.root / "roll" / str(current))
        wait_until(lambda v=current: life.states("roll").get(v) == END, what=f"version {current} unloaded")
        current = new
        samples.append(rss_mib(server_pid) + rss_mib(worker_pid))
        if cycle == WARM_CYCLES:
            warm = samples[-1]
    growth = samples[-1] - warm
    print(f"RSS of server + worker (MiB) per cycle: {[round(s) for s in samples]}; growth after cycle "
          f"{WARM_CYCLES}: {growth:.1f} MiB (bound {RSS_GROWTH_BOUND_MIB})")
    assert growth <= RSS_GROWTH_BOUND_MIB, samples
    assert sorted(v for v, s in life.states("roll").items() if s == AVAILABLE) == [current]
