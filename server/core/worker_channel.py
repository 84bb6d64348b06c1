"""The server's end of the socket to its model worker, on the event loop, never blocking it.

The worker keeps a plain blocking `multiprocessing.connection.Connection` (its reading thread may
block; that is its job). The server cannot: a message bigger than the socket's buffer (a batch of
long strings, a large output) must neither block the event loop nor be mistaken for the worker's
death when the buffer is full. So on this side the socket is an asyncio transport, which keeps
what the kernel cannot take yet and sends it when the socket is writable (back-pressure, not an
error), and reads whatever has arrived, reassembling messages across reads. Only the connection's
loss (EOF, a reset, a broken pipe) ends it.

The framing is Connection's own (a 4-byte big-endian signed length, or -1 and an 8-byte length for
messages of 2 GiB and more, then a pickle), so the two ends need not change together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import struct
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

log = logging.getLogger("server.core.worker_channel")

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_LONG_MARK = -1
_MAX_SHORT = 0x7FFFFFFF
_INLINE_BYTES = 16384
"""Messages up to this size go out as one write with their header (as Connection does)."""


def frame_header(size: int) -> bytes:
    """The header Connection puts before a message of `size` bytes."""
    if size > _MAX_SHORT:
        return _SHORT.pack(_LONG_MARK) + _LONG.pack(size)
    return _SHORT.pack(size)


class FrameDecoder:
    """Connection's framing, decoded from bytes as they arrive in pieces of any size. Pure.

    A large message is read into a buffer of its own size, allocated once its header is known,
    so its pieces are copied once each (appending them to a growing buffer cost the event loop
    a millisecond a megabyte)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._large: bytearray | None = None
        self._filled = 0

    def feed(self, data: bytes) -> list[bytes | bytearray]:
        """The messages that `data` completes, in order; a partial one is kept for the next call."""
        messages: list[bytes | bytearray] = []
        view = memoryview(data)
        if self._large is not None:
            view = self._fill(view, messages)
            if not view:
                return messages
        buffer = self._buffer
        buffer += view
        start = 0
        while True:
            available = len(buffer) - start
            if available < _SHORT.size:
                break
            (size,) = _SHORT.unpack_from(buffer, start)
            header = _SHORT.size
            if size == _LONG_MARK:
                if available < _SHORT.size + _LONG.size:
                    break
                (size,) = _LONG.unpack_from(buffer, start + _SHORT.size)
                header += _LONG.size
            elif size < 0:
                raise ValueError(f"malformed message header: length {size}")
            end = start + header + size
            if end > len(buffer):
                if size > _INLINE_BYTES:  # the start of a large message: give it its own buffer
                    self._large = bytearray(size)
                    self._filled = 0
                    rest = memoryview(buffer)[start + header:]
                    try:
                        self._fill(rest, messages)
                    finally:
                        rest.release()
                    start = len(buffer)
                break
            messages.append(bytes(buffer[start + header:end]))
            start = end
        if start:
            del buffer[:start]
        return messages

    def _fill(self, view: memoryview, messages: list[bytes | bytearray]) -> memoryview:
        """Copy into the large message; the bytes after it, if it is now complete."""
        large = self._large
        assert large is not None
        take = min(len(view), len(large) - self._filled)
        large[self._filled:self._filled + take] = view[:take]
        self._filled += take
        if self._filled == len(large):
            messages.append(large)
            self._large = None
        return view[take:]


class WorkerChannel(asyncio.Protocol):
    """Messages to and from the worker: send() queues a message (never blocks, never fails for a
    full socket); each message received goes to `on_message`; `on_lost` is called once, with the
    reason, when the connection ends."""

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[str], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._decoder = FrameDecoder()
        self._transport: asyncio.Transport | None = None
        self._lost = False

    @classmethod
    async def open(cls, sock: socket.socket, on_message: Callable[[Any], None],
                   on_lost: Callable[[str], None]) -> WorkerChannel:
        """A channel over our end of a connected Unix socket pair."""
        loop = asyncio.get_running_loop()
        _, channel = await loop.create_unix_connection(lambda: cls(on_message, on_lost), sock=sock)
        return channel

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._decoder.feed(data)
        except ValueError as exc:  # the stream is corrupt: nothing after this can be trusted
            log.error("unreadable message from the model worker: %s", exc)
            self.close()
            return
        for payload in messages:
            try:
                message = pickle.loads(payload)
            except Exception:
                log.exception("undecodable message from the model worker")
                continue
            try:
                self._on_message(message)
            except Exception:  # a bug in handling one answer must not end the connection
                log.exception("handling a message from the model worker failed")

    def eof_received(self) -> bool:
        return False  # the worker closed its end: close ours too (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._lost:
            return
        self._lost = True
        self._on_lost("end of stream" if exc is None else type(exc).__name__)

    def send(self, message: object) -> None:
        """Queue a message; the transport sends it as fast as the worker reads."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return  # lost: the owner has been told, and fails what waits on the worker
        payload = ForkingPickler.dumps(message)
        header = frame_header(len(payload))
        if len(payload) <= _INLINE_BYTES:
            transport.write(header + payload)
        else:
            transport.writelines((header, payload))

    @property
    def buffered_bytes(self) -> int:
        """Bytes accepted by send() that the worker has not taken yet."""
        return 0 if self._transport is None else self._transport.get_write_buffer_size()

    def close(self) -> None:
        """Close our end. The socket is shut down at once (the transport itself closes it on the
        loop's next turn), so a worker waited for right after sees its end of stream now."""
        transport = self._transport
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:  # uvloop's stand-in socket has no shutdown(): wrap the descriptor
            with contextlib.suppress(OSError, ValueError):
                raw = socket.socket(fileno=sock.fileno())
                try:
                    raw.shutdown(socket.SHUT_RDWR)
                finally:
                    raw.detach()
        transport.close()
