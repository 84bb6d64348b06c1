"""Reading a REST body without letting it stall the event loop, which gRPC and REST share.

- **Size.** The body is refused (413) once it is over the limit: before reading it when its
  declared length says so, else as soon as the bytes read, or the bytes they decompress to, pass
  the limit (for gzip, at once when its trailer states a larger size). The rest is not kept:
  after the answer aiohttp reads and drops it, for a few seconds at most (server.api.http.server's
  LINGER_S), never decompressed, and closes the connection.
- **Encodings.** aiohttp's own decompression is off; gzip and deflate are decompressed here, once
  the whole compressed body is in, a bounded piece at a time (a megabyte of gzip can hold a
  gigabyte), on one thread of lower
  priority (zlib lets go of the GIL while it inflates), so the loop goes on serving and a bomb
  gets a share of one core at most. Any other Content-Encoding is refused (415) before a byte of
  the body is read.
- **JSON.** Parsing JSON costs the loop about 4 ms a megabyte here, and its numbers briefly take
  some 18 times their text's size as Python objects. A body over INLINE_BYTES is therefore decoded
  in a helper process of lower priority (BodyDecoder): the loop only copies the bytes out and the
  arrays back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from aiohttp import web

from server import memory
from server.errors import ClientGone, Overloaded, TooLarge, Unavailable, UnsupportedEncoding

log = logging.getLogger("server.api.http.body")

T = TypeVar("T")

READ_BYTES = 64 * 1024
"""Bytes read from the socket at a time."""
INFLATE_BYTES = 1 << 20
"""Decompressed bytes produced per step (about 1 ms of a thread's time), the limit checked between."""
ENCODINGS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""Content-Encodings decoded, with zlib's window bits (deflate: RFC 1950's zlib stream; a raw
deflate stream, which some clients send, is recognised by its first byte)."""
INLINE_BYTES = 256 * 1024
"""JSON bodies up to this size are decoded on the loop (about 1 ms); larger ones by the helper."""
HELPER_NICENESS = 10
MAX_WAITING = 4
"""Bodies of the largest size (--max-message-bytes) that may wait for the helper at once: what
waits is bounded by MAX_WAITING times that in bytes, beyond which a body is refused
(RESOURCE_EXHAUSTED, 429), so bodies parked for it cannot pile up in memory. Smaller bodies (a
REST classify of a hundred examples is a few KB) queue by the same budget, many at once."""


def _decompressor(encoding: str, first: bytes) -> Any:
    wbits = ENCODINGS[encoding]
    assert wbits is not None, "identity bodies are not decompressed"
    if encoding == "deflate" and first and first[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS
    return zlib.decompressobj(wbits)


async def read_body(request: web.Request, limit: int, limit_name: str = "--max-message-bytes") -> bytes:
    """The whole body, decompressed, or TooLarge (413) / UnsupportedEncoding (415); `limit_name`
    says in the refusal where the limit comes from."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
    if encoding not in ENCODINGS:
        raise UnsupportedEncoding(f"Content-Encoding '{encoding[:40]}' is not supported; send the body as it is, "
                                  f"or in {', '.join(e for e in ENCODINGS if e != 'identity')}")
    declared = request.content_length
    if declared is not None and declared > limit:
        raise TooLarge(f"the body has {declared} bytes; the limit is {limit} ({limit_name})")
    chunks: list[bytes] = []
    read = 0
    while True:
        try:
            data = await request.content.read(READ_BYTES)
        except ConnectionError:
            raise ClientGone("the client closed the connection before sending the whole body") from None
        if not data:
            break
        read += len(data)
        if read > limit:
            raise TooLarge(f"the body is over the limit of {limit} bytes ({limit_name})")
        chunks.append(data)
    if encoding == "identity":
        return b"".join(chunks)
    if encoding in ("gzip", "x-gzip") and _gzip_size(chunks) > limit:
        # A gzip stream ends with its decompressed size: a bomb is refused without inflating it.
        # (A trailer that lies is caught by zlib at the end, or by the limit while inflating.)
        raise TooLarge(f"the body decompresses to over the limit of {limit} bytes ({limit_name})")
    compressed = b"".join(chunks)
    inflater = _decompressor(encoding, compressed)
    body = await _inflate(inflater, compressed, limit, limit_name)
    if not inflater.eof:
        raise UnsupportedEncoding(f"the {encoding} body ends before its compressed stream does")
    return body


def _gzip_size(chunks: list[bytes]) -> int:
    """The decompressed size a gzip stream's trailer states (modulo 4 GiB), or 0 if too short."""
    tail = b"".join(chunks[-2:])[-4:]
    return int.from_bytes(tail, "little") if len(tail) == 4 else 0


_INFLATER: concurrent.futures.ThreadPoolExecutor | None = None


def _inflating() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that decompresses bodies, one piece at a time, below the loop's priority: a
    compressed bomb then costs a share of one core, not the event loop's time."""
    global _INFLATER
    if _INFLATER is None:
        _INFLATER = concurrent.futures.ThreadPoolExecutor(1, "inflate", initializer=_lower_thread_priority)
    return _INFLATER


def _lower_thread_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # per-thread niceness is Linux's
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HELPER_NICENESS)


async def _inflate(inflater: Any, data: bytes, limit: int, limit_name: str) -> bytes:
    """Decompress `data` a bounded piece at a time, then what zlib still holds once every input
    byte is in, until the stream ends or nothing more comes out."""
    pieces: list[bytes] = []
    size = 0
    while True:
        try:
            piece = await asyncio.get_running_loop().run_in_executor(_inflating(), inflater.decompress, data,
                                                                     INFLATE_BYTES)
        except zlib.error as exc:
            raise UnsupportedEncoding(f"the body is not valid compressed data: {exc}") from None
        size += len(piece)
        if size > limit:
            raise TooLarge(f"the body decompresses to over the limit of {limit} bytes ({limit_name})")
        pieces.append(piece)
        data = inflater.unconsumed_tail
        if inflater.eof or not (data or piece):
            return b"".join(pieces)


PARENT_CHECK_S = 1.0
"""How often the helper looks for its parent."""


def _helper_started() -> None:
    """In the helper: run below the server's priority, so that on a busy machine the event loop and
    the model come first (os.nice raises only this process's niceness); and exit once the process
    that started it is gone. A front-end killed outright (SIGKILL, the OOM killer) cannot shut its
    pool down, and the helper, blocked reading a queue whose other end it holds itself, would
    otherwise outlive it for good: one orphan of ~60 MB for every front-end restart."""
    os.nice(HELPER_NICENESS)
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()


def _in_helper(function: Callable[..., T], *args: Any) -> T:
    """Run in the helper, then hand the memory a large body took back to the OS."""
    try:
        return function(*args)
    finally:
        memory.trim()


class BodyDecoder:
    """Runs a body-decoding function inline when the body is small, else in a helper process
    (one, started on first use, without TensorFlow), so a large JSON body does not stop the loop.
    Bodies wait for the helper up to `max_waiting_bytes` in all (one alone always may); it is
    restarted if it dies (say, killed for memory), and the body that was in it is refused, not
    retried."""

    def __init__(self, inline_bytes: int = INLINE_BYTES, max_waiting_bytes: int = MAX_WAITING * 64 * 1024 * 1024
                 ) -> None:
        self._inline_bytes = inline_bytes
        self._max_waiting_bytes = max_waiting_bytes
        self._waiting = 0
        self._waiting_bytes = 0
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    async def decode(self, size: int, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)`, inline for a body of at most the inline size, else in the helper."""
        return await self.run(size <= self._inline_bytes, size, function, *args)

    async def run(self, inline: bool, size: int, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on a body of `size` bytes, inline or in the helper: for work whose
        cost the caller judges."""
        if inline:
            return function(*args)
        if self._waiting and self._waiting_bytes + size > self._max_waiting_bytes:
            raise Overloaded(f"{self._waiting} large bodies ({self._waiting_bytes} bytes) are being decoded; retry "
                             f"later, or send tensors in binary form (gRPC, or v2's binary tensor extension)")
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_helper_started)
        pool = self._pool
        self._waiting += 1
        self._waiting_bytes += size
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, _in_helper, function, *args)
        except BrokenProcessPool:
            log.error("the body-decoding helper process died; starting a new one")
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise Unavailable("the body could not be decoded (the helper process died); retry") from None
        finally:
            self._waiting -= 1
            self._waiting_bytes -= size
            if self._pool is pool:
                # The pool's feeder thread keeps the last message it pickled (this body, up to
                # --max-message-bytes) until it pickles another: give it a small one.
                pool.submit(int)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
