"""server.api.http.body on a real socket: bodies read within the limit, gzip and deflate
decompressed a bounded piece at a time, a compressed bomb refused at the limit with the connection
closed, unknown encodings refused before reading; and the helper process that decodes large
bodies off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import os
import socket
import time
import zlib

import pytest
from aiohttp import web

from server import event_loop
from server.api.admission import ConcurrencyLimit
from server.api.http.body import BodyDecoder, read_body
from server.api.http.server import RestServer, build_app, error_response
from server.errors import Overloaded, ServingError

LIMIT = 1 << 20


async def echo_length(request: web.Request) -> web.StreamResponse:
    try:
        body = await read_body(request, LIMIT)
    except ServingError as exc:
        status = 415 if "Content-Encoding" in str(exc) or "compressed" in str(exc) else 413
        return error_response(status, str(exc))
    return web.json_response({"length": len(body), "head": body[:8].decode(errors="replace")})


async def serve() -> tuple[RestServer, int]:
    server = RestServer(build_app([web.post("/echo", echo_length)], LIMIT, ConcurrencyLimit(16)))
    return server, await server.start("127.0.0.1", 0, None)


def exchange(port: int, head: bytes, body: bytes, read_timeout: float = 5.0) -> tuple[bytes, bool]:
    """Send a request (head, then as much of the body as the server takes); (answer, whether the
    server closed the connection after it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        sock.sendall(head)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(body)
        answer = b""
        closed = False
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    closed = True
                    break
                answer += data
                if b"\r\n\r\n" in answer and answer.endswith(b"}"):
                    sock.settimeout(0.5)
        except TimeoutError:
            pass
        except ConnectionResetError:
            closed = True
        return answer, closed


def request_head(length: int, encoding: str | None = None) -> bytes:
    headers = [b"POST /echo HTTP/1.1", b"Host: x", b"Content-Length: %d" % length]
    if encoding:
        headers.append(b"Content-Encoding: " + encoding.encode())
    return b"\r\n".join(headers) + b"\r\n\r\n"


async def call(port: int, body: bytes, encoding: str | None = None) -> tuple[bytes, bool]:
    return await asyncio.to_thread(exchange, port, request_head(len(body), encoding), body)


@pytest.mark.parametrize("loop", event_loop.NAMES)
def test_bodies_in_each_encoding_and_their_refusals(loop: str) -> None:
    async def main() -> None:
        server, port = await serve()
        try:
            plain = b"{" + b"x" * 1000 + b"}"
            for encoding, body in ((None, plain), ("gzip", gzip.compress(plain)), ("x-gzip", gzip.compress(plain)),
                                   ("deflate", zlib.compress(plain)),
                                   ("deflate", zlib.compress(plain)[2:-4])):  # raw deflate, as some clients send
                answer, _ = await call(port, body, encoding)
                assert b'"length": 1002' in answer, (encoding, answer)
            answer, closed = await call(port, b"whatever", "br")
            assert answer.startswith(b"HTTP/1.1 415") and b"Content-Encoding 'br' is not supported" in answer
            assert closed
            answer, _ = await call(port, zlib.compress(plain)[:-10], "deflate")  # cut short
            assert answer.startswith(b"HTTP/1.1 415") and b"ends before its compressed stream does" in answer
        finally:
            await server.stop()

    event_loop.run(main(), loop)


@pytest.mark.parametrize("loop", event_loop.NAMES)
def test_a_compressed_bomb_is_refused_at_the_limit_and_the_connection_closed(loop: str) -> None:
    """16 KB of gzip that would inflate to 16 MB: refused once 1 MB has come out, quickly, and the
    rest not decompressed: the server closes the connection after its answer."""
    bomb = gzip.compress(b"\0" * (16 << 20), 9)
    assert len(bomb) < 32 * 1024

    async def main() -> None:
        server, port = await serve()
        try:
            started = time.monotonic()
            answer, closed = await call(port, bomb, "gzip")
            assert time.monotonic() - started < 2.0
            assert answer.startswith(b"HTTP/1.1 413") and b"decompresses to over the limit" in answer, answer
            assert closed
            # The same bomb with a trailer that lies (a small size): inflated, and refused at the limit.
            liar = bomb[:-4] + (1000).to_bytes(4, "little")
            answer, closed = await call(port, liar, "gzip")
            assert answer.startswith(b"HTTP/1.1 413") and b"decompresses to over the limit" in answer, answer
            # And as deflate, which states no size.
            answer, closed = await call(port, zlib.compress(b"\0" * (16 << 20), 9), "deflate")
            assert answer.startswith(b"HTTP/1.1 413") and b"decompresses to over the limit" in answer, answer
            # Declared too long: refused before a byte is read, and the connection is to close (once
            # the body the client still owes has been dropped, or LINGER_S has passed).
            answer, closed = await asyncio.to_thread(exchange, port, request_head(LIMIT + 1), b"")
            assert answer.startswith(b"HTTP/1.1 413") and b"Connection: close" in answer
        finally:
            await server.stop()

    event_loop.run(main(), loop)


def _pid() -> int:
    return os.getpid()


def _fail() -> None:
    raise ValueError("bad body")


def test_large_bodies_are_decoded_in_a_helper_process() -> None:
    async def main() -> None:
        decoder = BodyDecoder(inline_bytes=10, max_waiting_bytes=11)
        try:
            assert await decoder.decode(10, _pid) == os.getpid()
            helper = await decoder.decode(11, _pid)
            assert helper != os.getpid()
            assert await decoder.decode(11, _pid) == helper, "one helper, kept"
            with pytest.raises(ValueError, match="bad body"):
                await decoder.decode(11, _fail)
        finally:
            decoder.close()

    asyncio.run(main())


def test_bodies_wait_for_the_helper_within_a_byte_budget() -> None:
    """One body always may wait; more only while the bytes waiting stay within the budget."""
    async def main() -> None:
        decoder = BodyDecoder(inline_bytes=10, max_waiting_bytes=100)
        try:
            await decoder.run(False, 1, _pid)  # the helper started
            first = asyncio.ensure_future(decoder.run(False, 60, time.sleep, 1.0))
            await asyncio.sleep(0.1)
            with pytest.raises(Overloaded, match=r"1 large bodies \(60 bytes\) are being decoded"):
                await decoder.run(False, 60, _pid)
            assert await decoder.run(False, 40, _pid) != os.getpid(), "a small one queues behind"
            await first
            assert await decoder.run(False, 1000, _pid) != os.getpid(), "one alone may be over the budget"
        finally:
            decoder.close()

    asyncio.run(main())


def test_bodies_of_every_size_around_a_piece_inflate_whole() -> None:
    """Sizes on and around the 1 MiB piece, in gzip, zlib-wrapped and raw deflate."""
    from server.api.http import body as rest_body

    async def inflate(encoding: str, body: bytes) -> bytes:
        inflater = rest_body._decompressor(encoding, body)
        out = await rest_body._inflate(inflater, body, 1 << 30, "the limit")
        assert inflater.eof
        return out

    async def main() -> None:
        piece = rest_body.INFLATE_BYTES
        for n in (0, 1, piece - 1, piece, piece + 1, 3 * piece + 258):
            data = bytes(range(256)) * (n // 256) + b"x" * (n % 256)
            for encoding, body in (("gzip", gzip.compress(data)), ("deflate", zlib.compress(data)),
                                   ("deflate", zlib.compress(data)[2:-4])):
                assert await inflate(encoding, body) == data, (n, encoding)

    asyncio.run(main())
