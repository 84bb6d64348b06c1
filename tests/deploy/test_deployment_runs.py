"""Start the server the way the rendered Deployment does (the image's entrypoint and environment,
then the container's environment over it, the model volume mapped onto a local folder), perform
the manifest's own probes against it, scrape where the annotations point, and drain it the way
Kubernetes would (SIGTERM) within terminationGracePeriodSeconds."""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.core.model_config import parse_config_text
from tests.deploy.conftest import ROOT, container, image_entrypoint, image_env, one, render

SERVING = health_pb2.HealthCheckResponse.SERVING


def resolve_env(main: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet would set it (values and resourceFieldRefs)."""
    env = {}
    for var in main["env"]:
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        field = var["valueFrom"]["resourceFieldRef"]
        assert field["resource"] == "limits.cpu", field
        # Kubernetes rounds a CPU limit up to whole cores with the default divisor of 1.
        env[var["name"]] = str(math.ceil(float(main["resources"]["limits"]["cpu"])))
    return env


def probe(port: int, spec: dict[str, Any]) -> bool:
    """One gRPC probe as the kubelet performs it: Health.Check within timeoutSeconds."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")),
                timeout=spec.get("timeoutSeconds", 1))
        except grpc.RpcError:
            return False
    return bool(reply.status == SERVING)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no obstacle
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def test_server_started_as_the_deployment_passes_its_probes(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    objects = render("cpu")
    pod = one(objects, "Deployment")["spec"]["template"]
    main = container(objects)
    mount = next(m["mountPath"] for m in main["volumeMounts"] if m["name"] == "models")
    volume = tmp_path / "models-volume"
    env = {**{k: v for k, v in image_env().items() if k.startswith("MIRRORSERVE_")}, **resolve_env(main)}
    # The ConfigMap's config file, mounted where the pod mounts it, and the model volume: the demo
    # SavedModel at the path the config names, both mapped onto local folders.
    config_mount = next(m["mountPath"] for m in main["volumeMounts"] if m["name"] == "config")
    config_path = env["MIRRORSERVE_MODEL_CONFIG_FILE"]
    assert config_path.startswith(config_mount + "/")
    config_map = one(objects, "ConfigMap", "mirrorserve-models")
    text = config_map["data"][config_path[len(config_mount) + 1:]]
    (source,) = parse_config_text(text)
    assert source.base_path.startswith(mount + "/")
    shutil.copytree(model_dirs["demo"], volume / source.base_path[len(mount) + 1:])
    local_config = tmp_path / "config" / "models.config"
    local_config.parent.mkdir()
    local_config.write_text(text.replace(f'"{mount}/', f'"{volume}/'))
    env["MIRRORSERVE_MODEL_CONFIG_FILE"] = str(local_config)
    grpc_port = int(next(p["containerPort"] for p in main["ports"] if p["name"] == "grpc"))
    annotations = pod["metadata"]["annotations"]
    for port in (grpc_port, int(annotations["prometheus.io/port"])):
        if not port_is_free(port):
            pytest.fail(f"port {port} is taken on this machine; the test runs the manifest's own ports")

    assert image_entrypoint() == ["mirrorserve-entrypoint"]  # deploy/entrypoint.sh, as the image holds it
    command = ["sh", str(ROOT / "deploy" / "entrypoint.sh"), *main.get("args", [])]
    log_path = tmp_path / "server.log"
    clean_env = {k: v for k, v in os.environ.items()
                 if not k.startswith("MIRRORSERVE_") and k not in ("MODEL_NAME", "MODEL_BASE_PATH")}
    clean_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{clean_env.get('PATH', '')}"  # the image's python
    process = subprocess.Popen(command, cwd=ROOT, env={**clean_env, "TF_CPP_MIN_LOG_LEVEL": "2", **env},
                               stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    try:
        # startupProbe: every periodSeconds until it passes, failureThreshold tries at most.
        startup = main["startupProbe"]
        results = []
        for _ in range(startup["failureThreshold"]):
            results.append(probe(grpc_port, startup))
            if results[-1]:
                break
            assert process.poll() is None, log_path.read_text()
            time.sleep(min(startup["periodSeconds"], 1))  # faster than the kubelet; same outcome
        assert results[-1], f"startup probe never passed:\n{log_path.read_text()[-3000:]}"
        assert probe(grpc_port, main["readinessProbe"])
        assert probe(grpc_port, main["livenessProbe"])

        url = f"http://127.0.0.1:{annotations['prometheus.io/port']}{annotations['prometheus.io/path']}"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            text = response.read().decode()
        assert 'mirrorserve_model_ready{model="model",version="1"} 1.0' in text
        log = log_path.read_text()
        assert '"message": "serving model=model version=1' in log, "JSON logs, the manifest's model name"
        assert "intra_op_threads=2 inter_op_threads=2" in log, "TensorFlow's threads follow the CPU limit"

        # Termination: SIGTERM; readiness fails at once (drain), the process exits 0 in time.
        stopped = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert not probe(grpc_port, main["readinessProbe"]), "readiness must fail as soon as the drain starts"
        code = process.wait(timeout=pod["spec"]["terminationGracePeriodSeconds"])
        assert code == 0, log_path.read_text()[-3000:]
        assert time.monotonic() - stopped < pod["spec"]["terminationGracePeriodSeconds"]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
