"""server.core.worker_channel: Connection's framing decoded from pieces of any size, and a channel
that waits on a full socket instead of failing, talking to a plain blocking Connection."""

from __future__ import annotations

import asyncio
import pickle
import random
import socket
import struct
import threading
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from server import event_loop
from server.core.worker_channel import FrameDecoder, WorkerChannel, frame_header


def framed(message: object) -> bytes:
    payload = pickle.dumps(message)
    return frame_header(len(payload)) + payload


def test_frames_split_anywhere_come_out_whole_and_in_order() -> None:
    messages: list[Any] = [b"", "a" * 20000, list(range(50)), {"x": b"\0" * 70000}, 7]
    stream = b"".join(framed(m) for m in messages)
    rng = random.Random(0)
    for _ in range(50):
        decoder = FrameDecoder()
        out: list[Any] = []
        at = 0
        while at < len(stream):
            step = rng.choice((1, 3, 4, 5, 100, 5000, 100000))
            out += [pickle.loads(p) for p in decoder.feed(stream[at:at + step])]
            at += step
        assert out == messages


def test_the_long_header_of_connection_is_understood() -> None:
    payload = pickle.dumps("big")
    long_form = struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload
    assert [pickle.loads(p) for p in FrameDecoder().feed(long_form)] == ["big"]
    assert frame_header(1 << 31) == struct.pack("!i", -1) + struct.pack("!Q", 1 << 31)


def test_a_negative_length_is_refused() -> None:
    with pytest.raises(ValueError, match="length -2"):
        FrameDecoder().feed(struct.pack("!i", -2))


@pytest.mark.parametrize("loop", event_loop.NAMES)
def test_a_message_far_bigger_than_the_socket_buffer_waits_for_a_slow_reader(loop: str) -> None:
    """The server's side never blocks and never takes a full socket for a dead peer: a 32 MB
    message to a reader that sleeps before reading arrives whole, and the loop keeps running."""

    async def main() -> None:
        ours, theirs = socket.socketpair()
        peer = Connection(theirs.detach())
        lost: list[str] = []
        received: list[Any] = []
        channel = await WorkerChannel.open(ours, received.append, lost.append)
        big = np.arange(8 << 20, dtype=np.float32)  # 32 MB
        echoed = threading.Event()

        def slow_peer() -> None:
            threading.Event().wait(0.3)
            message = peer.recv()
            peer.send(("echo", message.sum()))
            peer.send(big)  # and one as big back, read in pieces by the channel
            echoed.set()

        thread = threading.Thread(target=slow_peer)
        thread.start()
        channel.send(big)
        assert channel.buffered_bytes > 0  # the kernel could not take it all: kept, not failed
        ticks = 0
        while len(received) < 2:
            await asyncio.sleep(0.01)
            ticks += 1
        thread.join()
        assert ticks >= 5  # the loop ran on while the peer slept (about 30 ticks when idle)
        assert received[0] == ("echo", big.sum())
        np.testing.assert_array_equal(received[1], big)
        assert lost == []
        channel.close()
        await asyncio.sleep(0.05)
        assert lost == ["end of stream"]
        with pytest.raises(EOFError):
            peer.recv()

    event_loop.run(main(), loop)


@pytest.mark.parametrize("loop", event_loop.NAMES)
def test_the_peer_closing_is_reported_once(loop: str) -> None:
    async def main() -> None:
        ours, theirs = socket.socketpair()
        lost: list[str] = []
        await WorkerChannel.open(ours, lambda m: None, lost.append)
        theirs.close()
        await asyncio.sleep(0.05)
        assert lost == ["end of stream"]

    event_loop.run(main(), loop)
