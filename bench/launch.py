"""Starting this server as a real process on free ports and finding where it serves: the one
launcher of the benchmark (bench.run) and the tests (tests/integration/conftest.py).

The server logs `listening grpc_port=… rest_api_port=… metrics_port=…` once its sockets are bound,
and `serving model=… grpc_port=…` once every start-up model is available; the ports are read from
those lines, so `--port 0 --rest-api-port 0` (any free port) works.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
SERVING = re.compile(r"serving model=.* grpc_port=(\d+) rest_api_port=(-?\d+) metrics_port=(-?\d+)")
LISTENING = re.compile(r"listening grpc_port=(\d+) rest_api_port=(-?\d+) metrics_port=(-?\d+)")


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
        return reap(self.process, timeout)


def reap(process: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """Wait for a process told to stop; kill it if it has not exited within `timeout`."""
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return int(process.returncode)


def poll_until(process: subprocess.Popen[bytes], find: Callable[[], T | None], log_path: Path, timeout: float,
               what: str = "server") -> T:
    """Ask `find` every 0.1 s until it answers; if the process exits first or `timeout` passes, kill
    it and raise with the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = find()
        if found is not None:
            return found
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{what} did not start:\n{log_path.read_text(errors='replace')[-4000:]}")


def spawn_server(args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 tree: Path = ROOT) -> subprocess.Popen[bytes]:
    """`python -m server` on free ports (gRPC and REST), its output to log_path; returns at once.
    `tree`: the checkout whose server runs (another one's, to compare builds: bench.versus)."""
    with log_path.open("wb") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "server", "--port", "0", "--rest-api-port", "0", *args],
            cwd=tree, stdout=log_file, stderr=subprocess.STDOUT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
        )


def wait_for_server(process: subprocess.Popen[bytes], log_path: Path, timeout: float = 120,
                    ready: bool = True) -> ServerProcess:
    """Wait until a spawned server serves (or, ready=False, listens); killed if it does not in time."""
    line = SERVING if ready else LISTENING

    def ports() -> ServerProcess | None:
        match = line.search(log_path.read_text(errors="replace"))
        return None if match is None else ServerProcess(process, int(match.group(1)), int(match.group(2)), log_path)

    return poll_until(process, ports, log_path, timeout)


def start_server(args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 timeout: float = 120, ready: bool = True) -> ServerProcess:
    """Start `python -m server` on free ports; wait until it serves (or, ready=False, listens)."""
    return wait_for_server(spawn_server(args, log_path, env), log_path, timeout, ready)
