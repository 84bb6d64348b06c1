"""--metrics-port answers scrapes outside the API's admission limit: with every slot taken (the
REST port's own /metrics then says 429), a scrape there still answers 200 within 100 ms, at
/metrics and at TF Serving's monitoring path."""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.integration.conftest import start_server

SLOTS = 4


def hold_a_slot(port: int) -> socket.socket:
    """A REST predict whose body never comes: admitted (the limit is taken before the body is
    read), then waiting."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/models/demo:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{")
    return sock


def get(url: str) -> tuple[int, float]:
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            answer.read()
            status = answer.status
    except urllib.error.HTTPError as refused:
        status = refused.code
    return status, time.perf_counter() - started


def test_a_scrape_on_the_metrics_port_answers_while_every_admission_slot_is_taken(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    server = start_server(["--model-base-path", str(model_dirs["demo"]), "--model-name", "demo",
                           "--max-concurrent-rpcs", str(SLOTS), "--metrics-port", "0", "--drain-delay-s", "0",
                           "--grace-period-s", "3"], tmp_path / "server.log")
    held = []
    try:
        match = re.search(r"metrics_port=(\d+)", server.log())
        assert match is not None
        metrics_port = int(match.group(1))
        assert get(f"{server.rest_url}/metrics")[0] == 200
        held = [hold_a_slot(server.rest_port) for _ in range(SLOTS)]
        deadline = time.monotonic() + 10
        while get(f"{server.rest_url}/metrics")[0] != 429:  # every slot taken
            assert time.monotonic() < deadline, "the held requests never took the slots"
            time.sleep(0.05)
        times = []
        for path in ("/metrics", "/monitoring/prometheus/metrics") * 5:
            status, seconds = get(f"http://127.0.0.1:{metrics_port}{path}")
            assert status == 200, path
            times.append(seconds)
        print(f"scrapes on the metrics port with every slot taken: {', '.join(f'{t * 1000:.1f}' for t in times)} ms")
        assert max(times) < 0.1, times
    finally:
        for sock in held:
            sock.close()
        server.stop()
