"""Fixtures: test SavedModels on disk, and real server processes on free ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVING = re.compile(r"serving model=.* grpc_port=(\d+) rest_api_port=(-?\d+) metrics_port=(-?\d+)")
LISTENING = re.compile(r"listening grpc_port=(\d+) rest_api_port=(-?\d+) metrics_port=(-?\d+)")


def triton_client_path() -> str:
    """Where `make test` installed tritonclient (apart: see the Makefile)."""
    path = os.environ.get("TRITON_CLIENT_PATH") or str(ROOT / ".venv" / "tritonclient")
    if not (Path(path) / "tritonclient" / "grpc" / "__init__.py").is_file():
        pytest.fail(f"tritonclient not installed under {path}; run `make test`", pytrace=False)
    return path


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int
    rest_port: int
    """The REST API's port (-1 when HTTP is off); /metrics is served there."""
    log_path: Path
    _stop_requested: bool = field(default=False, repr=False)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def metrics_port(self) -> int:
        return self.rest_port

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return str(r.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            if not line.startswith(name):
                continue
            match = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if not match or match.group(1) != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(match.group(3))
        return total

    def request_stop(self) -> None:
        """SIGTERM, once: the server drains and exits on its own time."""
        if self.process.poll() is None and not self._stop_requested:
            self.process.send_signal(signal.SIGTERM)
            self._stop_requested = True

    def stop(self, timeout: float = 30) -> int:
        self.request_stop()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return int(self.process.returncode)


def start_server(args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 timeout: float = 120, ready: bool = True) -> ServerProcess:
    """Start `python -m server` on free ports; wait until it serves (or, ready=False, listens)."""
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "--port", "0", "--rest-api-port", "0", *args],
        cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = (SERVING if ready else LISTENING).search(log_path.read_text(errors="replace"))
        if match:
            return ServerProcess(process, int(match.group(1)), int(match.group(2)), log_path)
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"server did not start:\n{log_path.read_text(errors='replace')[-4000:]}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> Iterator[
        dict[tuple[str, ...], ServerProcess]]:
    """Server processes started on demand and shared within a test module, keyed by their
    arguments; stopped when the module ends, so idle servers do not pile up in memory."""
    started: dict[tuple[str, ...], ServerProcess] = {}
    yield started
    for server in started.values():  # all drain at once: each waits out its drain delay
        server.request_stop()
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def server_for(servers: dict[tuple[str, ...], ServerProcess], model_dirs: dict[str, Path],
               tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """server_for("echo", "--replicas", "3") -> a running server for that model and flags."""

    def get(model: str, *flags: str) -> ServerProcess:
        key = (model, *flags)
        if key not in servers:
            log_path = tmp_path_factory.mktemp("server") / "server.log"
            servers[key] = start_server(
                ["--model-base-path", str(model_dirs[model]), "--model-name", model, *flags], log_path
            )
        return servers[key]

    return get
