"""The attack suite's harness: a server serving a string model and the demo model, another client
that keeps calling it in a process of its own (the bystander), and the three checks every attack
ends with: the server stays up, the bystander is unharmed, memory comes back.

Everything stays on loopback: the servers listen on 127.0.0.1 only (--grpc-bind-address,
--rest-bind-address), and the attacks aim there.
"""

from __future__ import annotations

import http.client
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, ServerProcess, start_server

LOOPBACK = ["--grpc-bind-address", "127.0.0.1", "--rest-bind-address", "127.0.0.1"]
MIN_SUCCESS = 0.99
P99_FACTOR = 3.0
RSS_SLACK_MB = 50.0


def build_strings(version_dir: Path) -> None:
    """A string model: each row's length and the row upper-cased (so a long input comes back long)."""
    import tensorflow as tf

    class Strings(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="s")])
        def serve(self, s: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"n": tf.strings.length(s), "upper": tf.strings.upper(s)}

    module = Strings()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


@pytest.fixture(scope="session")
def security_models(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> Path:
    """A model root holding `str` (strings), `classifier` (serialized tf.Examples) and `demo`."""
    import shutil

    from tests.integration.example_models import build_classifier

    root = tmp_path_factory.mktemp("roots") / "models"
    build_strings(root / "str" / "1")
    build_classifier(root / "classifier" / "1")
    shutil.copytree(model_dirs["demo"], root / "demo")
    return root


def config_file(path: Path, models: dict[str, Path]) -> Path:
    path.write_text("model_config_list {\n" + "".join(
        f'  config {{ name: "{name}" base_path: "{base}" }}\n' for name, base in models.items()) + "}\n")
    return path


@pytest.fixture(scope="session")
def attack_server(security_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The server every attack but the control plane's aims at: default limits, management off."""
    folder = tmp_path_factory.mktemp("attack")
    config = config_file(folder / "models.config", {name: security_models / name for name in ("str", "demo",
                                                                                               "classifier")})
    # grpc's queue of calls not yet picked up holds test_refusals' burst of 1,500 (the default,
    # 4 x 256, would cancel part of it), so the whole burst meets the server's own refusal.
    server = start_server(["--model-config-file", str(config), "--max-concurrent-rpcs", "256",
                           "--grpc-max-pending-rpcs", "2048",
                           "--drain-delay-s", "0", *LOOPBACK], folder / "server.log")
    yield server
    server.stop()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def worker_pid(server: ServerProcess) -> int:
    """The server's model worker: of its spawned children (the worker, multiprocessing's resource
    tracker, the body-decoding helper), the one holding TensorFlow, the largest by far."""
    pid = server.process.pid
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return max(children, key=rss_mb)


def post(port: int, path: str, body: bytes, headers: dict[str, str], timeout: float = 60) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", path, body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read()
    except (ConnectionResetError, BrokenPipeError):
        return 0, b""  # the server refused the body and closed before all of it went out
    finally:
        connection.close()


@dataclass
class Verdict:
    calls: int
    success: float
    p99_ms: float
    baseline_p99_ms: float

    def __str__(self) -> str:
        return (f"bystander: {self.calls} calls, {self.success:.1%} OK, p99 {self.p99_ms:.1f} ms against "
                f"{self.baseline_p99_ms:.1f} ms before the attack")


class Bystander:
    """Another client calling Predict (one row, one at a time) in its own process, throughout."""

    def __init__(self, server: ServerProcess, model: str = "demo", tensor: str = "x", dims: tuple[int, ...] = (8,)):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.security.bystander", server.target, model, tensor, *map(str, dims)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        first = self.process.stdout.readline()
        assert first.strip() == "ready", first
        self.calls: list[tuple[float, float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            start, latency, code = line.split()
            self.calls.append((float(start), float(latency), code))

    def between(self, since: float, until: float) -> list[tuple[float, str]]:
        return [(latency, code) for start, latency, code in list(self.calls) if since <= start < until]

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(10)
        self._reader.join(5)


def p99(latencies: list[float]) -> float:
    return statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else (latencies or [0.0])[0]


@dataclass
class Attack:
    """One attack's window, judged against the seconds before it."""

    server: ServerProcess
    bystander: Bystander
    baseline_s: float = 1.0

    def __enter__(self) -> Attack:
        time.sleep(self.baseline_s)
        self.started = time.monotonic()
        self.rss_before = rss_mb(self.server.process.pid)
        self.log_offset = len(self.server.log())
        return self

    def __exit__(self, *exc: object) -> None:
        self.ended = time.monotonic()

    def verdict(self) -> Verdict:
        base = [lat for lat, code in self.bystander.between(self.started - self.baseline_s, self.started)
                if code == "OK"]
        during = self.bystander.between(self.started, self.ended)
        ok = [lat for lat, code in during if code == "OK"]
        return Verdict(len(during), len(ok) / max(len(during), 1), p99(ok) * 1e3, p99(base) * 1e3)

    def log(self) -> str:
        return self.server.log()[self.log_offset:]

    def memory_returned(self, settle_s: float = 5.0) -> float:
        """The server's RSS growth since the attack began, once it is back within the slack (or
        after settle_s)."""
        deadline = time.monotonic() + settle_s
        while True:
            grown = rss_mb(self.server.process.pid) - self.rss_before
            if grown <= RSS_SLACK_MB or time.monotonic() > deadline:
                return grown
            time.sleep(0.25)


@pytest.fixture
def bystander(attack_server: ServerProcess) -> Iterator[Bystander]:
    watcher = Bystander(attack_server)
    yield watcher
    watcher.stop()


def assert_unharmed(attack: Attack, *, p99_factor: float = P99_FACTOR) -> Verdict:
    """The bystander's calls during the attack: at least 99% OK, p99 within p99_factor of before."""
    verdict = attack.verdict()
    print(verdict)
    assert verdict.calls >= 10, verdict
    assert verdict.success >= MIN_SUCCESS, verdict
    assert verdict.p99_ms <= p99_factor * max(verdict.baseline_p99_ms, 1.0), verdict
    assert attack.server.process.poll() is None, "the server stopped"
    return verdict
